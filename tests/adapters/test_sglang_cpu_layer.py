"""The CPU layer's pure-torch ops against plain-indexing references, and its
patches as a process applies them (SGLang imported after `apply()`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvrelay.adapters.sglang.cpu import kernels

PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 5


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def test_copy_all_layer_kv_cache_moves_rows_of_every_buffer_even_overlapping():
    buffers = [torch.randn(10, 3, dtype=torch.float32), torch.randn(10, 7, dtype=torch.bfloat16)]
    want = [b.clone() for b in buffers]
    src, tgt = torch.tensor([1, 2, 3]), torch.tensor([2, 3, 8])  # 2 and 3: read, then written
    for w in want:
        w[tgt] = w[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, w in zip(buffers, want, strict=True):
        assert torch.equal(b, w)
    with pytest.raises(ValueError, match="2 source rows for 3 targets"):
        kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src[:2])


def test_assign_req_to_token_pool_lays_requests_runs_end_to_end():
    table = torch.zeros(4, 12, dtype=torch.int32)
    want = table.clone()
    rows, starts, ends = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([7, 2])
    locs = torch.arange(100, 106, dtype=torch.int64)
    want[2, 3:7] = torch.tensor([100, 101, 102, 103])
    want[0, 0:2] = torch.tensor([104, 105])
    kernels.assign_req_to_token_pool_cpu(rows, table, starts, ends, locs, 12)
    assert torch.equal(table, want)
    with pytest.raises(ValueError, match="outside a row of 12"):
        kernels.assign_req_to_token_pool_cpu(rows, table, starts, ends + 10, locs, 12)


def test_transfer_kv_direct_copies_token_slots_per_layer():
    src = [torch.randn(6 * PAGE, HEADS, DIM) for _ in range(2 * LAYERS)]
    dst = [torch.zeros(8 * PAGE, HEADS, DIM) for _ in range(2 * LAYERS)]
    s, d = _slots([1, 4]), _slots([7, 0])
    kernels.transfer_kv_direct(src, dst, s, d, PAGE)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(b[d], a[s])
        assert not b[_slots([1])].any()  # untouched
    with pytest.raises(ValueError, match="not whole pages"):
        kernels.transfer_kv_direct(src, dst, s[:-1], d[:-1], PAGE)


def test_page_first_direct_transfers_both_ways():
    device_k = [torch.randn(6 * PAGE, HEADS, DIM) for _ in range(LAYERS)]
    device_v = [torch.randn(6 * PAGE, HEADS, DIM) for _ in range(LAYERS)]
    host_k = torch.zeros(5, LAYERS, PAGE, HEADS, DIM)  # [page, layer, token, head, dim]
    host_v = torch.zeros_like(host_k)
    dev, host = _slots([2, 5]), _slots([3, 1])
    kernels.transfer_kv_all_layer_direct_lf_pf(device_k + device_v, [host_k, host_v], dev, host,
                                               PAGE)  # fmt: skip
    for layer in range(LAYERS):
        for i, h in enumerate(host.tolist()):
            assert torch.equal(host_k[h // PAGE, layer, h % PAGE], device_k[layer][dev[i]])
            assert torch.equal(host_v[h // PAGE, layer, h % PAGE], device_v[layer][dev[i]])
    back_k, back_v = torch.zeros(6 * PAGE, HEADS, DIM), torch.zeros(6 * PAGE, HEADS, DIM)
    target = _slots([0, 4])
    kernels.transfer_kv_per_layer_direct_pf_lf([host_k, host_v], [back_k, back_v], host, target,
                                               1, PAGE)  # fmt: skip
    assert torch.equal(back_k[target], device_k[1][dev])
    assert torch.equal(back_v[target], device_v[1][dev])


def test_a_process_gets_the_stand_ins_and_sglang_imports_them():
    """In a fresh process (SGLang's CPU engine on), as the launcher applies it."""
    code = (
        "import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'\n"
        "from kvrelay.adapters.sglang.cpu.patches import apply\n"
        "done = apply()\n"
        "from sglang.srt.mem_cache import allocation\n"
        "from sglang.kernels.ops.kvcache import cache_move\n"
        "from sglang.srt.mem_cache.pool_host import mha, base\n"
        "from kvrelay.adapters.sglang.cpu import kernels\n"
        "assert allocation.assign_req_to_token_pool_cpu is kernels.assign_req_to_token_pool_cpu\n"
        "assert cache_move.copy_all_layer_kv_cache_cpu is kernels.copy_all_layer_kv_cache_cpu\n"
        "assert mha.transfer_kv_direct is kernels.transfer_kv_direct\n"
        "import sgl_kernel\n"
        "try:\n"
        "    sgl_kernel.verify_tree_greedy_cpu()\n"
        "except NotImplementedError as e:\n"
        "    assert 'speculative decoding' in str(e)\n"
        "else:\n"
        "    raise AssertionError('a speculative op ran')\n"
        "try:\n"
        "    from sgl_kernel import rmsnorm_cpu\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('an op with no stand-in imported')\n"
        "print(len(done))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr
    assert "pure-torch copy_all_layer_kv_cache_cpu, assign_req_to_token_pool_cpu" in log
    assert "mha host pool: pure-torch transfer_kv_direct" in log
    assert "HiCache host pools are not pinned" in log
