"""numba implementation of gather_pages / scatter_pages, same signature as kvrelay._C.

Used when the compiled module is not built (or KVRELAY_NO_EXT=1), and as the
second, independent implementation the compiled ops are tested against. It
works on byte views of the tensors, so every KV dtype (fp8 included) is copied
bit for bit. CPU tensors only.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba.typed import List

from kvrelay.cuda_ext.checks import CopyArgs, check_copy_args, copy_ops


@numba.njit(cache=True, nogil=True)
def _copy_kernel(
    k_rows,
    v_rows,
    pages,
    page_ids,
    slots,
    page_layers,
    page_head_start,
    page_layer_start,
    pool_head_start,
    num_heads,
    gather,
):
    page_size = slots.shape[1]
    k_row = k_rows[0].shape[2]
    v_row = v_rows[0].shape[2] if len(v_rows) > 0 else 0
    block_bytes = page_size * (k_row + v_row)
    for i in range(page_ids.shape[0]):
        page = pages[page_ids[i]]
        for j in range(num_heads):
            head = pool_head_start + j
            for layer in range(len(k_rows)):
                block = (
                    (page_head_start + j) * page_layers + page_layer_start + layer
                ) * block_bytes
                for t in range(page_size):
                    slot = slots[i, t]
                    k_dst = block + t * k_row
                    v_dst = block + page_size * k_row + t * v_row
                    if slot < 0:
                        if gather:
                            page[k_dst : k_dst + k_row] = 0
                            if v_row:
                                page[v_dst : v_dst + v_row] = 0
                        continue
                    if gather:
                        page[k_dst : k_dst + k_row] = k_rows[layer][slot, head, :]
                        if v_row:
                            page[v_dst : v_dst + v_row] = v_rows[layer][slot, head, :]
                    else:
                        k_rows[layer][slot, head, :] = page[k_dst : k_dst + k_row]
                        if v_row:
                            v_rows[layer][slot, head, :] = page[v_dst : v_dst + v_row]


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """[slots, heads, head_dim] of any dtype as [slots, heads, head_dim * itemsize] uint8."""
    return t.view(torch.uint8).numpy()


def _typed_rows(layers, like: np.ndarray) -> List:
    rows = List.empty_list(numba.typeof(like))
    for t in layers:
        rows.append(_byte_view(t))
    return rows


def _run(gather: bool, args: CopyArgs) -> None:
    check_copy_args(args, gather=gather)
    if args.pages.device.type != "cpu":
        raise ValueError("the numba gather/scatter runs on CPU tensors only; build kvrelay._C")
    if args.page_ids.numel() == 0:
        return
    first = _byte_view(args.k_layers[0])
    k_rows = _typed_rows(args.k_layers, first)
    v_layers = args.v_layers
    v_rows = _typed_rows(v_layers, first if not len(v_layers) else _byte_view(v_layers[0]))
    _copy_kernel(
        k_rows,
        v_rows,
        args.pages.numpy(),
        args.page_ids.numpy(),
        args.slot_mapping.numpy(),
        args.page_layers,
        args.page_head_start,
        args.page_layer_start,
        args.pool_head_start,
        args.num_heads,
        gather,
    )


gather_pages, scatter_pages = copy_ops(_run)
