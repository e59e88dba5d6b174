"""Workload profiles of `kvrelay demo`: the defaults each `--profile` sets.

`default` is the short agentic demo (contexts 8.4K -> 16.5K tokens, a few
minutes). `long` is the long-context agentic workload of coding agents:
every session starts at ~32K tokens (a shared 30K-token system prompt and its
own task) and grows by a tool output of a few thousand tokens per turn
towards 200K; its demo model has max positions past 1M, and worker pools
hold a few long contexts, not the whole workload (`pool_contexts`), so local
caches alone cannot hold the working set and the tier's value shows. A
profile only fills what the command line left unset.
"""

from __future__ import annotations

import argparse

# A demo model per profile. The long one has one layer and one KV head of
# 16 dims: on a CPU, attention's cost per (query, key) pair is per layer and
# head, and a long context is mostly attention.
MODELS = {
    "default": dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, max_positions=65536),
    "long": dict(layers=1, hidden=16, heads=1, kv_heads=1, vocab=256,
                 max_positions=(1 << 20) + (1 << 16)),
}  # fmt: skip

# The same profiles for a GLM-5-shaped model (`--arch glm5`; deepseek_v32 and
# deepseek_v3 likewise): MLA with a 16 + 8 latent per token, a DSA indexer whose
# top-k lies well below the profile's contexts (shared layers reuse the one
# before), MoE. The long one keeps the per-token indexer and latent narrow, as
# the Llama long model keeps its one head narrow.
MLA_MODELS = {
    "default": dict(layers=2, hidden=128, heads=4, vocab=256, kv_lora_rank=32, qk_nope=16,
                    qk_rope=16, v_head_dim=16, q_lora_rank=64, index_topk=512,
                    index_head_dim=32, index_heads=4, index_topk_freq=1, experts=8,
                    max_positions=65536, std=0.2),
    "long": dict(layers=1, hidden=32, heads=1, vocab=256, kv_lora_rank=16, qk_nope=8,
                 qk_rope=8, v_head_dim=8, q_lora_rank=16, index_topk=2048, index_head_dim=16,
                 index_heads=2, index_topk_freq=1, experts=4, intermediate=64,
                 moe_intermediate=16, first_dense=0, max_positions=(1 << 20) + (1 << 16),
                 std=0.2),
}  # fmt: skip

PROFILES = {
    "default": dict(
        model=".kvrelay-demo/model", sessions=4, turns=16, system_tokens=8192, user_tokens=256,
        tool_tokens=512, answer_tokens=24, prefill="1xtp2", redeploy="1xtp1pp2",
        redeploy_turns=2, decode="1xtp1", prefill_pages=1024, decode_pages=2048,
        pool_contexts=0.0, sample=0, max_prefill_tokens=4096, cache_gb=0.5, slow_prefill_s=0.0,
    ),
    # 3 sessions x 8 turns: 32K -> 200K tokens (tool outputs of 24K tokens: a
    # tier-mode request's compute is the new tokens times the context, so
    # fewer, bigger turns cost the same compute with fewer round trips).
    "long": dict(
        model=".kvrelay-demo/model-long-1l", sessions=3, turns=8, system_tokens=30720,
        user_tokens=2048, tool_tokens=24560, answer_tokens=16, prefill="2xtp1", redeploy="",
        redeploy_turns=0, decode="1xtp1", prefill_pages=0, decode_pages=0,
        pool_contexts=1.5, sample=2, max_prefill_tokens=8192, cache_gb=0.25,
        slow_prefill_s=1800.0,
    ),
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every profile sets (default None: the profile's value)."""
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default",
                        help="workload defaults: default (8K-16K contexts) or long "
                        "(32K -> 200K agentic contexts, pools of a few contexts)")  # fmt: skip
    helps = {
        "model": "model directory (a random demo model of the profile is written there "
                 "if absent)",
        "prefill": "prefill pool, e.g. 2xtp1, 1xtp2",
        "redeploy": "prefill pool config after the redeploy ('' for none)",
        "redeploy_turns": "turns replayed after the redeploy",
        "decode": "decode pool",
        "prefill_pages": "pool pages per prefill rank (0: from --pool-contexts)",
        "decode_pages": "pool pages per decode rank (0: from --pool-contexts)",
        "pool_contexts": "pools sized to hold this many of the workload's final contexts",
        "sample": "the no-cache mode runs only this many requests (the first full mode's "
                  "prompts, spread over the turns; 0: all)",
        "max_prefill_tokens": "workers' tokens per prefill forward",
        "cache_gb": "cache tier arena (GB)",
        "slow_prefill_s": "control's attempt deadline and workers' rank deadline for long "
                          "cold prefills (0: their defaults)",
    }  # fmt: skip
    for name, value in PROFILES["default"].items():
        kind = type(value)
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=None,
                            help=f"{helps.get(name, name.replace('_', ' '))} (default: the "
                            "profile's)")  # fmt: skip


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fills every flag left unset from the profile, sizes pools in contexts."""
    for name, value in PROFILES[args.profile].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def pool_pages(contexts: float, final_context: int, answer_tokens: int, page_size: int) -> int:
    """Pages that hold `contexts` of the workload's longest context (with
    its answer), at least one whole context plus a page."""
    per_context = -(-(final_context + answer_tokens) // page_size) + 1
    return max(per_context + 1, int(contexts * per_context))
