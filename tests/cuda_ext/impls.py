"""The implementations of gather/scatter_pages under test, and pool builders."""

import os

import pytest
import torch

import kvrelay.cuda_ext as ops
from kvrelay.cuda_ext import numba_ref, torch_ref
from kvrelay.cuda_ext.backend import compiled_module

NO_EXT = os.environ.get("KVRELAY_NO_EXT") == "1"


def compiled():
    if NO_EXT:
        pytest.skip("KVRELAY_NO_EXT=1: the compiled module is not under test")
    module = compiled_module()
    assert module is not None, "kvrelay._C is not built: run `make setup`"
    return module


class Dispatch:
    """kvrelay.cuda_ext's public functions, positional like the others."""

    @staticmethod
    def gather_pages(k, v, pages, ids, slots, ph, pl, phs, pls, poolh, nh):
        ops.gather_pages(
            k,
            v,
            pages,
            ids,
            slots,
            page_heads=ph,
            page_layers=pl,
            page_head_start=phs,
            page_layer_start=pls,
            pool_head_start=poolh,
            num_heads=nh,
        )

    @staticmethod
    def scatter_pages(k, v, pages, ids, slots, ph, pl, phs, pls, poolh, nh):
        ops.scatter_pages(
            k,
            v,
            pages,
            ids,
            slots,
            page_heads=ph,
            page_layers=pl,
            page_head_start=phs,
            page_layer_start=pls,
            pool_head_start=poolh,
            num_heads=nh,
        )


class OnCuda:
    """The compiled op on a GPU, positional like the others, for CPU tensors:
    every argument is copied to the GPU (strides kept), the kernel runs on the
    current stream, and what it wrote is copied back in place."""

    @staticmethod
    def gather_pages(k, v, pages, ids, slots, *geometry):
        dev = torch.device("cuda")
        on_gpu = pages.to(dev)
        compiled().gather_pages(
            _to(k, dev), _to(v, dev), on_gpu, ids.to(dev), slots.to(dev), *geometry
        )
        torch.cuda.synchronize()
        pages.copy_(on_gpu.cpu())

    @staticmethod
    def scatter_pages(k, v, pages, ids, slots, *geometry):
        dev = torch.device("cuda")
        k_gpu, v_gpu = _to(k, dev), _to(v, dev)
        compiled().scatter_pages(k_gpu, v_gpu, pages.to(dev), ids.to(dev), slots.to(dev), *geometry)
        torch.cuda.synchronize()
        for host, gpu in zip(list(k) + list(v), k_gpu + v_gpu, strict=True):
            host.copy_(gpu.cpu())


def _to(layers, device) -> list:
    # .to keeps a dense tensor's strides (head-major pools stay head-major).
    return [t.to(device) for t in layers]


IMPLS = {
    "cuda": lambda: OnCuda,
    "cpp": compiled,
    "numba": lambda: numba_ref,
    "dispatch": lambda: Dispatch,
    "torch": lambda: torch_ref,
}

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8-as-uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def random_pool(gen, num_slots, heads, dim, dtype, layers, layers_in_slot=False):
    """Per-layer [num_slots, heads, dim] tensors of random bits (any dtype, NaNs
    included); `layers_in_slot`: views of one [num_slots, layers, heads, dim]
    buffer, a slot holding every layer's rows of its token (SGLang's page_first)."""
    if layers_in_slot:
        shape = (num_slots, layers, heads, dim * dtype.itemsize)
        buffer = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype)
        return [buffer[:, layer] for layer in range(layers)]
    shape = (num_slots, heads, dim * dtype.itemsize)
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype)
        for _ in range(layers)
    ]
