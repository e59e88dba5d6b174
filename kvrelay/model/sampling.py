"""Next-token choice: greedy, or seeded temperature / top-k / top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.model.errors import RequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 is greedy (argmax, lowest id on ties). Otherwise logits are
    divided by the temperature, cut to the `top_k` most likely (0: no cut) and to
    the smallest set whose probability reaches `top_p`, and sampled from a
    generator seeded with `seed`, so a request's tokens are reproducible."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """One request's sampling state (its random generator)."""

    def __init__(self, params: SamplingParams, *, skip: int = 0, vocab: int = 0) -> None:
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)
        if skip and not params.greedy:
            if vocab <= 0:
                raise ValueError("skipping draws needs the vocabulary size")
            # A draw consumes the same generator state whatever the
            # probabilities (one exponential per vocabulary entry), so drawing
            # from a flat distribution skips exactly the draws made elsewhere.
            flat = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
            for _ in range(skip):
                torch.multinomial(flat, 1, generator=self.generator)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] of any float dtype, on any device. Sampling runs on
        the CPU, whose seeded generator gives the same draws on every device."""
        logits = logits.cpu()
        if self.params.greedy:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a non-greedy draw samples from (float64 [vocab]):
        temperature, then top-k, then top-p."""
        p = self.params
        scores = logits.cpu().to(torch.float64) / p.temperature
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # Keep a token when the mass before it is still below top_p: the
            # most likely token always stays.
            before = torch.cumsum(probs, dim=-1) - probs
            drop = order[before >= p.top_p]
            scores[drop] = float("-inf")
        return torch.softmax(scores, dim=-1)
