"""Exported unified pages against the model's own K and V, position by position.

Logits cannot see a consistent permutation of K and V, so every element of
every exported page is compared, at the byte position the layout gives it,
with HF transformers' cache (post-RoPE K, V) for the same prompt.
"""

import numpy as np
import pytest
import torch

from kvrelay.model import PoolExhausted, Request, SamplingParams, load_engine
from kvrelay.model.errors import PrefixNotCached
from kvrelay.model.page_export import export_prefix, import_prefix
from tests.model.oracle import hf_greedy, hf_model
from tests.support.models import prompt_tokens


def unpack_pages(arena: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of page objects as [pages, heads, layers, page_size, head_dim],
    read at the offsets `spec.block_offset` names."""
    dtype = getattr(torch, spec.kv_dtype)
    num_pages = arena.size(0)
    k = torch.empty(num_pages, spec.num_kv_heads, spec.num_layers, spec.page_size, spec.k_head_dim)
    v = torch.empty(num_pages, spec.num_kv_heads, spec.num_layers, spec.page_size, spec.v_head_dim)
    k, v = k.to(dtype), v.to(dtype)
    for head in range(spec.num_kv_heads):
        for layer in range(spec.num_layers):
            at = spec.block_offset(head, layer)
            k_bytes = spec.page_size * spec.k_row_bytes
            v_bytes = spec.page_size * spec.v_row_bytes
            k[:, head, layer] = (
                arena[:, at : at + k_bytes].view(dtype).view(num_pages, -1, spec.k_head_dim)
            )
            v_at = at + k_bytes
            v[:, head, layer] = (
                arena[:, v_at : v_at + v_bytes].view(dtype).view(num_pages, -1, spec.v_head_dim)
            )
    return k, v


def hf_pages(oracle, num_pages: int, page_size: int):
    """HF's K and V regrouped as [pages, heads, layers, page_size, head_dim]."""
    tokens = num_pages * page_size
    k = torch.stack([layer[:, :tokens] for layer in oracle.keys], dim=1)  # [H, L, T, D]
    v = torch.stack([layer[:, :tokens] for layer in oracle.values], dim=1)

    def paged(x):
        heads, layers, _, dim = x.shape
        return x.view(heads, layers, num_pages, page_size, dim).permute(2, 0, 1, 3, 4)

    return paged(k), paged(v)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-mha"])
def test_exported_pages_hold_hf_kv_at_every_position(model_dirs, name):
    model_dir = model_dirs(name)
    page_size = 16
    prompt = prompt_tokens(3 * page_size + 5, seed=11)
    oracle = hf_greedy(hf_model(model_dir), prompt, 1)
    engine = load_engine(model_dir, dtype="float64", page_size=page_size, num_pages=32)
    # Fragment the pool so pages are not in order.
    engine.pool.release(engine.pool.allocate(5))
    engine.generate([Request(prompt, SamplingParams(1))])
    arena = torch.zeros(4, engine.spec.page_bytes, dtype=torch.uint8)
    # 3 full pages and the 5-token partial page.
    assert export_prefix(engine, prompt, arena) == 4
    got_k, got_v = unpack_pages(arena, engine.spec)
    want_k, want_v = hf_pages(oracle, 3, page_size)
    assert got_k[:3].shape == want_k.shape
    torch.testing.assert_close(got_k[:3], want_k, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_v[:3], want_v, rtol=0, atol=1e-12)
    # The partial page: its 5 tokens, then zeros (never stale pool memory).
    tail_k = torch.stack([layer[:, 48:] for layer in oracle.keys], dim=1)  # [H, L, 5, D]
    tail_v = torch.stack([layer[:, 48:] for layer in oracle.values], dim=1)
    torch.testing.assert_close(got_k[3, :, :, :5], tail_k, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_v[3, :, :, :5], tail_v, rtol=0, atol=1e-12)
    assert not got_k[3, :, :, 5:].any() and not got_v[3, :, :, 5:].any()
    # K and V differ, so a swap or a transposition would not pass.
    assert not torch.allclose(got_k, got_v)


def test_prefill_to_decode_hand_off_computes_no_prompt_token(model_dirs):
    """The PD flow: prefill computes the prompt and samples the first token;
    its pages, the partial last one included, go to a decode engine, which
    continues from prompt + first token without recomputing the prompt."""
    model_dir = model_dirs("qwen2-gqa")
    prompt = prompt_tokens(45, seed=13)
    whole = load_engine(model_dir, dtype="float64", page_size=16)
    want = whole.generate([Request(prompt, SamplingParams(12))])[0].tokens

    prefill = load_engine(model_dir, dtype="float64", page_size=16)
    first = prefill.generate([Request(prompt, SamplingParams(1))])[0].tokens
    arena = torch.zeros(3, prefill.spec.page_bytes, dtype=torch.uint8)
    assert export_prefix(prefill, prompt, arena) == 3

    decode = load_engine(model_dir, dtype="float64", page_size=16)
    assert import_prefix(decode, prompt, arena) == 3
    rest = decode.generate([Request(prompt + first, SamplingParams(11), return_logits=True)])[0]
    assert rest.cached_tokens == len(prompt)
    assert rest.prompt_logits.shape[0] == 1  # only the first sampled token ran
    assert first + rest.tokens == want


def test_import_then_generate_reuses_the_pages(model_dirs):
    model_dir = model_dirs("llama-gqa")
    prompt = prompt_tokens(90, seed=12)
    source = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32)
    want = source.generate([Request(prompt, SamplingParams(20))])[0]
    arena = torch.zeros(8, source.spec.page_bytes, dtype=torch.uint8)
    rows = torch.tensor([7, 1, 3, 0, 5])  # arbitrary arena rows, as in a cache tier
    export_prefix(source, prompt[:80], arena, rows)

    reader = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32)
    assert import_prefix(reader, prompt[:80], arena, rows) == 5
    assert reader.pool.cached_pages == 5
    got = reader.generate([Request(prompt, SamplingParams(20))])[0]
    assert got.cached_tokens == 80
    assert got.tokens == want.tokens
    # Importing again keeps the cached pages and takes nothing more.
    free = reader.pool.free_pages
    assert import_prefix(reader, prompt[:80], arena, rows) == 5
    assert reader.pool.free_pages == free


def test_windowed_import_reads_only_its_window_and_matches_a_whole_import(model_dirs):
    """The tier pull's window: pages [first_page, ...) from rows of their
    own, the context before never read (a numpy view of the tokens, sliced
    per window), the same tokens as a one-shot import."""
    model_dir = model_dirs("llama-gqa")
    prompt = prompt_tokens(90, seed=14)
    source = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32)
    want = source.generate([Request(prompt, SamplingParams(8))])[0]
    arena = torch.zeros(6, source.spec.page_bytes, dtype=torch.uint8)
    export_prefix(source, prompt[:80], arena)
    keys = source.spec.page_keys(prompt)
    reader = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32)
    view = np.asarray(prompt)
    assert import_prefix(reader, view[:32], arena, [0, 1], chain=keys) == 2
    # The second window: arena rows 2..4 hold pages 2..4; rows are per window.
    window = torch.zeros(3, source.spec.page_bytes, dtype=torch.uint8)
    window.copy_(arena[2:5])
    assert import_prefix(reader, view[:80], window, [0, 1, 2], chain=keys, first_page=2) == 5
    assert reader.pool.cached_pages == 5
    got = reader.generate([Request(prompt, SamplingParams(8))])[0]
    assert got.cached_tokens == 80
    assert got.tokens == want.tokens


def test_export_of_an_uncached_prefix_is_an_error(model_dirs):
    engine = load_engine(model_dirs("llama-gqa"), dtype="float64", page_size=16, num_pages=8)
    arena = torch.zeros(2, engine.spec.page_bytes, dtype=torch.uint8)
    with pytest.raises(PrefixNotCached, match="0 of 2 pages"):
        export_prefix(engine, prompt_tokens(32), arena)
    assert engine.pool.free_pages == 8


def test_import_into_a_full_pool_takes_nothing(model_dirs):
    engine = load_engine(model_dirs("llama-gqa"), dtype="float64", page_size=16, num_pages=4)
    arena = torch.zeros(5, engine.spec.page_bytes, dtype=torch.uint8)
    with pytest.raises(PoolExhausted) as caught:
        import_prefix(engine, prompt_tokens(80), arena)
    assert (caught.value.needed, caught.value.available) == (5, 4)
    assert engine.pool.free_pages == 4 and engine.pool.cached_pages == 0
