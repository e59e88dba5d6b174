"""Plain torch-indexing gather_pages / scatter_pages: the oracle of the op tests.

Written for obviousness, not speed: one vectorised index per (layer, head),
straight from the layout formula page[head][layer] = K[token] ++ V[token].
Same signature as kvrelay._C and kvrelay.cuda_ext.numba_ref.
"""

from __future__ import annotations

import torch

from kvrelay.cuda_ext.checks import CopyArgs, check_copy_args, copy_ops


def _run(gather: bool, args: CopyArgs) -> None:
    g = check_copy_args(args, gather=gather)
    (k_layers, v_layers, pages, page_ids, slot_mapping, _, page_layers, page_head_start,
     page_layer_start, pool_head_start, num_heads) = args  # fmt: skip
    if page_ids.numel() == 0:
        return
    page_size = g.page_size
    block = page_size * (g.k_row_bytes + g.v_row_bytes)
    valid = slot_mapping >= 0  # [pages, tokens]
    safe_slots = slot_mapping.clamp(min=0)
    parts = [(k_layers, 0, g.k_row_bytes)]
    if len(v_layers):
        parts.append((v_layers, page_size * g.k_row_bytes, g.v_row_bytes))
    for layers, part_offset, row in parts:
        for layer, tensor in enumerate(layers):
            pool = tensor.view(torch.uint8)  # [slots, heads, row]
            for j in range(num_heads):
                head_rows = pool[:, pool_head_start + j, :]
                offset = (
                    (page_head_start + j) * page_layers + page_layer_start + layer
                ) * block + part_offset
                # [pages, tokens, row] window of the page objects.
                window = pages[page_ids, offset : offset + page_size * row].view(-1, page_size, row)
                if gather:
                    rows = head_rows[safe_slots]
                    rows[~valid] = 0
                    pages[page_ids, offset : offset + page_size * row] = rows.view(
                        len(page_ids), -1
                    )
                else:
                    head_rows[slot_mapping[valid]] = window[valid]


gather_pages, scatter_pages = copy_ops(_run)
