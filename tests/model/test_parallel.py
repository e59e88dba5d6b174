"""TP x PP over spawned gloo ranks: the same greedy tokens as TP=1 PP=1 in
float64, each rank's pool holding only its rectangle, and prefixes exported
under one config imported under another (both directions)."""

import pytest
import torch

from kvrelay.layout import ParallelConfig, rank_rectangle
from kvrelay.model import PoolExhausted, Request, SamplingParams, load_engine
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.model.parallel import ParallelEngine
from tests.support.models import prompt_tokens

PAGE = 16
PROMPT = 4 * PAGE + 9
PAGES = 5
NEW = 32


# A second request in the same batch, sampled: the sampling rank's generator
# and the token broadcast must reproduce the single-process run too.
SAMPLED = SamplingParams(NEW, temperature=0.8, top_k=40, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def baseline(model_dirs):
    """TP=1 PP=1: the greedy tokens and the prefix's unified pages."""
    model_dir = model_dirs("parallel")
    prompt = prompt_tokens(PROMPT, seed=21)
    engine = load_engine(model_dir, dtype="float64", page_size=PAGE, num_pages=64)
    tokens = engine.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
    assert len(set(tokens)) >= 16
    sampled = engine.generate([Request(prompt[:30], SAMPLED)])[0].tokens
    # As a prefill worker: the prompt alone, then all its pages (4 full, and
    # the partial fifth with 9 tokens) as unified pages.
    engine.generate([Request(prompt, SamplingParams(1))])
    arena = torch.zeros(PAGES, engine.spec.page_bytes, dtype=torch.uint8)
    assert export_prefix(engine, prompt, arena) == PAGES
    return model_dir, prompt, tokens, arena, sampled


def as_kv(arena: torch.Tensor) -> torch.Tensor:
    return arena.view(torch.float64)


# (4, x): TP above the model's 2 KV heads, each head replicated on 2 ranks.
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (4, 1), (1, 2), (2, 2), (4, 2)])
def test_parallel_config_matches_tp1_and_exchanges_pages(baseline, tp, pp):
    model_dir, prompt, want, tp1_pages, sampled = baseline
    with ParallelEngine(
        model_dir, tp=tp, pp=pp, dtype="float64", page_size=PAGE, num_pages=64, timeout_s=240
    ) as group:
        for rank, info in enumerate(group.describe()):
            rect = rank_rectangle(
                group.spec, ParallelConfig(tp=tp, pp=pp).with_rank(rank % tp, rank // tp)
            )
            assert info["layers"] == (rect.layer_start, rect.layer_end)
            assert info["kv_heads"] == (rect.head_start, rect.head_end)
            assert (info["pool_layers"], info["pool_heads"]) == (rect.num_layers, rect.num_heads)

        got, got_sampled = group.generate(
            [Request(prompt, SamplingParams(NEW)), Request(prompt[:30], SAMPLED)]
        )
        assert got.tokens == want
        assert got_sampled.tokens == sampled

        group.generate([Request(prompt, SamplingParams(1))])
        exported = group.export_prefix(prompt)
        # Every byte written (replicas included) and equal to TP=1's KV up to
        # the order of the TP all-reduce sums.
        torch.testing.assert_close(as_kv(exported), as_kv(tp1_pages), rtol=0, atol=1e-12)

        # Written by TP=1 PP=1, read by this config as a decode worker would:
        # it continues from the prompt and the first token, computing no
        # prompt token.
        group.clear_cache()
        assert group.import_prefix(prompt, tp1_pages) == PAGES
        again = group.generate([Request(prompt + want[:1], SamplingParams(NEW - 1))])[0]
        assert again.cached_tokens == PROMPT
        assert again.tokens == want[1:]
        assert set(group.free_pages()) == {64}

    # Written by this config, read by TP=1 PP=1.
    reader = load_engine(model_dir, dtype="float64", page_size=PAGE, num_pages=64)
    import_prefix(reader, prompt, exported)
    out = reader.generate([Request(prompt + want[:1], SamplingParams(NEW - 1))])[0]
    assert out.cached_tokens == PROMPT
    assert out.tokens == want[1:]


def test_pool_exhaustion_crosses_processes_and_the_group_goes_on(baseline):
    model_dir, prompt, want, _, _ = baseline
    with ParallelEngine(
        model_dir, tp=2, pp=2, dtype="float64", page_size=PAGE, num_pages=8, timeout_s=240
    ) as group:
        with pytest.raises(PoolExhausted) as caught:
            group.generate([Request(prompt_tokens(200), SamplingParams(4))])
        assert caught.value.needed == 13
        assert set(group.free_pages()) == {8}
        assert group.generate([Request(prompt, SamplingParams(NEW))])[0].tokens == want


def test_a_rank_that_cannot_load_fails_the_start(tmp_path, baseline):
    model_dir = baseline[0]
    with pytest.raises(Exception, match="tp=3 does not divide"):
        ParallelEngine(model_dir, tp=3, dtype="float64", timeout_s=120)


def test_llama_biases_under_tp_and_pp(model_dirs):
    """o_proj and down_proj biases are added once, after the TP all-reduce."""
    model_dir = model_dirs("llama-gqa", attention_bias=True, mlp_bias=True)
    prompt = prompt_tokens(40, seed=22)
    engine = load_engine(model_dir, dtype="float64", page_size=PAGE)
    want = engine.generate([Request(prompt, SamplingParams(16))])[0].tokens
    with ParallelEngine(model_dir, tp=2, pp=2, dtype="float64", page_size=PAGE) as group:
        assert group.generate([Request(prompt, SamplingParams(16))])[0].tokens == want


def test_a_tensor_only_the_last_stage_reads_fails_the_start_with_its_name(tmp_path):
    """Only PP stage 1 loads the final norm: one rank fails, the other does not,
    and the error (type and message) reaches the caller."""
    from safetensors.torch import load_file, save_file

    from kvrelay.model import ModelLoadError, RandomModelSpec, write_model

    model_dir = write_model(tmp_path / "m", RandomModelSpec(layers=2, seed=6))
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.norm\.weight'"):
        ParallelEngine(model_dir, pp=2, timeout_s=120)
