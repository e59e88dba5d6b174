"""The engine's step-wise API: sequences join and leave a running batch, and
a decode continuing after another process's first token draws the same
tokens."""

import pytest

from kvrelay.model import Request, SamplingParams, load_engine
from tests.support.models import prompt_tokens

PAGE = 16


@pytest.fixture
def engine(model_dirs):
    return load_engine(model_dirs("llama-gqa"), dtype="float32", page_size=PAGE, num_pages=64)


def run_alone(engine, prompt, params):
    return engine.generate([Request(prompt, params)])[0].tokens


def test_sequences_joining_a_running_batch_get_their_own_tokens(engine):
    a, b = prompt_tokens(40, seed=1), prompt_tokens(23, seed=2)
    greedy = SamplingParams(12)
    sampled = SamplingParams(9, temperature=0.9, top_k=30, seed=7)
    want_a, want_b = run_alone(engine, a, greedy), run_alone(engine, b, sampled)
    engine.pool.clear_cache()
    free = engine.pool.free_pages
    got: dict[int, list[int]] = {}
    first = engine.admit(Request(a, greedy))
    for _ in range(4):
        for out in engine.step():
            got.setdefault(out.seq_id, []).extend(out.tokens)
    second = engine.admit(Request(b, sampled))  # joins while `first` decodes
    finished = {}
    while engine.running:
        for out in engine.step():
            got.setdefault(out.seq_id, []).extend(out.tokens)
            if out.finish_reason:
                finished[out.seq_id] = out
    assert got[first] == want_a and got[second] == want_b
    assert finished[first].all_tokens == a + want_a
    assert engine.pool.free_pages == free


def test_cancel_returns_the_pages(engine):
    free = engine.pool.free_pages
    seq = engine.admit(Request(prompt_tokens(50, seed=3), SamplingParams(30)))
    engine.step()
    engine.step()
    assert engine.pool.free_pages < free
    assert engine.cancel(seq)
    assert not engine.cancel(seq)
    assert engine.running == 0
    assert engine.pool.free_pages == free


@pytest.mark.parametrize(
    "params",
    [SamplingParams(10), SamplingParams(10, temperature=1.1, top_p=0.8, seed=11)],
    ids=["greedy", "sampled"],
)
def test_continuing_after_a_first_token_drawn_elsewhere(engine, params):
    """Prefill draws token 1; decode continues from prompt + token 1 with the
    generator advanced past that draw: the tokens of one uninterrupted run."""
    prompt = prompt_tokens(37, seed=4)
    want = run_alone(engine, prompt, params)
    engine.pool.clear_cache()
    first = run_alone(engine, prompt, SamplingParams(**{**_fields(params), "max_new_tokens": 1}))
    rest_params = SamplingParams(**{**_fields(params), "max_new_tokens": 9})
    rest = engine.generate([Request(prompt + first, rest_params, skip_draws=1)])[0]
    assert first + rest.tokens == want
    # prompt fully cached (pages and the partial page): only `first` is computed
    assert rest.cached_tokens == len(prompt)


def _fields(params):
    return {f: getattr(params, f) for f in params.__slots__}
