"""Speculative decoding with the MTP layer of GLM-5, DeepSeek-V3.2 and
DeepSeek-V3: greedy output equals transformers' plain greedy; the draft's
pool is a LatentKVPool (latent rows, and indexer keys where the MTP layer's
indexer runs), its pages reused with the target's, so acceptance after a
hit equals acceptance cold, also when the pages came from another parallel
config. The drafts are built from the target's layer 0 over a one-layer
target (`mtp_init="copy"`), so they agree with it often."""

import pytest

from kvrelay.cli import build_parser
from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.commands import run_generate
from kvrelay.model.cross_config import parse_parallel
from kvrelay.model.latent_pool import LatentKVPool
from tests.model.mla_support import ARCHS, hf_mla_model
from tests.model.oracle import hf_greedy
from tests.support.models import prompt_tokens

NEW = 20
PROMPT = 150
PREFIX = 100  # 6 full pages of 16 reused, draft pages included
DRAFTING = {"mtp": 1, "mtp_init": "copy", "layers": 1, "first_dense": 0}


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_speculation_gives_hf_greedy_and_reuses_draft_pages(mla_dirs, arch):
    model_dir = mla_dirs(arch, **DRAFTING)
    prompt = prompt_tokens(PROMPT, seed=8)
    want = hf_greedy(hf_mla_model(model_dir), prompt, NEW).tokens

    engine = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32, speculative=2)
    assert isinstance(engine.draft.pool, LatentKVPool)
    assert (engine.draft.pool.index_dim > 0) == (arch != "deepseek_v3")
    cold = engine.generate([Request(prompt, SamplingParams(NEW))])[0]
    assert cold.tokens == want
    assert cold.spec["accepted"] >= cold.spec["proposed"] // 2

    for zero_draft in (False, True):
        engine.pool.clear_cache()
        engine.draft.pool.clear_cache()
        engine.generate([Request(prompt[:PREFIX], SamplingParams(1))])
        if zero_draft:  # the cached draft pages' latents (the target's stay)
            engine.draft.pool.latent_storage.zero_()
        warm = engine.generate([Request(prompt, SamplingParams(NEW))])[0]
        assert warm.cached_tokens == PREFIX // 16 * 16
        assert warm.tokens == want
        assert (warm.spec == cold.spec) != zero_draft


@pytest.mark.cluster  # a TP=2 group of rank processes
def test_draft_pages_from_a_tp2_prefill_keep_the_acceptance(mla_dirs, capsys):
    """`generate --speculative 2 --reuse-prefix K --prefix-parallel tp=2`:
    target and draft pages computed by a TP=2 group, imported by one process."""
    model_dir = mla_dirs("glm5", **DRAFTING)
    prompt = prompt_tokens(PROMPT, seed=9)
    engine = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32, speculative=2)
    cold = engine.generate([Request(prompt, SamplingParams(NEW))])[0]
    args = ["generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt))]
    args += ["--max-new-tokens", str(NEW), "--dtype", "float64", "--page-size", "16", "--json"]
    args += ["--speculative", "2", "--reuse-prefix", str(PREFIX)]
    parsed = build_parser().parse_args(args)
    parsed.prefix_parallel = parse_parallel("tp=2")
    out = run_generate(parsed)
    capsys.readouterr()
    assert out["cached_tokens"] == PREFIX // 16 * 16  # a draft has no partial pages
    assert out["tokens"] == cold.tokens
    assert out["spec"] == cold.spec
