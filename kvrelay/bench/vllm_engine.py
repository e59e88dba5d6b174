"""One vLLM engine for `kvrelay bench vllm`, in a process of its own, run
with vLLM's environment's Python (`.venv-vllm`).

`python -m kvrelay.bench.vllm_engine CONFIG_JSON` builds `LLM(model, ...)`
with `kv_transfer_config` from CONFIG's "kv_transfer_config" (or none), prints
`{"ready": true}`, then answers each stdin line `{"tokens", "max_tokens",
"kv_transfer_params"}` with one stdout line: the generated tokens, the
tokens vLLM did not compute ("cached"), the first token's latency (vLLM's
own, arrival to first token), the call's wall time, the returned
`kv_transfer_params`, and this request's KV transfer time: NIXL's from
vLLM's `vllm:nixl_xfer_time_seconds` histogram, kvrelay's from the
connector's transfer log. vLLM's own logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _histogram_sum(llm, name: str) -> float:
    return sum(m.sum for m in llm.get_metrics() if m.name == name and hasattr(m, "sum"))


def _log_size(path: str) -> int:
    return os.path.getsize(path) if path and os.path.exists(path) else 0


def _log_seconds(path: str, since: int) -> float | None:
    """The pulls the transfer log gained past byte `since` (one request's)."""
    if not path or _log_size(path) <= since:
        return None
    with open(path) as log:
        log.seek(since)
        records = [json.loads(line) for line in log if line.strip()]
    # an asynchronous load's record spans the pulls recorded beside it
    return sum(r["seconds"] for r in records if not r.get("async"))


def _gap(metrics, start: str, end: str) -> float | None:
    a, b = getattr(metrics, start, 0.0), getattr(metrics, end, 0.0)
    return b - a if a and b else None


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    config = json.loads(sys.argv[1])
    extra = {}
    if config.get("kv_transfer_config"):
        extra["kv_transfer_config"] = KVTransferConfig(**config["kv_transfer_config"])
    llm = LLM(model=config["model"], dtype=config.get("dtype", "bfloat16"),
              max_model_len=config["max_model_len"], enforce_eager=True,
              skip_tokenizer_init=True, disable_log_stats=False,
              enable_prefix_caching=config.get("prefix_caching", True), **extra)  # fmt: skip
    transfer_log = os.environ.get("KVRELAY_VLLM_TRANSFER_LOG", "")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        ask = json.loads(line)
        args = {}
        if ask.get("kv_transfer_params") is not None:
            args["extra_args"] = {"kv_transfer_params": ask["kv_transfer_params"]}
        params = SamplingParams(temperature=0, max_tokens=ask["max_tokens"], detokenize=False,
                                **args)  # fmt: skip
        nixl_before = _histogram_sum(llm, "vllm:nixl_xfer_time_seconds")
        log_before = _log_size(transfer_log)
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ask["tokens"])], params,
                           use_tqdm=False)[0]  # fmt: skip
        wall = time.perf_counter() - started
        metrics = out.metrics
        ttft = getattr(metrics, "first_token_latency", 0.0) or None
        nixl = _histogram_sum(llm, "vllm:nixl_xfer_time_seconds") - nixl_before
        reply = {
            "tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
            "ttft_s": ttft, "wall_s": wall, "kv_transfer_params": out.kv_transfer_params,
            "transfer_s": _log_seconds(transfer_log, log_before) or (nixl or None),
            # engine core clock: queued -> scheduled -> first token
            "queued_to_scheduled_s": _gap(metrics, "queued_ts", "scheduled_ts"),
            "scheduled_to_first_token_s": _gap(metrics, "scheduled_ts", "first_token_ts"),
        }  # fmt: skip
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
