"""A prefill or decode worker's settings: one dataclass, the source of
`kvrelay launch prefill|decode`'s flags and of their `KVRELAY_<FIELD>`
variables."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvrelay.layout import DEFAULT_PAGE_SIZE
from kvrelay.options import option
from kvrelay.rpc import split_address
from kvrelay.rpc.worker_ops import Role
from kvrelay.worker.rank import RankOptions, Staging

BACKENDS = ("auto", "ucx", "tcp")


def default_backend() -> str:
    """ucx when `kvrelay._ucx` is built, else tcp."""
    from kvrelay.transfer import available

    return "ucx" if available("ucx") else "tcp"


@dataclass(slots=True)
class WorkerConfig:
    model_dir: str = option(help="model directory (HF format)", flag="--model")
    token: str = option(help="cluster token")
    tp: int = option(1, help="tensor-parallel ranks", minimum=1)
    pp: int = option(1, help="pipeline-parallel stages", minimum=1)
    cp: int = option(1, help="context-parallel prefill ranks (prefill only)", minimum=1)
    control: str = option("", help="control's URL (registration); empty runs unregistered")
    cache: tuple[str, ...] = option((), help="cache servers H:P[,H:P...]")
    backend: str = option(
        "auto", help="transfer backend (auto: ucx when built, else tcp)", choices=BACKENDS
    )
    listen: str = option("127.0.0.1:0", help="msgpack listener HOST:PORT")
    num_pages: int = option(256, help="KV pool pages per rank", minimum=1)
    page_size: int = option(DEFAULT_PAGE_SIZE, help="tokens per page", minimum=1)
    dtype: str = option("float32", help="model and KV dtype")
    device: str = option(
        "cpu",
        help="cpu, cuda or cuda:N: the first rank's device; rank r on cuda:N+r, "
        "or all on one GPU when one is visible",
    )
    staging: Staging = option(  # noqa: RUF009 (option() is a dataclasses.field)
        Staging.PINNED,
        help="GPU pools: staging in host memory via pinned buffers (pinned) or in GPU "
        "memory (device; ucx only)",
    )
    # The defaults are kvrelay.model.engine's and paged_attention's (not
    # imported: parsing the command line must not load torch).
    max_prefill_tokens: int = option(
        4096,
        help="tokens per prefill forward (chunked prefill): bounds activations and "
        "attention state per layer, whatever the prompt's length",
        minimum=1,
    )
    attention_chunk_tokens: int = option(
        8192, help="cached-context tokens attended per block (paged attention)", minimum=1
    )
    rank_timeout_s: float = option(
        300.0,
        help="deadline of one engine command on the ranks (a batch's prefill: raise it "
        "for long cold prompts on slow devices) and of their collectives",
        positive=True,
    )
    local_cache: bool = option(True, help="prefix reuse from the worker's own pool")
    max_batch: int = option(8, help="requests per batch (decode: running sequences)", minimum=1)
    max_queue: int = option(64, help="queued requests before Busy", minimum=1)
    write_back: bool = option(
        False, help="decode: write finished sequences' full pages to the tier"
    )
    staging_pages: int = option(
        0, help="rows of each rank's staging arena (0: as many as --num-pages)", minimum=0
    )
    transfer_timeout_s: float = option(10.0, help="deadline of every page pull/push", positive=True)
    hello_timeout_s: float = option(
        10.0, help="a connection's hello must come within", positive=True
    )
    drain_timeout_s: float = option(
        30.0, help="on SIGTERM, how long in-flight requests may finish", positive=True
    )
    speculative: int = option(
        0,
        help="decode: draft K tokens per step with the model's MTP layer (0: off); "
        "prefill: any K > 0 computes, stages and writes the MTP layer's draft pages too",
        minimum=0,
    )
    batch_invariant_attention: bool = option(
        False,
        help="attention whose bits do not depend on the batch: pages byte-identical "
        "whatever --cp computed them (slower prefill attention)",
    )
    # The choices are kvrelay.layout.KEY_SCHEMES (not imported: see staging).
    key_scheme: str = option(
        "kvrelay",
        help="how page keys derive from token ids: kvrelay, or sglang to hit the pages "
        "SGLang ranks write through kvrelay's HiCache backend (same model identity)",
        choices=["kvrelay", "sglang"],
    )

    def checked(self, role: Role) -> WorkerConfig:
        """This config with the backend and device resolved; SystemExit for
        combinations the role cannot run."""
        from kvrelay.model.device import DeviceError, parse_device

        if role is Role.DECODE and self.cp != 1:
            raise SystemExit(
                "kvrelay launch decode: --cp is not supported on decode (decode runs CP=1; "
                "it reads pages written by a prefill of any --cp)"
            )
        backend = default_backend() if self.backend == "auto" else self.backend
        try:
            device = parse_device(self.device)
        except DeviceError as exc:
            raise SystemExit(f"kvrelay launch: {exc}") from None
        if device.type == "cuda" and self.staging == Staging.DEVICE and backend != "ucx":
            raise SystemExit(
                "kvrelay launch: --staging device puts staging in GPU memory, which only the "
                f"ucx backend moves; use --backend ucx or --staging pinned (not {backend})"
            )
        return dataclasses.replace(self, backend=backend, device=str(device))

    def rank_options(self) -> RankOptions:
        return RankOptions(
            token=self.token,
            backend=default_backend() if self.backend == "auto" else self.backend,
            cache=tuple(self.cache),
            staging_pages=self.staging_pages or self.num_pages,
            staging=self.staging,
            transfer_timeout_s=self.transfer_timeout_s,
            local_cache=self.local_cache,
            write_back=self.write_back,
            agent_host=split_address(self.listen)[0],
        )
