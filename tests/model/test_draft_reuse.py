"""Draft KV survives reuse: at temperature 0 the proposals (and so the
proposed/accepted counts) of a run whose prefix came from the local cache,
from unified pages (what the tier stores and P->D moves), or from pages
written under another TP x PP config equal a cold run's. Negative control:
zeroed or corrupted draft pages change the proposals. Target pages without
their draft pages are recomputed. Boundary: prompts that share page p but
differ at the first token of page p + 1 never share draft page p."""

import pytest
import torch

from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.draft_transfer import draft_keys, export_draft_prefix, import_draft_prefix
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.model.parallel import ParallelEngine
from tests.support.models import prompt_tokens

PAGE = 16
PREFIX = 4 * PAGE  # page-aligned: draft page 3 needs the prompt's token 64
PROMPT = PREFIX + 11
NEW = 24
K = 2


def engine(model_dir):
    return load_engine(model_dir, dtype="float64", page_size=PAGE, num_pages=64, speculative=K)


def run(eng, prompt):
    result = eng.generate([Request(prompt, SamplingParams(NEW), return_logits=True)])[0]
    return result


@pytest.fixture(scope="module")
def cold(model_dirs):
    model_dir = model_dirs("parallel", mtp=1)
    prompt = prompt_tokens(PROMPT, seed=31)
    result = run(engine(model_dir), prompt)
    assert result.cached_tokens == 0 and result.spec["steps"] > 0
    return model_dir, prompt, result


def unified_pages(eng, prompt):
    """The prompt's full target pages and their draft pages (draft page 3
    needs token 64), as the tier and P->D carry them."""
    target = torch.zeros(PREFIX // PAGE, eng.spec.page_bytes, dtype=torch.uint8)
    export_prefix(eng, prompt[:PREFIX], target)
    tokens = prompt[: PREFIX + 1]
    draft = torch.zeros(len(draft_keys(eng, tokens)), eng.draft.spec.page_bytes, dtype=torch.uint8)
    export_draft_prefix(eng, tokens, draft)
    return target, draft


def warm_run(model_dir, prompt, target, draft):
    eng = engine(model_dir)
    import_prefix(eng, prompt[:PREFIX], target)
    if draft is not None:
        import_draft_prefix(eng, prompt[: PREFIX + 1], draft)
    return run(eng, prompt)


def same_speculation(a, b):
    assert a.tokens == b.tokens
    assert a.proposals == b.proposals
    assert a.spec == b.spec


def test_local_cache_and_unified_pages_restore_the_draft(cold):
    model_dir, prompt, expected = cold
    eng = engine(model_dir)
    run(eng, prompt)
    local = run(eng, prompt)
    assert local.cached_tokens == PREFIX  # all full pages short of the last token
    same_speculation(local, expected)
    target, draft = unified_pages(eng, prompt)
    assert draft.shape[0] == PREFIX // PAGE
    moved = warm_run(model_dir, prompt, target, draft)
    assert moved.cached_tokens == PREFIX
    same_speculation(moved, expected)


@pytest.mark.cluster  # starts rank or CLI processes
@pytest.mark.parametrize("sizes", [{"tp": 2, "pp": 2}, {"cp": 2}])
def test_pages_written_under_another_config_restore_the_draft(cold, sizes):
    """TP=2 x PP=2, and CP=2 (each draft page written by its owner CP rank)."""
    model_dir, prompt, expected = cold
    with ParallelEngine(
        model_dir, **sizes, dtype="float64", page_size=PAGE, num_pages=64, speculative=K
    ) as group:
        group.generate([Request(prompt, SamplingParams(1))])
        target = group.export_prefix(prompt[:PREFIX])
        draft = group.export_draft_prefix(prompt[: PREFIX + 1])
    moved = warm_run(model_dir, prompt, target, draft)
    assert moved.cached_tokens == PREFIX
    same_speculation(moved, expected)


@pytest.mark.parametrize("damage", ["zeroed", "corrupted"])
def test_damaged_draft_pages_change_the_proposals(cold, damage):
    """Negative control: the same path with the draft pages zeroed or
    corrupted instead of restored proposes differently."""
    model_dir, prompt, expected = cold
    eng = engine(model_dir)
    run(eng, prompt)
    target, draft = unified_pages(eng, prompt)
    values = draft.view(torch.float64)
    if damage == "zeroed":
        values.zero_()
    else:
        values.copy_(torch.randn(values.shape, generator=torch.Generator().manual_seed(0)))
    broken = warm_run(model_dir, prompt, target, draft)
    assert broken.cached_tokens == PREFIX
    assert broken.tokens == expected.tokens  # verification keeps greedy exact
    assert broken.proposals != expected.proposals


def test_target_pages_without_draft_pages_are_recomputed(cold):
    """Target pages hit, draft pages missing: the engine recomputes from the
    first page whose draft page is missing (here: all, then all but two)."""
    model_dir, prompt, expected = cold
    eng = engine(model_dir)
    run(eng, prompt)
    target, draft = unified_pages(eng, prompt)
    none = warm_run(model_dir, prompt, target, None)
    assert none.cached_tokens == 0
    same_speculation(none, expected)
    some = engine(model_dir)
    import_prefix(some, prompt[:PREFIX], target)
    import_draft_prefix(some, prompt[: 2 * PAGE + 1], draft[:2])
    partial = run(some, prompt)
    assert partial.cached_tokens == 2 * PAGE
    same_speculation(partial, expected)


def test_prompts_differing_at_the_next_pages_first_token_do_not_share_draft_pages(cold):
    model_dir, prompt, _ = cold
    other = list(prompt)
    other[PREFIX] = (other[PREFIX] + 1) % 256  # first token of page 4
    eng = engine(model_dir)
    run(eng, prompt)
    # Target pages 0-3 are shared; draft page 3 depends on token 64: a miss.
    assert eng.spec.page_keys(other)[:4] == eng.spec.page_keys(prompt)[:4]
    assert draft_keys(eng, other)[3] != draft_keys(eng, prompt)[3]
    assert draft_keys(eng, other)[:3] == draft_keys(eng, prompt)[:3]
    warm = run(eng, other)
    assert warm.cached_tokens == 3 * PAGE
    same_speculation(warm, run(engine(model_dir), other))
