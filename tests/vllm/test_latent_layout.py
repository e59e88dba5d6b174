"""vLLM MLA blocks <-> unified MLA pages, against vLLM's own rotary and cache write.

A latent row is written the way vLLM's DeepSeek attention makes it: `k_pe`
rotated by vLLM's rotary embedding (GPT-J style, as `deepseek_v2.py` builds
it) and stored by the CPU MLA backend's cache update. Gathered into pages it
must equal, position by position, the row kvrelay's runner computes
(`mla_rope.rotate`, interleaved: evens then odds); scattered back it must
rebuild vLLM's blocks bit for bit. The connector's refusals run on vLLM's
own model configs of real checkpoints.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvrelay.adapters.vllm.blocks import BlockLayoutError, BlockPages
from kvrelay.adapters.vllm.config import ConnectorConfig, ConnectorConfigError
from kvrelay.adapters.vllm.identity import engine_spec
from kvrelay.adapters.vllm.latent_blocks import latent_block_view, latent_permutation
from kvrelay.model.mla_rope import rotate

LORA, ROPE, BLOCK, LAYERS, BLOCKS = 512, 64, 16, 2, 5
WIDTH = LORA + ROPE
THETA = 10000.0


def vllm_rotated(k_pe: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """k_pe [tokens, 1, ROPE] rotated by vLLM's DeepSeek rotary embedding."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(ROPE, max_position=4096, is_neox_style=False,
                        rope_parameters={"rope_type": "default", "rope_theta": THETA})  # fmt: skip
    query = torch.zeros_like(k_pe)
    return rope.forward_native(positions, query, k_pe.clone())[1]


def runner_rotated(k_pe: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The same k_pe as kvrelay's runner rotates and caches it."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE)
    freqs = positions.to(torch.float32)[:, None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return rotate(k_pe, angles.cos(), angles.sin(), interleaved=True)


def vllm_caches(kv_c, k_pe_rotated, slots):
    """vLLM's MLA caches [blocks, block, WIDTH], each layer written by the CPU backend."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    caches = torch.zeros(LAYERS, BLOCKS, BLOCK, WIDTH)
    for layer in range(LAYERS):
        # the update reads nothing of its instance
        CPUMLAImpl.do_kv_cache_update(None, kv_c[layer], k_pe_rotated[layer], caches[layer],
                                      slots, "auto", torch.ones(1))  # fmt: skip
    return list(caches)


@pytest.fixture(scope="module")
def written():
    torch.manual_seed(0)
    blocks = [3, 0, 4]
    slots = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in blocks])
    positions = torch.arange(len(slots))
    kv_c = torch.randn(LAYERS, len(slots), LORA)
    k_pe = torch.randn(LAYERS, len(slots), 1, ROPE)
    theirs = torch.stack([vllm_rotated(k, positions) for k in k_pe])
    ours = torch.stack([runner_rotated(k, positions) for k in k_pe])
    return blocks, kv_c, theirs, ours, vllm_caches(kv_c, theirs, slots)


def gather(caches, blocks, rope_pairs: bool) -> torch.Tensor:
    """Pages of `blocks` as [pages, layers, BLOCK, WIDTH]."""
    views = [latent_block_view(c) for c in caches]
    pages = BlockPages(views, latent_permutation(BLOCK, WIDTH, ROPE, rope_pairs), 1, 0)
    rows = torch.zeros(len(blocks), pages.page_bytes, dtype=torch.uint8)
    pages.gather(blocks, rows)
    return rows.view(torch.float32).view(len(blocks), LAYERS, BLOCK, WIDTH), pages, rows


def test_vllm_rotates_deepseeks_rope_as_pairs_kvrelay_as_halves(written):
    _, _, theirs, ours, _ = written
    assert not torch.allclose(theirs, ours, atol=1e-3)  # the positions differ ...
    halves = torch.cat([theirs[..., 0::2], theirs[..., 1::2]], dim=-1)
    torch.testing.assert_close(halves, ours, rtol=1e-5, atol=1e-5)  # ... the values do not


def test_gathered_pages_are_the_runners_rows_position_by_position(written):
    blocks, kv_c, _, ours, caches = written
    pages, _, _ = gather(caches, blocks, rope_pairs=True)
    expected = torch.cat([kv_c, ours.squeeze(2)], dim=-1)  # [layers, tokens, WIDTH]
    expected = expected.view(LAYERS, len(blocks), BLOCK, WIDTH).transpose(0, 1)
    assert torch.equal(pages[..., :LORA], expected[..., :LORA])
    torch.testing.assert_close(pages, expected, rtol=1e-5, atol=1e-5)
    # without the reorder the RoPE part would be vLLM's pairs, not the runner's row
    unordered, _, _ = gather(caches, blocks, rope_pairs=False)
    assert not torch.allclose(unordered[..., LORA:], expected[..., LORA:], atol=1e-3)


def test_scatter_rebuilds_vllms_blocks_bit_for_bit(written):
    blocks, _, _, _, caches = written
    _, _, rows = gather(caches, blocks, rope_pairs=True)
    fresh = [torch.zeros_like(c) for c in caches]
    views = [latent_block_view(c) for c in fresh]
    BlockPages(views, latent_permutation(BLOCK, WIDTH, ROPE, True), 1, 0).scatter(rows, [1, 2, 0])
    for old, new in zip(caches, fresh, strict=True):
        assert torch.equal(new[[1, 2, 0]], old[blocks])


def test_latent_geometry_refusals():
    with pytest.raises(BlockLayoutError, match="RoPE part"):
        latent_permutation(BLOCK, WIDTH, 63, True)
    with pytest.raises(BlockLayoutError, match="MLA cache"):
        latent_block_view(torch.zeros(2, 2, BLOCK, WIDTH))
    assert latent_permutation(2, 4, 2, False).tolist() == list(range(8))
    # unified (even, odd) = cache positions (2, 3) of a 4-wide row with RoPE 2 ... and 4
    assert latent_permutation(1, 6, 4, True).tolist() == [0, 1, 2, 4, 3, 5]


def model_config(tmp_path, arch: str, *more: str):
    """vLLM's ModelConfig of a tiny checkpoint of `arch` written by make-model."""
    from vllm.config import ModelConfig

    path = tmp_path / arch
    subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "make-model", "--arch", arch, "--layers", "2",
         "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--vocab", "256",
         "--kv-lora-rank", str(LORA), "--qk-rope-dim", str(ROPE), "--dtype", "bfloat16",
         *more, str(path)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return ModelConfig(model=str(path), dtype="bfloat16", skip_tokenizer_init=True)


def vllm_config_of(model, custom_ops=("-rotary_embedding", "all"), device="cpu"):
    cache = SimpleNamespace(block_size=BLOCK, cache_dtype="auto")
    parallel = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1)
    return SimpleNamespace(
        model_config=model, cache_config=cache, parallel_config=parallel,
        device_config=SimpleNamespace(device_type=device),
        compilation_config=SimpleNamespace(custom_ops=list(custom_ops)),
    )  # fmt: skip


def test_an_mla_engine_names_the_runners_latent_spec(tmp_path):
    from kvrelay.model.loader import model_kv_spec

    model = model_config(tmp_path, "deepseek_v3")
    spec = engine_spec(ConnectorConfig(token="t", model_id="m"), vllm_config_of(model))
    assert (spec.attention_kind, spec.num_kv_heads, spec.k_head_dim, spec.v_head_dim,
            spec.rope_head_dim, spec.page_size) == ("mla", 1, WIDTH, 0, ROPE, BLOCK)  # fmt: skip
    runner = model_kv_spec(tmp_path / "deepseek_v3", "bfloat16", BLOCK)
    assert spec.page_bytes == runner.page_bytes
    assert {k: v for k, v in spec.identity_fields().items() if k != "model_id"} == {
        k: v for k, v in runner.identity_fields().items()
        if k not in ("model_id", "weights_fingerprint")
    } | {"weights_fingerprint": ""}  # fmt: skip


def test_a_sparse_attention_model_is_refused(tmp_path):
    """Refused until DSA runs (on GPUs), naming the pages it would take."""
    model = model_config(tmp_path, "deepseek_v32", "--index-head-dim", "128")
    with pytest.raises(ConnectorConfigError, match=r"sparse attention.*132-byte fp8 records"):
        engine_spec(ConnectorConfig(token="t"), vllm_config_of(model))
    narrow = model_config(tmp_path / "narrow", "deepseek_v32")  # 32-wide keys: no fp8 record
    with pytest.raises(ConnectorConfigError, match=r"sparse attention.*scale groups"):
        engine_spec(ConnectorConfig(token="t"), vllm_config_of(narrow))


def test_an_mla_model_on_vllms_cpu_rotary_op_is_refused(tmp_path):
    """vLLM's CPU rotary op misrotates DeepSeek's k_pe (the engine tests run
    with its native twin, whose pages equal the runner's): refused on CPU
    unless it is turned off, and no matter on other devices."""
    model = model_config(tmp_path, "deepseek_v3")
    config = ConnectorConfig(token="t")
    for ops in (["all"], [], ["none", "+rotary_embedding"]):
        with pytest.raises(ConnectorConfigError, match="-rotary_embedding"):
            engine_spec(config, vllm_config_of(model, ops))
    for ops in (["-rotary_embedding", "all"], ["none"]):
        assert engine_spec(config, vllm_config_of(model, ops)).attention_kind == "mla"
    on_gpu = vllm_config_of(model, ["all"], device="cuda")
    assert engine_spec(config, on_gpu).attention_kind == "mla"
