"""Where a rank's weights, KV pool and activations live (DESIGN.md section 9).

Device is a parameter, not a branch per module: every module takes a
`torch.device` and allocates there. This file holds the few places where CPU
and CUDA genuinely differ: parsing and validating `--device`, placing the
ranks of a TP x PP group on GPUs, the collective backend, and waiting for
queued GPU work before bytes are handed to another process.
"""

from __future__ import annotations

import torch

from kvrelay.model.errors import ModelLoadError


class DeviceError(ModelLoadError):
    """A --device this process cannot use (no CUDA build, no such GPU)."""


def parse_device(text: str | torch.device) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, checked against this torch and machine."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise DeviceError(f"--device must be cpu, cuda or cuda:N, got {text!r}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"--device must be cpu, cuda or cuda:N, got {text!r}")
    if torch.version.cuda is None:
        raise DeviceError(
            f"--device {text} needs a CUDA build of torch; this one is {torch.__version__} "
            "(install one with `make setup TORCH_SPEC=...`, see README: GPUs)"
        )
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {text}: torch has CUDA but no GPU is visible")
    index = 0 if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {text}: only {count} GPU(s) visible (cuda:0..{count - 1})")
    return torch.device("cuda", index)


def rank_device(base: torch.device | str, rank: int, world: int = 1) -> torch.device:
    """The device of `rank` of a group of `world` ranks whose first is `base`:
    consecutive GPUs cuda:(base + rank), or all on cuda:0 when only one GPU is
    visible. CPU ranks are all on the CPU."""
    base = torch.device(base)
    if base.type == "cpu":
        return base
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    first = base.index or 0
    if first + world > count:
        raise DeviceError(
            f"{world} ranks from cuda:{first} need GPUs up to cuda:{first + world - 1}; "
            f"{count} visible"
        )
    return torch.device("cuda", first + rank)


def collective_backend(devices: list[torch.device]) -> str:
    """nccl when every rank has a GPU of its own, else gloo. NCCL refuses two
    ranks on one GPU, so ranks sharing a single GPU fall back to gloo (their
    collectives then travel through host memory)."""
    if all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices):
        return "nccl"
    return "gloo"


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on `device`'s current stream: page copies must
    have landed before a handle is published, a page is committed to the tier
    or a staging row is reused. Nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
