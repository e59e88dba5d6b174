"""An engine with `key_scheme="sglang"` keys its pages with SGLang's HiCache
chain (kvrelay.layout.keys), prompt pages and the pages decode fills alike,
and generates what an engine with kvrelay's own keys generates."""

from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.page_export import export_prefix
from tests.support.models import prompt_tokens

PAGE = 8


def test_sglang_keys_index_prompt_and_decode_pages(model_dirs):
    import torch

    model_dir = model_dirs("llama-gqa")
    engines = {
        scheme: load_engine(model_dir, page_size=PAGE, num_pages=16, key_scheme=scheme)
        for scheme in ("kvrelay", "sglang")
    }
    assert engines["sglang"].spec.namespace() != engines["kvrelay"].spec.namespace()
    prompt = prompt_tokens(2 * PAGE + 3, seed=7)
    runs = {
        s: e.generate([Request(prompt, SamplingParams(2 * PAGE))])[0] for s, e in engines.items()
    }
    assert runs["sglang"].tokens == runs["kvrelay"].tokens
    engine, tokens = engines["sglang"], prompt + runs["sglang"].tokens
    # Pages 2-3 were filled by decode steps: the chain extended there is the
    # one computed from scratch, so the continuation hits all four pages (and
    # the partial fifth, which is keyed under the fourth's key).
    again = engine.generate([Request(tokens, SamplingParams(1))])[0]
    assert again.cached_tokens == len(tokens) - 1 == 4 * PAGE + 2
    engines["kvrelay"].generate([Request(tokens, SamplingParams(1))])
    pages = {}
    for scheme, e in engines.items():
        pages[scheme] = torch.zeros(4, e.spec.page_bytes, dtype=torch.uint8)
        assert export_prefix(e, tokens[: 4 * PAGE], pages[scheme]) == 4
    assert torch.equal(pages["sglang"], pages["kvrelay"])  # same bytes, other keys
