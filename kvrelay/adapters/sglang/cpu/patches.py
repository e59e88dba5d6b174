"""Apply the CPU stand-ins to SGLang, each only where what it replaces is missing.

`apply()` runs before SGLang is imported (the launcher does it in every
process SGLang starts) and logs one line per stand-in it applies:

* `sgl_kernel`: SGLang's CPU engine imports `copy_all_layer_kv_cache_cpu`
  (kernels/ops/kvcache/cache_move.py) and `assign_req_to_token_pool_cpu`
  (mem_cache/allocation.py) from it at import time. When `sgl_kernel` does not
  import, a module of that name holding the two pure-torch ops
  (`kernels.py`) takes its place, with the seven speculative-decoding ops
  SGLang's EAGLE / MTP worker calls (`spec_kernels.py`); any other name asked
  of it fails as a missing name would.
* Speculative decoding on `torch_native` attention (`spec_attention.py`):
  target verify, the draft's extend and its decode steps for draft chains
  (topk 1), and `torch.cuda.synchronize` as a no-op on a CPU-only torch
  (DeepSeek's draft calls it after sharing the target's embedding and head).
* HiCache's host<->device transfers, those of the `direct` io backend
  (`transfer_kv_direct` and the page_first_direct pair) and those of the
  `kernel` io backend (per-layer loads and all-layer backups for the
  layer_first, page_first and page_head host layouts, MHA and MLA): its host
  pools import them from `sgl_kernel.kvcacheio` on CUDA/HIP only, so on CPU
  they are unbound names.
* Host-pool pinning: pools pin through `torch.cuda.cudart()` and allocate
  dummy pages with `pin_memory=True`; with no accelerator there is nothing to
  pin for, so pools are built unpinned.
* torchvision: the package index's build is CUDA-only and its C++ ops do not
  load beside a CPU torch; the two op schemas its Python side needs are
  declared so that SGLang's config package can import it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import inspect
import logging
import re
import sys
import types

import torch

from kvrelay.adapters.sglang.cpu import kernels, spec_kernels

log = logging.getLogger("kvrelay.sglang.cpu")

ENGINE_OPS = ("copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu")
# Speculative decoding's CPU ops: SGLang's scheduler modules import them
# whether or not a draft model is configured.
SPEC_OPS = tuple(spec_kernels.SPEC_OPS)
DIRECT_TRANSFERS = (
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
)
KERNEL_TRANSFERS = (
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
)
HOST_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla")

applied: list[str] = []  # what this process stands in for, in order
_applied_all = False


def _note(what: str) -> None:
    applied.append(what)
    log.warning("kvrelay SGLang CPU layer: %s", what)


def _stand_in_module(name: str, functions: dict) -> types.ModuleType:
    module = types.ModuleType(name, f"kvrelay's pure-torch stand-in for {name} (CPU)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(functions)

    def __getattr__(attr: str):
        raise AttributeError(f"{name} is kvrelay's CPU stand-in; it has no {attr!r}")

    module.__getattr__ = __getattr__
    return module


def _broken(name: str) -> bool:
    """True when `name` does not import (missing, or its native part fails to load)."""
    if name in sys.modules:
        return sys.modules[name] is None
    try:
        importlib.import_module(name)
    except (ImportError, OSError, RuntimeError):
        for key in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[key]
        return True
    return False


def stand_in_engine_ops() -> None:
    if not _broken("sgl_kernel"):
        missing = [op for op in ENGINE_OPS if not hasattr(sys.modules["sgl_kernel"], op)]
        if missing:
            raise RuntimeError(f"sgl_kernel imports but lacks {missing}: not a CPU build")
        return
    ops = {op: getattr(kernels, op) for op in ENGINE_OPS} | spec_kernels.SPEC_OPS
    sys.modules["sgl_kernel"] = _stand_in_module("sgl_kernel", ops)
    _note(f"sgl_kernel does not import: pure-torch {', '.join(ENGINE_OPS)}")
    _note(f"sgl_kernel's speculative-decoding ops: pure-torch {', '.join(SPEC_OPS)}")


def torchvision_op_schemas() -> None:
    """Declare `torchvision::nms` / `qnms` when torchvision's C++ ops do not load.

    The index's torchvision is a CUDA build: its C++ ops fail to load beside a
    CPU torch and its Python side then registers fake kernels for those two
    ops, which were never declared, and fails. SGLang's config package imports
    torchvision (multimodal preprocessing); with the two schemas declared the
    rest of it imports. Text models never call them.
    """
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        schema = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
        for op in ("nms", "qnms"):
            torch.library.define(f"torchvision::{op}", schema)
        import torchvision  # noqa: F401

        _note("torchvision's C++ ops do not load: nms/qnms schemas declared (never called)")


def stand_in_host_pool() -> None:
    """Bind the direct transfers where the host pool modules left them unbound,
    and build host pools unpinned when no accelerator is present."""
    from sglang.srt.mem_cache.pool_host import base

    for name in HOST_POOL_MODULES:
        module = importlib.import_module(name)
        # Only the names the module's own kvcacheio import would have bound.
        source = inspect.getsource(module)
        ops = DIRECT_TRANSFERS + KERNEL_TRANSFERS
        wanted = [op for op in ops if re.search(rf"\b{op}\b", source)]
        unbound = [op for op in wanted if not hasattr(module, op)]
        for op in unbound:
            setattr(module, op, getattr(kernels, op))
        if unbound:
            _note(f"{name.rsplit('.', 1)[-1]} host pool: pure-torch {', '.join(unbound)}")
    if torch.cuda.is_available() or getattr(base.HostKVCache.__init__, "_kvrelay", False):
        return
    init = base.HostKVCache.__init__

    def unpinned_init(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    unpinned_init._kvrelay = True
    base.HostKVCache.__init__ = unpinned_init
    _note("no accelerator: HiCache host pools are not pinned (cudaHostRegister, pin_memory)")


def mla_on_torch_native() -> None:
    """DeepSeek-style MLA on `torch_native`: SGLang's dispatch picks its MHA
    form for a prefill without prefix, which reads the latent cache as MHA K;
    the absorbed MLA form (`_dispatch_mla_subtype`) reads it as it is stored."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers

    registry = handlers.AttentionBackendRegistry
    if "torch_native" in registry._handlers:
        return
    registry.register("torch_native", handlers._dispatch_mla_subtype)
    _note("MLA models on torch_native attention: the absorbed MLA form for every batch")


def speculative_on_torch_native() -> None:
    """EAGLE / MTP draft chains on `torch_native` attention (`spec_attention`)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from kvrelay.adapters.sglang.cpu import spec_attention

    if getattr(DraftBackendFactory._create_backend, "_kvrelay", False):
        return
    TorchNativeAttnBackend.forward_extend = spec_attention.forward_extend
    create = DraftBackendFactory._create_backend

    def create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        # SGLang's own entry, should it gain one, comes after and wins.
        entry = functools.partial(spec_attention.draft_backend_entry, self, stamps_children)
        backend_map = {"torch_native": entry, **backend_map}
        return create(self, backend_name, backend_map, error_template, stamps_children)

    create_backend._kvrelay = True
    DraftBackendFactory._create_backend = create_backend
    _note("speculative decoding on torch_native: target verify, draft extend and "
          "draft steps for chains (topk 1)")  # fmt: skip
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
        _note("no accelerator: torch.cuda.synchronize waits for nothing")


def apply() -> list[str]:
    """Apply every stand-in this process needs; returns what was stood in for."""
    global _applied_all
    if _applied_all:
        return applied
    _applied_all = True
    torchvision_op_schemas()
    stand_in_engine_ops()
    stand_in_host_pool()
    mla_on_torch_native()
    speculative_on_torch_native()
    return applied
