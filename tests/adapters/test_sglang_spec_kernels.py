"""The speculative-decoding stand-ins (`spec_kernels`) on small hand-checked cases.

The tree cases use SGLang's encoding of a draft tree: `selected_index[n - 1]`
names node n's candidate among the draft steps' topk outputs (step 0's are
0..topk-1, the children of the root; later steps' candidate c came from the
expansion `c // topk`), `parent_list[e]` the candidate expansion e grew
from. A chain (topk 1) is SGLang's `_topk1_*_prealloc`: parents -1, 0, 1, ..
and candidates 0, 1, 2, ...
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.adapters.sglang.cpu import spec_kernels as sk

I32, I64 = torch.int32, torch.int64


def _table() -> torch.Tensor:
    """req_to_token: row r holds 100 * r + column."""
    return (torch.arange(4).view(-1, 1) * 100 + torch.arange(12)).to(I32)


@pytest.mark.parametrize("index", [I32, I64])
def test_draft_cache_locs_are_each_requests_slots_from_its_length_on(index):
    out = torch.full((6,), -1, dtype=I64)
    rows, lens = torch.tensor([2, 0], dtype=index), torch.tensor([3, 7], dtype=index)
    sk.assign_draft_cache_locs_contiguous_cpu(rows, _table(), lens, out, 12, 1, 3)
    assert out.tolist() == [203, 204, 205, 7, 8, 9]
    with pytest.raises(ValueError, match="topk \\* num_steps"):
        sk.assign_draft_cache_locs_contiguous_cpu(rows, _table(), lens, out, 12, 2, 2)


def test_extend_cache_locs_pack_each_requests_window_in_order():
    out = torch.full((8,), -1, dtype=I64)
    rows = torch.tensor([3, 1])
    start, end = torch.tensor([2, 0], dtype=I32), torch.tensor([5, 2], dtype=I32)
    sk.assign_extend_cache_locs_cpu(rows, _table(), start, end, out, 12)
    assert out.tolist() == [302, 303, 304, 100, 101, -1, -1, -1]
    none = torch.full((2,), -1, dtype=I64)
    sk.assign_extend_cache_locs_cpu(rows, _table(), start, start, none, 12)
    assert none.tolist() == [-1, -1]


def test_accepted_slots_are_packed_and_the_rest_left_alone():
    accept_index = torch.tensor([[0, 1, -1], [4, -1, -1]], dtype=I32)
    slots = torch.arange(50, 56, dtype=I64)
    out = torch.full((6,), -1, dtype=I64)
    sk.fill_accept_out_cache_loc_cpu(accept_index, slots, out)
    assert out.tolist() == [50, 51, 54, -1, -1, -1]
    bounded = torch.full((6,), -1, dtype=I64)
    sk.fill_accept_out_cache_loc_cpu(accept_index, slots, bounded, 3)  # the first row only
    assert bounded.tolist() == [50, 51, -1, -1, -1, -1]


def test_bonus_token_is_each_requests_last_accepted_one():
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]], dtype=I32)
    bonus = torch.zeros(2, dtype=I32)
    sk.fill_bonus_tokens_cpu(tokens, torch.tensor([2, 3], dtype=I32), bonus, 3)
    assert bonus.tolist() == [6, 10]


def test_rotate_shifts_each_segment_and_places_the_new_token():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=I64)
    starts, lens = torch.tensor([0, 3, 6], dtype=I32), torch.tensor([3, 3, 0], dtype=I64)
    sk.rotate_input_ids_cpu(ids, starts, lens, torch.tensor([9, 8, 99]))
    assert ids.tolist() == [2, 3, 9, 5, 6, 8, 7]  # the empty segment is left alone
    ids = torch.tensor([1, 2, 3, 4, 5, 6], dtype=I64)
    sk.rotate_input_ids_cpu(ids, starts[:2], lens[:2], torch.tensor([9, 8]), torch.tensor([1, 4]))
    assert ids.tolist() == [2, 9, 3, 5, 8, 6]


def _tree_buffers(bs: int, n: int, mask_size: int):
    mask = torch.ones(mask_size, dtype=torch.bool)  # SGLang fills it with True
    positions = torch.empty(bs * n, dtype=I64)
    links = torch.full((3, bs, n), -1, dtype=I64)
    return mask, positions, links[0], links[1], links[2]


# topk 2, depth 2: the root's candidates 0 and 1; expansion 1 (candidate 0)
# gives candidates 2 and 3, expansion 2 (candidate 1) gives 4 and 5. Nodes:
# 1 = candidate 0, 2 = candidate 1 (both children of the root), 3 =
# candidate 4 (child of node 2).
TREE_PARENTS, TREE_SELECTED = [-1, 0, 1], [0, 1, 4]
TREE_MASK = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]


def test_tree_links_positions_and_qlen_mask_of_a_two_branch_tree():
    parents = torch.tensor([TREE_PARENTS, [-1, 0, 1]])
    # The second request's nodes: candidates 0, 2, 3 (node 1 and its two children).
    selected = torch.tensor([TREE_SELECTED, [0, 2, 3]])
    mask, pos, index, first, sibling = _tree_buffers(2, 4, 2 * 16)
    sk.build_tree_kernel_efficient_cpu(parents, selected, torch.tensor([7, 3]), mask, pos,
                                       index, first, sibling, 2, 2, 4, sk.QLEN_ONLY)  # fmt: skip
    assert index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert first.tolist() == [[1, -1, 3, -1], [1, 2, -1, -1]]
    assert sibling.tolist() == [[-1, 2, -1, -1], [-1, -1, 3, -1]]
    assert pos.tolist() == [7, 8, 8, 9, 3, 4, 5, 5]
    assert mask.view(2, 4, 4)[0].int().tolist() == TREE_MASK
    assert mask.view(2, 4, 4)[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0],
                                                     [1, 1, 0, 1]]  # fmt: skip


def test_full_mask_rows_cover_the_prefix_and_leave_its_columns():
    seq = 2
    mask, pos, index, first, sibling = _tree_buffers(1, 4, 4 * (seq + 4))
    sk.build_tree_kernel_efficient_cpu(torch.tensor([TREE_PARENTS]), torch.tensor([TREE_SELECTED]),
                                       torch.tensor([seq]), mask, pos, index, first, sibling, 2,
                                       2, 4, sk.FULL_MASK)  # fmt: skip
    rows = mask.view(4, seq + 4)
    assert rows[:, :seq].all()  # the prefix's columns: as SGLang filled them
    assert rows[:, seq:].int().tolist() == TREE_MASK
    with pytest.raises(NotImplementedError, match="bit-packed"):
        tree = torch.tensor([TREE_PARENTS]), torch.tensor([TREE_SELECTED]), torch.tensor([seq])
        sk.build_tree_kernel_efficient_cpu(*tree, mask, pos, index, first, sibling, 2, 2, 4, 2)


def test_a_chain_is_a_line_of_first_children():
    depth = 3
    parents = torch.arange(-1, depth - 1).view(1, -1).to(I32)
    selected = torch.arange(depth).view(1, -1).to(I32)
    mask, pos, index, first, sibling = _tree_buffers(1, depth + 1, (depth + 1) ** 2)
    pos, index, first, sibling = (t.to(I32) for t in (pos, index, first, sibling))
    sk.build_tree_kernel_efficient_cpu(parents, selected, torch.tensor([5], dtype=I32), mask, pos,
                                       index, first, sibling, 1, depth, depth + 1,
                                       sk.QLEN_ONLY)  # fmt: skip
    assert first.tolist() == [[1, 2, 3, -1]] and sibling.tolist() == [[-1] * 4]
    assert pos.tolist() == [5, 6, 7, 8]
    assert torch.equal(mask.view(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


def test_greedy_verify_follows_the_targets_argmax_through_siblings():
    # Request 0: the tree above with drafts a=11, b=12, c=13; the target
    # wants b after the root (node 1 is passed over for its sibling), c after
    # b, then 40 (the bonus). Request 1: a chain 20, 21, 22 whose first draft
    # is already wrong: nothing accepted, the bonus is the root's argmax.
    candidates = torch.tensor([[10, 11, 12, 13], [19, 20, 21, 22]])
    index = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    first = torch.tensor([[1, -1, 3, -1], [1, 2, 3, -1]])
    sibling = torch.tensor([[-1, 2, -1, -1], [-1, -1, -1, -1]])
    target = torch.tensor([[12, 30, 13, 40], [50, 21, 22, 23]])
    predicts = torch.full((8,), -1, dtype=I32)
    accept_index = torch.full((2, 3), -1, dtype=I32)
    accepted = torch.zeros(2, dtype=I32)
    sk.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index,
                              accept_token_num=accepted, candidates=candidates,
                              retrive_index=index, retrive_next_token=first,
                              retrive_next_sibling=sibling, target_predict=target)  # fmt: skip
    assert accept_index.tolist() == [[0, 2, 3], [4, -1, -1]]
    assert accepted.tolist() == [2, 0]
    assert predicts.tolist() == [12, -1, 13, 40, 50, -1, -1, -1]
