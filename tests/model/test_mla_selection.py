"""The DSA selection does not depend on how a forward is cut: a float64
model's tokens are the same for a whole prefill, a chunked one and one
after a cached prefix, and exact ties at the k-th score go to the earliest
tokens whatever the row's length."""

import torch

from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.dsa_topk import top_k
from tests.support.models import prompt_tokens


def test_tokens_do_not_depend_on_chunking_or_a_cached_prefix(mla_dirs):
    # index_topk 32, 4 indexer heads (ties at zero are frequent), 600 tokens.
    model = mla_dirs("glm5", index_heads=4)
    prompt = prompt_tokens(600, seed=5)
    runs = []
    for chunk in (4096, 97):
        engine = load_engine(model, dtype="float64", page_size=16, num_pages=96,
                             max_prefill_tokens=chunk)  # fmt: skip
        runs.append(engine.generate([Request(prompt, SamplingParams(24))])[0].tokens)
    engine = load_engine(model, dtype="float64", page_size=16, num_pages=96)
    engine.generate([Request(prompt[:352], SamplingParams(1))])
    cached = engine.generate([Request(prompt, SamplingParams(24))])[0]
    assert cached.cached_tokens == 352
    assert runs[0] == runs[1] == cached.tokens


def test_ties_at_the_kth_score_go_to_the_earliest_tokens():
    row = torch.tensor([0.0, 3.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    for length in (6, 8, 10):  # more tied tokens after the boundary change nothing
        assert sorted(top_k(row[None, :length], 5)[0].tolist()) == [0, 1, 2, 3, 5]
    masked = torch.tensor([[5.0, float("-inf"), float("-inf")]])
    assert top_k(masked, 2)[0, 0] == 0
