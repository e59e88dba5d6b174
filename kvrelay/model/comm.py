"""Communication between the ranks of a TP x PP x CP group, as one small seam.

The decoder and the engine call these and nothing else of torch.distributed,
so one process (`LocalComm`) and a process group (`kvrelay.model.parallel`)
run the same code.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Comm(Protocol):
    tp_size: int
    first_stage: bool
    last_stage: bool

    def all_reduce_tp(self, x: torch.Tensor) -> None:
        """Sum `x` in place over the ranks of this TP group."""

    def send_next(self, hidden: torch.Tensor) -> None:
        """Pass hidden states to the next PP stage's rank of the same TP index."""

    def recv_prev(self, like: torch.Tensor) -> torch.Tensor:
        """Hidden states from the previous PP stage, shaped and typed like `like`."""

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 tokens sampled by the sampling rank (last stage, TP rank 0), to all."""

    def min_all(self, value: int) -> int:
        """Minimum of `value` over every rank (agreeing on a usable prefix)."""

    def all_gather_cp(self, x: torch.Tensor) -> list[torch.Tensor]:
        """`x` of every rank of this CP group (same TP and PP coordinates), in
        CP rank order; every rank passes the same shape."""

    @property
    def samples(self) -> bool:
        """Whether this rank samples the next tokens."""


class LocalComm:
    """A group of one: every collective is the identity."""

    tp_size = 1
    first_stage = True
    last_stage = True
    samples = True

    def all_reduce_tp(self, x: torch.Tensor) -> None:
        pass

    def send_next(self, hidden: torch.Tensor) -> None:
        raise RuntimeError("a single-stage model has no next stage")

    def recv_prev(self, like: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a single-stage model has no previous stage")

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def min_all(self, value: int) -> int:
        return value

    def all_gather_cp(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]
