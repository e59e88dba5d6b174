"""What goes into the engine and what comes out of it: a `Request`, the
`Result` of `Engine.generate`, a `StepOutput` per sequence of `Engine.step`,
and the engine's own state of one admitted request (`Sequence`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.layout import PageKeyChain
from kvrelay.model.sampling import Sampler, SamplingParams
from kvrelay.model.speculative import DraftState


@dataclass(slots=True)
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # Keep the logits of every computed prompt position and of every step
    # (last stage only): what the oracle tests compare.
    return_logits: bool = False
    # Draws the sampler already made elsewhere for this request (a decode
    # worker continues after prefill's first token): the seeded generator is
    # advanced past them, so the tokens equal one process's run.
    skip_draws: int = 0


@dataclass(slots=True)
class Result:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    cached_tokens: int  # prompt tokens whose KV came from the prefix index
    prompt_logits: torch.Tensor | None = None  # [prompt - cached, vocab]
    step_logits: list[torch.Tensor] = field(default_factory=list)  # one per token
    # Wall time of the batch's prefill and of its decode steps (what benchmarks read).
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # With speculation: {"proposed", "accepted", "steps"} (see model/speculative.py).
    spec: dict | None = None
    draft_prompt_logits: torch.Tensor | None = None  # MTP rows of the prefill
    proposals: list[list[int]] = field(default_factory=list)  # per step, with return_logits


@dataclass(slots=True)
class Sequence:
    """The engine's state of one admitted request."""

    request: Request
    tokens: list[int]  # prompt, then generated tokens
    pages: list[int]
    cached: int
    chain: PageKeyChain  # keys of the sequence's full pages so far
    registered: int  # pages [0, registered) are in the prefix index (or skipped)
    sampler: Sampler
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logits: torch.Tensor | None = None
    step_logits: list[torch.Tensor] = field(default_factory=list)
    seq_id: int = 0
    draft: DraftState | None = None  # with speculation

    @property
    def keys(self) -> list[bytes]:
        return self.chain.keys


@dataclass(slots=True)
class StepOutput:
    """What one `Engine.step` produced for one sequence."""

    seq_id: int
    tokens: list[int]  # new tokens of this step (one, or none)
    finish_reason: str | None  # set when the sequence left the batch
    cached_tokens: int
    all_tokens: list[int] | None = None  # prompt + generated, once finished
    spec: dict | None = None  # speculation counts, once finished (see Result.spec)
