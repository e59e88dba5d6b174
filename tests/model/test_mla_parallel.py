"""GLM-5, DeepSeek-V3.2 and DeepSeek-V3 under TP, PP, TP x PP and CP (spawned
gloo ranks, float64): the greedy tokens of transformers, each rank's pool one
latent head of its stage's layers, and unified pages exchanged both ways
with a single-process engine (written by one config, read by another)."""

import pytest
import torch

from kvrelay.cli import build_parser
from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.commands import run_generate
from kvrelay.model.cross_config import parse_parallel
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.model.parallel import ParallelEngine
from tests.model.mla_support import hf_mla_model
from tests.model.oracle import hf_greedy
from tests.support.models import prompt_tokens

# Spawns rank processes (as test_parallel.py): not in `make test-fast`.
pytestmark = pytest.mark.cluster

PAGE = 16
PROMPT = 150  # above index_topk (32): the indexer decides what attention sees
NEW = 12


@pytest.fixture(scope="module")
def baselines(mla_dirs):
    """baselines(arch, page_size): model dir, prompt, transformers' greedy
    tokens, and the prompt's unified pages from a single-process engine."""
    made = {}

    def get(arch: str, page: int = PAGE):
        if (arch, page) not in made:
            model_dir = mla_dirs(arch)
            prompt = prompt_tokens(PROMPT, seed=31)
            want = hf_greedy(hf_mla_model(model_dir), prompt, NEW).tokens
            engine = load_engine(model_dir, dtype="float64", page_size=page, num_pages=32)
            assert engine.generate([Request(prompt, SamplingParams(NEW))])[0].tokens == want
            engine.generate([Request(prompt, SamplingParams(1))])
            pages = -(-PROMPT // page)
            arena = torch.zeros(pages, engine.spec.page_bytes, dtype=torch.uint8)
            assert export_prefix(engine, prompt, arena) == pages
            made[arch, page] = (model_dir, prompt, want, arena)
        return made[arch, page]

    return get


# GLM-5 (layers full, full, shared): PP=2 cuts before the shared layer, whose
# stage receives the top-k of the stage before.
@pytest.mark.parametrize(
    ("arch", "tp", "pp", "cp", "page"),
    [
        ("glm5", 2, 1, 1, 16),
        ("glm5", 1, 2, 1, 16),
        ("glm5", 2, 2, 1, 16),
        ("glm5", 2, 2, 1, 64),
        ("deepseek_v32", 2, 2, 1, 16),
        ("deepseek_v3", 2, 1, 1, 16),
        ("deepseek_v3", 1, 2, 1, 64),
        ("glm5", 1, 1, 2, 16),
        ("deepseek_v32", 2, 1, 2, 64),
    ],
)
def test_mla_parallel_configs_match_hf_and_exchange_pages(baselines, arch, tp, pp, cp, page):
    model_dir, prompt, want, tp1_pages = baselines(arch, page)
    with ParallelEngine(
        model_dir, tp=tp, pp=pp, cp=cp, dtype="float64", page_size=page, num_pages=32,
        timeout_s=120,
    ) as group:  # fmt: skip
        for info in group.describe():
            assert info["pool_heads"] == 1
            assert info["pool_layers"] == info["layers"][1] - info["layers"][0]
        assert group.generate([Request(prompt, SamplingParams(NEW))])[0].tokens == want

        group.generate([Request(prompt, SamplingParams(1))])
        exported = group.export_prefix(prompt)
        # Latents and indexer keys equal the single process's up to the
        # order of the TP all-reduce sums.
        torch.testing.assert_close(
            exported.view(torch.float64), tp1_pages.view(torch.float64), rtol=0, atol=1e-9
        )
        # Pages written by one process, read by this config as a decode
        # worker would: nothing of the prompt is computed.
        group.clear_cache()
        assert group.import_prefix(prompt, tp1_pages) == len(tp1_pages)
        again = group.generate([Request(prompt + want[:1], SamplingParams(NEW - 1))])[0]
        assert again.cached_tokens == PROMPT
        assert again.tokens == want[1:]

    reader = load_engine(model_dir, dtype="float64", page_size=page, num_pages=32)
    import_prefix(reader, prompt, exported)
    out = reader.generate([Request(prompt + want[:1], SamplingParams(NEW - 1))])[0]
    assert out.cached_tokens == PROMPT
    assert out.tokens == want[1:]


@pytest.mark.parametrize(
    ("arch", "run", "prefix"),
    [
        ("glm5", [], "tp=2,pp=2"),
        ("deepseek_v32", ["--pp", "2"], "cp=2"),
        ("deepseek_v3", ["--cp", "2"], "tp=2"),
    ],
)
def test_a_prefix_from_another_config_gives_hf_tokens(baselines, capsys, arch, run, prefix):
    """`generate --reuse-prefix K --prefix-parallel ...`: pages (latents and
    indexer keys, a partial page included) computed under one config and
    imported by another."""
    model_dir, prompt, want, _ = baselines(arch)
    args = ["generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt))]
    args += ["--max-new-tokens", str(NEW), "--dtype", "float64", "--page-size", str(PAGE)]
    args = build_parser().parse_args([*args, "--json", *run, "--reuse-prefix", "123"])
    args.prefix_parallel = parse_parallel(prefix)
    out = run_generate(args)
    capsys.readouterr()
    assert out["cached_tokens"] == 123
    assert out["tokens"] == want


def test_mtp_speculation_under_tp_x_pp_and_cp(mla_dirs):
    """The MTP layer on the last PP stage, its heads split over TP; under CP
    the draft runs whole on every rank. Tokens are transformers' greedy ones,
    proposals and acceptance those of one process."""
    model_dir = mla_dirs("glm5", layers=2, mtp=1, mtp_init="copy")
    prompt = prompt_tokens(PROMPT, seed=33)
    want = hf_greedy(hf_mla_model(model_dir), prompt, NEW).tokens
    one = load_engine(model_dir, dtype="float64", page_size=PAGE, num_pages=32, speculative=2)
    cold = one.generate([Request(prompt, SamplingParams(NEW))])[0]
    assert cold.tokens == want
    assert cold.spec["accepted"] > 0
    for sizes in ({"tp": 2, "pp": 2}, {"cp": 2}):
        with ParallelEngine(
            model_dir, **sizes, dtype="float64", page_size=PAGE, num_pages=32, speculative=2,
            timeout_s=120,
        ) as group:  # fmt: skip
            got = group.generate([Request(prompt, SamplingParams(NEW))])[0]
            assert got.tokens == want
            assert got.spec == cold.spec
