"""The CPU layer's pure-torch ops against plain-indexing references, and its
patches as a process applies them (SGLang imported after `apply()`)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from kvrelay.adapters.sglang.cpu import kernels, patches

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


def _host_slot(pool, layout: str, kv: int, layer: int, slot: int) -> torch.Tensor:
    """Plain indexing of one token's heads in a host pool, per layout."""
    page, token = divmod(slot, pool.page_size)
    return {
        "layer_first": lambda: pool.kv_buffer[kv, layer, slot],
        "page_first": lambda: pool.kv_buffer[kv, slot, layer],
        "page_head": lambda: pool.kv_buffer[kv, page, :, token, layer],
    }[layout]()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_kernel_io_backend_backs_up_and_loads_through_sglangs_host_pool(layout, monkeypatch):
    """SGLang's own MHA host pool drives the stand-ins (`kernel` io backend)."""
    from tests.adapters import sglang_env as env  # first: it readies SGLang's import

    mha = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")

    for op in patches.KERNEL_TRANSFERS:
        monkeypatch.setattr(mha, op, getattr(kernels, op), raising=False)
    pool = env.mha_pool(layout, heads=HEADS, layers=LAYERS, start_layer=0, page_size=PAGE,
                        head_dim=8, dtype=torch.bfloat16, device_tokens=8 * PAGE)  # fmt: skip
    device_k, device_v = pool.device_k_buffers, pool.device_v_buffers
    for buffer in (*device_k, *device_v):
        buffer.copy_(torch.randn(buffer.shape).to(buffer.dtype))
    dev, host = _slots([2, 5, 6]), _slots([9, 1, 4])
    pool.backup_from_device_all_layer(None, host, dev, "kernel")
    for layer in range(LAYERS):
        for kv, device in ((0, device_k), (1, device_v)):
            for d, h in zip(dev.tolist(), host.tolist(), strict=True):
                assert torch.equal(_host_slot(pool, layout, kv, layer, h), device[layer][d])
    assert not _host_slot(pool, layout, 0, 0, _slots([0])[1].item()).any()  # untouched
    target = _slots([0, 7, 3])
    for buffer in (*device_k, *device_v):
        buffer.zero_()
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(None, host, target, layer, "kernel")
    for layer in range(LAYERS):
        for kv, device in ((0, device_k), (1, device_v)):
            for d, h in zip(target.tolist(), host.tolist(), strict=True):
                assert torch.equal(device[layer][d], _host_slot(pool, layout, kv, layer, h))
    assert not device_k[0][_slots([1])].any()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_kernel_io_backend_moves_mla_rows_through_sglangs_host_pool(layout, monkeypatch):
    from tests.adapters import sglang_env as env  # first: it readies SGLang's import

    mla = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")

    for op in patches.KERNEL_TRANSFERS:
        monkeypatch.setattr(mla, op, getattr(kernels, op), raising=False)
    pool = env.mla_pool(layout, layers=LAYERS, start_layer=0, page_size=PAGE, width=16,
                        dtype=torch.bfloat16)  # fmt: skip
    device = pool.device_kv_buffers  # one [slot, 1, width] buffer per layer
    for buffer in device:
        buffer.copy_(torch.randn(buffer.shape).to(buffer.dtype))
    dev, host = _slots([1, 3]), _slots([5, 0])
    pool.backup_from_device_all_layer(None, host, dev, "kernel")

    def rows(layer: int, slot: int) -> torch.Tensor:
        first = layout == "layer_first"
        return pool.kv_buffer[layer, slot] if first else pool.kv_buffer[slot, layer]

    for layer in range(LAYERS):
        for d, h in zip(dev.tolist(), host.tolist(), strict=True):
            assert torch.equal(rows(layer, h), device[layer][d])
    for buffer in device:
        buffer.zero_()
    target = _slots([2, 0])
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(None, host, target, layer, "kernel")
        assert torch.equal(device[layer][target], torch.stack([rows(layer, h) for h in host]))


def test_kernel_ops_skip_negative_rows_and_refuse_bad_sizes():
    src, dst = torch.randn(6, 4), torch.zeros(6, 4)
    kernels.transfer_kv_per_layer(src, dst, src, dst.clone(), torch.tensor([1, -1, 2]),
                                  torch.tensor([0, 3, -1]), 16)  # fmt: skip
    assert torch.equal(dst[0], src[1]) and not dst[1:].any()
    with pytest.raises(ValueError, match="not whole rows"):
        kernels.transfer_kv_per_layer_ph_lf(src, dst, src, dst, torch.tensor([0]),
                                            torch.tensor([0]), 0, 15, 30, 2, 2)  # fmt: skip
    with pytest.raises(ValueError, match="address table"):
        table = torch.tensor([src.data_ptr()], dtype=torch.uint64)
        kernels.transfer_kv_all_layer(table, table, table, table, torch.tensor([0]),
                                      torch.tensor([1]), 16, 2)  # fmt: skip


# SGLang's own tree build and greedy verify (eagle_utils, spec_tree) for a
# chain of three drafts, through the stand-ins; defined first, called last.
CHAIN = """
def chain():
    import torch
    from sglang.srt.speculative.eagle_utils import build_tree_kernel_efficient
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode, verify_tree_greedy_func
    parents, selected = torch.arange(-1, 2).view(1, 3), torch.arange(3).view(1, 3)
    tree = build_tree_kernel_efficient(torch.tensor([4]), parents, selected,
                                       torch.tensor([[5, 6, 7]]), torch.tensor([9]), 9, 1, 3, 4,
                                       TreeMaskMode.QLEN_ONLY)
    mask, positions, index, first, sibling, drafts = tree
    assert positions.tolist() == [9, 10, 11, 12] and drafts.tolist() == [4, 5, 6, 7]
    predicts, accept_index, accepted = verify_tree_greedy_func(
        torch.zeros(4, dtype=torch.int32), torch.full((1, 4), -1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), drafts.view(1, 4), index, first, sibling,
        torch.tensor([[5, 6, 9, 0]]))
    return f"{accept_index.tolist()} {accepted.tolist()} {predicts.tolist()}"
"""


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
        "assert mha.transfer_kv_all_layer_lf_ph is kernels.transfer_kv_all_layer_lf_ph\n"
        "from sglang.srt.models.deepseek_common import attention_backend_handler as h\n"
        "assert h.AttentionBackendRegistry.get_handler('torch_native') is h._dispatch_mla_subtype\n"
        "from sglang.kernels.ops.speculative import cache_locs, spec_tree\n"
        "from kvrelay.adapters.sglang.cpu import spec_kernels as sk\n"
        "assert spec_tree.sgl_verify_tree_greedy_cpu is sk.verify_tree_greedy_cpu\n"
        "assert cache_locs.assign_extend_cache_locs_cpu is sk.assign_extend_cache_locs_cpu\n"
        "from sglang.srt.speculative.draft_utils import DraftBackendFactory\n"
        "assert DraftBackendFactory._create_backend._kvrelay\n"
        "from types import SimpleNamespace\n"
        "from kvrelay.adapters.sglang.cpu import spec_attention\n"
        "try:\n"
        "    spec_attention.draft_backend_entry(SimpleNamespace(topk=2), True)\n"
        "except NotImplementedError as e:\n"
        "    assert '--speculative-eagle-topk 1' in str(e)\n"
        "else:\n"
        "    raise AssertionError('a draft tree on torch_native')\n"
        "print(chain())\n"
        "try:\n"
        "    from sgl_kernel import rmsnorm_cpu\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('an op with no stand-in imported')\n"
        "print(len(done))\n"
    )
    done = subprocess.run([sys.executable, "-c", CHAIN + code], capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # Drafts 5, 6, 7 after the bonus 4; the target agrees with 5 and 6 only.
    assert done.stdout.splitlines()[0] == "[[0, 1, 2, -1]] [2] [5, 6, 9, 0]"
    log = done.stderr
    assert "speculative-decoding ops: pure-torch rotate_input_ids_cpu" in log
    assert "speculative decoding on torch_native" in log
    assert "pure-torch copy_all_layer_kv_cache_cpu, assign_req_to_token_pool_cpu" in log
    assert "mha host pool: pure-torch transfer_kv_direct" in log
    assert "transfer_kv_per_layer_ph_lf" in log and "transfer_kv_all_layer_mla_lf_pf" in log
    assert "HiCache host pools are not pinned" in log
    assert "MLA models on torch_native attention" in log
