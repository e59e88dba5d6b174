"""Builds kvrelay and its compiled module kvrelay._C.

Install with `pip install --no-build-isolation -e .` so the build uses the torch
already installed (an isolated build would fetch another torch). The CUDA
sources are compiled when torch has CUDA and a CUDA toolkit is found; set
KVRELAY_NO_CUDA=1 to build the CPU ops only.

The UCX binding kvrelay._ucx is a second module, linked against libucp from
UCX_HOME when set (a system UCX, e.g. with verbs) or else from the
`libucx-cu12` wheel; without UCX it is skipped and the rest still builds.
"""

import os
from pathlib import Path

from setuptools import Extension, find_packages, setup
from torch.utils import cpp_extension

ROOT = Path(__file__).parent
CSRC = Path("kvrelay/cuda_ext/csrc")
UCX_CSRC = Path("kvrelay/transfer/csrc")


class IncrementalBuildExt(cpp_extension.BuildExtension):
    """Keeps ninja's objects in build/temp, also under `pip install -e`, whose
    own temporary build folder would otherwise recompile every source on every
    install; a re-install then recompiles only the sources that changed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, use_ninja=True, **kwargs)

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = str(ROOT / "build" / "temp")


def want_cuda() -> bool:
    if os.environ.get("KVRELAY_NO_CUDA") == "1":
        return False
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def extensions():
    sources = [str(CSRC / "bindings.cpp"), str(CSRC / "page_copy_cpu.cpp")]
    cxx_flags = ["-O3", "-std=c++20", "-Wall", "-Wno-unused-function"]
    kwargs = {"include_dirs": [str(ROOT / CSRC)]}
    if want_cuda():
        sources.append(str(CSRC / "page_copy_cuda.cu"))
        return [
            cpp_extension.CUDAExtension(
                "kvrelay._C",
                sources,
                define_macros=[("KVRELAY_WITH_CUDA", None)],
                extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
                **kwargs,
            )
        ]
    return [
        cpp_extension.CppExtension(
            "kvrelay._C", sources, extra_compile_args={"cxx": cxx_flags}, **kwargs
        )
    ]


def find_ucx() -> Path | None:
    """UCX_HOME if set, else the libucx wheel's folder (include/ and lib/)."""
    if home := os.environ.get("UCX_HOME"):
        return Path(home)
    import importlib.util

    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def ucx_extension():
    ucx = find_ucx()
    if ucx is None or not (ucx / "include" / "ucp" / "api" / "ucp.h").is_file():
        print("kvrelay: UCX not found (set UCX_HOME or install libucx-cu12); skipping kvrelay._ucx")
        return []
    lib = ucx / "lib"
    return [
        cpp_extension.CppExtension(
            "kvrelay._ucx",
            [str(UCX_CSRC / "ucx_binding.cpp")],
            include_dirs=[str(ucx / "include")],
            library_dirs=[str(lib)],
            libraries=["ucp", "ucs"],
            # The rpath finds libucp at run time without LD_LIBRARY_PATH.
            extra_link_args=[f"-Wl,-rpath,{lib}"],
            extra_compile_args={"cxx": ["-O3", "-std=c++20", "-Wall"]},
        )
    ]


def eviction_extensions():
    """The compiled eviction policies (prefix-LRU, prefix-LIRS): plain CPython, no torch."""
    csrc = Path("kvrelay/cache/eviction/csrc")
    flags = {"cxx": ["-O3", "-std=c++17", "-Wall"]}
    return [
        Extension(
            "kvrelay.cache.eviction._prefix_lru",
            [str(csrc / "prefix_lru_module.cpp")],
            include_dirs=[str(ROOT / csrc)],
            extra_compile_args=flags,
        ),
        Extension(
            "kvrelay.cache.eviction._lirs",
            [str(path) for path in sorted(csrc.glob("lirs_*.cpp"))],
            include_dirs=[str(ROOT / csrc)],
            extra_compile_args=flags,
        ),
    ]


def run_copy_extension():
    """The same-host fast path's batch copier: plain CPython, no torch, no UCX."""
    return Extension(
        "kvrelay.transfer._runcopy",
        [str(UCX_CSRC / "run_copy.cpp"), str(UCX_CSRC / "slot_board_ops.cpp")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17", "-Wall"]},
    )


setup(
    name="kvrelay",
    version="0.1.0",
    description="Move and reuse LLM KV cache across prefill, decode and a shared cache tier",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["kvrelay", "kvrelay.*"]),
    install_requires=[
        "torch>=2.4",
        "numpy",
        "numba",
        "msgpack",
        "msgspec",
        "safetensors",
        "redis",
        "tqdm",
        "matplotlib",
        "fastapi",
        "uvicorn",
        "httpx",
        "prometheus-client",
        "tokenizers",
        "jinja2",
    ],
    ext_modules=extensions() + ucx_extension() + [run_copy_extension(), *eviction_extensions()],
    cmdclass={"build_ext": IncrementalBuildExt},
    entry_points={"console_scripts": ["kvrelay=kvrelay.cli:main"]},
)
