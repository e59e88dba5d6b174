"""An agentic multi-turn workload: many sessions that resend their whole conversation.

Every session starts from one system prompt shared by all sessions (the tool
definitions of an agent), adds a user task, and then, turn after turn,
appends the model's answer and a tool's output and resends everything. So
turn t's prompt is turn t-1's prompt + its answer + new tool output, and the
context grows by `tool_tokens + answer_tokens` a turn. Token ids are bytes
(vocab 256, the demo models' byte-level tokenizer), drawn from a generator
seeded per (session, turn), so every run sees the same tool outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvrelay.layout.keys import page_keys


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    sessions: int = 4
    turns: int = 16
    system_tokens: int = 8192
    user_tokens: int = 256
    tool_tokens: int = 512
    answer_tokens: int = 24  # max_tokens of every turn
    vocab: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "system_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be >= 1")
        if self.user_tokens < 0 or self.tool_tokens < 0:
            raise ValueError("workload user_tokens and tool_tokens must be >= 0")

    def final_context(self) -> int:
        """Tokens of the last turn's prompt (answers at their maximum length)."""
        grow = self.tool_tokens + self.answer_tokens
        return self.system_tokens + self.user_tokens + (self.turns - 1) * grow


def _tokens(seed: int, count: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, count).tolist()


@dataclass(slots=True)
class Session:
    """One conversation; `prompt()` is the next turn's prompt, `answered()` adds
    the model's answer and the tool output that follows it."""

    index: int
    config: WorkloadConfig
    conversation: list[int] = field(default_factory=list)
    turn: int = 0

    def __post_init__(self) -> None:
        c = self.config
        system = _tokens(c.seed, c.system_tokens, c.vocab)
        user = _tokens(c.seed * 1_000_003 + 1 + self.index, c.user_tokens, c.vocab)
        self.conversation = system + user

    @property
    def done(self) -> bool:
        return self.turn >= self.config.turns

    def prompt(self) -> list[int]:
        return list(self.conversation)

    def answered(self, answer: list[int]) -> None:
        c = self.config
        seed = (c.seed * 1_000_003 + 1 + self.index) * 1_000_003 + 1 + self.turn
        self.conversation += list(answer) + _tokens(seed, c.tool_tokens, c.vocab)
        self.turn += 1


def optimum_hit_tokens(prompts_and_answers, page_size: int) -> list[int]:
    """Per request, in the order given, the prompt tokens an infinite cache of
    full pages could serve: the leading full pages already seen in an
    earlier request's prompt + answer (a generated token's KV exists once the
    token after it was fed, so the last answer token's page does not count),
    capped so that the last prompt token is computed (its logits give the
    first new token)."""
    seen: set[bytes] = set()
    hits = []
    root = b"\0" * 32
    for prompt, answer in prompts_and_answers:
        keys = page_keys(root, prompt, page_size)
        usable = min(len(keys), (len(prompt) - 1) // page_size)
        hit = 0
        while hit < usable and keys[hit] in seen:
            hit += 1
        hits.append(hit * page_size)
        full = list(prompt) + list(answer)
        seen.update(page_keys(root, full[: len(full) - 1], page_size))
    return hits
