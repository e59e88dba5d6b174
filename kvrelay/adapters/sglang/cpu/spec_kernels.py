"""Pure-torch versions of the CPU ops SGLang's speculative decoding calls.

SGLang's EAGLE / MTP worker calls these `sgl_kernel` ops on CPU
(`sglang/kernels/ops/speculative/`: `cache_locs.py`, `eagle.py`,
`multi_layer_eagle.py`, `spec_tree.py`). Each takes the arguments and
mutates the outputs the C++ op does, so SGLang's call sites run unchanged:

* slot bookkeeping: `assign_draft_cache_locs_contiguous_cpu` (the draft
  steps' KV slots), `assign_extend_cache_locs_cpu` (the verify window's),
  `fill_accept_out_cache_loc_cpu` (the accepted tokens' slots, packed);
* the draft tree: `build_tree_kernel_efficient_cpu` (mask, positions and
  the first-child / next-sibling links), `verify_tree_greedy_cpu` (the
  longest root path the target's argmax agrees with), `fill_bonus_tokens_cpu`
  (each request's last accepted token);
* `rotate_input_ids_cpu`: an extend segment shifted left by one with the
  new draft token at its end (multi-layer EAGLE).

Index tensors may be int32 or int64, as the C++ ops accept. The tree ops walk
each request's tree in Python: a tree has a few dozen nodes at most and the
walk is sequential by nature (a node's links depend on its parent's).
"""

from __future__ import annotations

import torch

QLEN_ONLY, FULL_MASK = 1, 0  # SGLang's TreeMaskMode values the CPU ops take


def _rows(req_to_token, req_pool_indices, starts, width: int) -> torch.Tensor:
    """req_to_token[req_pool_indices[i], starts[i] : starts[i] + width], one row each."""
    cols = starts.long().view(-1, 1) + torch.arange(width, device=starts.device)
    return req_to_token[req_pool_indices.long().view(-1, 1), cols]


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len: int, topk: int,
    num_steps: int,
) -> None:  # fmt: skip
    """Each request's topk * num_steps slots from seq_lens on, into out_cache_loc."""
    width = topk * num_steps
    if out_cache_loc.numel() != req_pool_indices.numel() * width:
        raise ValueError("out_cache_loc must hold topk * num_steps slots per request")
    if width and req_pool_indices.numel():
        out_cache_loc.copy_(_rows(req_to_token, req_pool_indices, seq_lens, width).reshape(-1))


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len: int
) -> None:
    """Request i's slots start_offset[i]..end_offset[i], packed in request order."""
    lengths = (end_offset - start_offset).long()
    total = int(lengths.sum()) if lengths.numel() else 0
    if total == 0:
        return
    request = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # where each request's run starts
    col = start_offset.long()[request] + torch.arange(total) - first[request]
    out_cache_loc[:total] = req_to_token[req_pool_indices.long()[request], col]


def fill_accept_out_cache_loc_cpu(
    accept_index, out_cache_loc, accept_out_cache_loc, size: int | None = None
) -> None:
    """The slots of the accepted entries (accept_index > -1), packed in order.

    `size` (the newer op's fourth argument) bounds the entries read; SGLang
    0.5.23 passes three arguments and means them all."""
    flat = accept_index.reshape(-1)
    if size is not None:
        flat = flat[:size]
    taken = flat[flat > -1].long()
    accept_out_cache_loc[: taken.numel()] = out_cache_loc[taken]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride: int) -> None:
    """bonus_tokens[i] = accept_tokens[i, accept_lens[i] - 1] (rows accept_stride wide)."""
    n = accept_lens.numel()
    index = torch.arange(n) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[index].to(bonus_tokens.dtype))


def rotate_input_ids_cpu(
    input_ids, extend_start_loc, extend_seq_lens, topk_index, select_index=None
) -> None:
    """Shift each extend segment left by one; the request's new token goes at
    the segment's end, or at select_index[i] when given. In place."""
    starts, lengths = extend_start_loc.tolist(), extend_seq_lens.tolist()
    new = topk_index.reshape(-1)
    for i, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        if length <= 0:
            continue
        if length > 1:
            input_ids[start : start + length - 1] = input_ids[start + 1 : start + length].clone()
        at = int(select_index[i]) if select_index is not None else start + length - 1
        input_ids[at] = new[i]


def _parent_row(selected: list[int], parents: list[int], node: int, topk: int) -> int | None:
    """The tree row (0 = root) of node's parent; None when it was not selected.

    `selected[node - 1]` names node's candidate among the draft steps' topk
    outputs; `// topk` is the candidate its expansion came from, 0 being the
    root's own expansion, and `parents` gives that candidate's index, which
    is found again among the selected ones."""
    source = selected[node - 1] // topk
    if source == 0:
        return 0
    token = parents[source]
    for row, candidate in enumerate(selected):
        if candidate == token:
            return row + 1
    return None


def build_tree_kernel_efficient_cpu(
    parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
    retrive_next_token, retrive_next_sibling, topk: int, depth: int, draft_token_num: int,
    tree_mask_mode: int,
) -> None:  # fmt: skip
    """The verify tree of each request's draft_token_num nodes (node 0: the
    bonus token). Writes, per request b and node t (flat index b * n + t):
    positions (seq_len + depth of t), retrive_index (the flat index),
    retrive_next_token / retrive_next_sibling (first child, next sibling;
    the caller fills both with -1) and the mask rows (t sees its ancestors
    and itself). QLEN_ONLY rows are n wide; FULL_MASK rows are seq_len + n
    wide, request after request, and only their tree columns are written."""
    if tree_mask_mode not in (QLEN_ONLY, FULL_MASK):
        raise NotImplementedError(f"tree mask mode {tree_mask_mode} (bit-packed) has no CPU op")
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    parents_all, selected_all = parent_list.tolist(), selected_index.tolist()
    next_token, next_sibling = retrive_next_token.view(-1, n), retrive_next_sibling.view(-1, n)
    mask_start = 0
    for b, seq_len in enumerate(seq_lens):
        parents, selected = parents_all[b], selected_all[b]
        retrive_index.view(-1, n)[b] = torch.arange(b * n, (b + 1) * n)
        links_first = next_token[b].tolist()
        links_sibling = next_sibling[b].tolist()
        # Children are linked from the last node back, so a parent's first
        # child is its lowest-numbered one and siblings follow in order.
        for node in range(n - 1, 0, -1):
            parent = _parent_row(selected, parents, node, topk)
            if parent is None:
                continue
            if links_first[parent] != -1:
                links_sibling[node] = links_first[parent]
            links_first[parent] = node
        next_token[b] = torch.tensor(links_first)
        next_sibling[b] = torch.tensor(links_sibling)
        width = n if tree_mask_mode == QLEN_ONLY else seq_len + n
        offset = 0 if tree_mask_mode == QLEN_ONLY else seq_len
        rows = tree_mask[mask_start : mask_start + n * width].view(n, width)
        rows[:, offset:] = False
        rows[:, offset] = True
        positions[b * n] = seq_len
        for node in range(1, n):
            level, at = 0, node
            while at is not None and at != 0:
                rows[node, offset + at] = True
                level += 1
                at = _parent_row(selected, parents, at, topk)
            positions[b * n + node] = seq_len + level
        mask_start += n * width


def verify_tree_greedy_cpu(
    predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, target_predict,
) -> None:  # fmt: skip
    """Greedy verification: from the root, step to the child whose draft token
    is the target's argmax at the last accepted node, while one is. Writes
    accept_index (flat node indices, -1 past the path), accept_token_num (the
    drafts accepted) and predicts (the target's token at each accepted node,
    the last one's being the bonus token)."""
    steps = accept_index.shape[1]
    cands, index = candidates.tolist(), retrive_index.tolist()
    first, sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(candidates.shape[0]):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, steps):
            node = first[b][node]
            while node != -1 and cands[b][node] != target[last]:
                node = sibling[b][node]
            if node == -1:
                break
            predicts[last] = target[last]
            accepted += 1
            accept_index[b, accepted] = index[b][node]
            last = index[b][node]
        accept_token_num[b] = accepted
        predicts[last] = target[last]


SPEC_OPS = {
    op.__name__: op
    for op in (
        rotate_input_ids_cpu,
        fill_accept_out_cache_loc_cpu,
        fill_bonus_tokens_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        assign_extend_cache_locs_cpu,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
    )
}
