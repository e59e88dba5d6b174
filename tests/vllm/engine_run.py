"""One vLLM engine in a process of its own, for the connector tests.

`python -m tests.vllm.engine_run CONFIG.json` reads {"model", "connector"
(extra config or null), "phases": [[prompt, ...], ...], "go_file"} and, for
each phase, generates greedily from every prompt, printing one JSON line per
request: {"phase", "tokens", "cached", "kv_transfer_params"}, also appended
to `go_file + ".results"`. A prompt is a list of token ids, or {"tokens",
"max_tokens", "kv_transfer_params"} (a P/D request), or {"batch": [prompt, ...]}
(submitted together). Between phases it
touches `go_file + ".N"` and waits for `go_file + ".N.go"` (at most 900 s),
so a test can act (kill a cache server, run a decode engine) while the
engine lives.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

MAX_TOKENS = 16


def connector_config(extra: dict):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KvrelayConnector",
        kv_connector_module_path="kvrelay.adapters.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )


def wait_for(path: Path, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.loads(Path(sys.argv[1]).read_text())
    extra = dict(config.get("engine_args") or {})
    if config["connector"] is not None:
        extra["kv_transfer_config"] = connector_config(config["connector"])
    dtype = extra.pop("dtype", "bfloat16")
    llm = LLM(model=config["model"], dtype=dtype, max_model_len=4096, enforce_eager=True,
              skip_tokenizer_init=True, **extra)  # fmt: skip
    results = Path(f"{config['go_file']}.results")
    for phase, prompts in enumerate(config["phases"]):
        if phase:
            marker = Path(f"{config['go_file']}.{phase}")
            marker.touch()
            wait_for(Path(f"{marker}.go"))
        for prompt in prompts:
            # {"batch": [prompt, ...]}: submitted together, so the engine runs them at once
            batch = prompt["batch"] if isinstance(prompt, dict) and "batch" in prompt else [prompt]
            batch = [{"tokens": p} if isinstance(p, list) else p for p in batch]
            requests, params = [], []
            for one in batch:
                extra = {}
                if one.get("kv_transfer_params") is not None:
                    extra["extra_args"] = {"kv_transfer_params": one["kv_transfer_params"]}
                max_tokens = one.get("max_tokens", MAX_TOKENS)
                params.append(SamplingParams(temperature=0, detokenize=False,
                                             max_tokens=max_tokens, **extra))  # fmt: skip
                requests.append(TokensPrompt(prompt_token_ids=one["tokens"]))
            for out in llm.generate(requests, params, use_tqdm=False):
                line = json.dumps({"phase": phase, "tokens": list(out.outputs[0].token_ids),
                                   "cached": out.num_cached_tokens,
                                   "kv_transfer_params": out.kv_transfer_params})  # fmt: skip
                print(line, flush=True)
                with results.open("a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
