"""A prefix computed by a TP=2 x PP=2 model group, continued by a TP=1 engine.

Writes a tiny random Llama model in Hugging Face format, runs a prompt on four
spawned ranks (each holding its heads x layers of the KV), exports the prompt's
full pages as unified page objects (each rank gathers its rectangle into one
shared arena), imports them into a single-process engine and generates from
there: the second engine computes only the prompt's last partial page and
produces the same greedy tokens.

    python examples/model_cross_config.py
"""

import tempfile

import torch

from kvrelay.model import (
    ParallelEngine,
    RandomModelSpec,
    Request,
    SamplingParams,
    import_prefix,
    load_engine,
    write_model,
)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        spec = RandomModelSpec(arch="llama", layers=4, hidden=64, heads=4, kv_heads=2, std=0.2)
        model_dir = write_model(f"{tmp}/tiny-llama", spec)
        prompt = torch.randint(0, spec.vocab, (100,), generator=torch.Generator().manual_seed(0))
        prompt = prompt.tolist()
        params = SamplingParams(max_new_tokens=16)
        options = {"dtype": "float64", "page_size": 16, "num_pages": 32}

        with ParallelEngine(model_dir, tp=2, pp=2, **options) as group:
            first = group.generate([Request(prompt, params)])[0]
            full = len(prompt) // 16 * 16
            pages = group.export_prefix(prompt[:full])
        print(f"TP=2 x PP=2: {first.tokens}")
        print(f"exported {pages.size(0)} pages of {pages.size(1)} bytes")

        single = load_engine(model_dir, **options)
        import_prefix(single, prompt[:full], pages)
        second = single.generate([Request(prompt, params)])[0]
        print(f"TP=1 after import ({second.cached_tokens} cached tokens): {second.tokens}")
        same = second.tokens == first.tokens and second.cached_tokens == full
        print("same tokens, prefix reused:", same)
        return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
