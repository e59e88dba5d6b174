"""Tensor, pipeline and context parallelism: one spawned process per rank.

`ParallelEngine` starts tp x pp x cp processes (`spawn`, never `fork`) that
join a torch.distributed group (gloo on CPU, its pair sockets on loopback,
meeting through a file store; nccl when every rank has a GPU of its own, `kvrelay.model.device`).
Global rank = (cp_rank * pp + pp_rank) * tp + tp_rank, as in
`ParallelConfig.rank`. Each rank loads only its weights and keeps a KV pool
of only its rectangle of heads and layers (every CP rank of a rectangle
holds all its tokens: `kvrelay.model.context_parallel`). The
parent sends every command to every rank and waits for all answers with a
timeout; a rank that fails while the others did not leaves the group out of
step, so the group is shut down.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvrelay.layout import DEFAULT_PAGE_SIZE, ModelKVSpec, ParallelConfig
from kvrelay.model.device import collective_backend, parse_device, rank_device
from kvrelay.model.engine import DEFAULT_MAX_PREFILL_TOKENS, Request, Result
from kvrelay.model.paged_attention import DEFAULT_CHUNK_TOKENS

# How long the other ranks get to answer once one rank has failed.
ERROR_GRACE_S = 10.0


class DistComm:
    """The `Comm` seam over a torch.distributed group of tp x pp x cp ranks.

    Collectives run on `comm_device`: the rank's GPU under nccl, the CPU under
    gloo. Tensors that live elsewhere (GPU activations of ranks sharing one
    GPU, which use gloo) go through a copy there and back."""

    def __init__(self, parallel: ParallelConfig, comm_device: torch.device | str = "cpu") -> None:
        self.comm_device = torch.device(comm_device)
        tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
        self.tp_size = tp
        self.first_stage = parallel.pp_rank == 0
        self.last_stage = parallel.pp_rank == pp - 1
        self.samples = self.last_stage and parallel.tp_rank == 0 and parallel.cp_rank == 0
        self.sampler_rank = parallel.with_rank(0, pp - 1, 0).rank
        rank = parallel.rank
        # PP neighbours: same TP and CP coordinates (TP is the fastest index).
        self.next_rank = rank + tp
        self.prev_rank = rank - tp
        self.tp_group = self.cp_group = None
        # Every rank creates every group, in the same order (a collective call).
        for cp_rank in range(cp):
            for stage in range(pp):
                ranks = [parallel.with_rank(t, stage, cp_rank).rank for t in range(tp)]
                group = dist.new_group(ranks) if tp > 1 else None
                if (stage, cp_rank) == (parallel.pp_rank, parallel.cp_rank):
                    self.tp_group = group
        for stage in range(pp):
            for tp_rank in range(tp):
                ranks = [parallel.with_rank(tp_rank, stage, c).rank for c in range(cp)]
                group = dist.new_group(ranks) if cp > 1 else None
                if (stage, tp_rank) == (parallel.pp_rank, parallel.tp_rank):
                    self.cp_group = group
        self.cp_size = cp

    def all_reduce_tp(self, x: torch.Tensor) -> None:
        if self.tp_size > 1:
            t = x.to(self.comm_device)
            dist.all_reduce(t, group=self.tp_group)
            if t is not x:
                x.copy_(t)

    def send_next(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous().to(self.comm_device), self.next_rank)

    def recv_prev(self, like: torch.Tensor) -> torch.Tensor:
        t = like.to(self.comm_device)
        dist.recv(t, self.prev_rank)
        return t.to(like.device)

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.to(self.comm_device)
        dist.broadcast(t, src=self.sampler_rank)
        return t.to(tokens.device)

    def min_all(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)

    def all_gather_cp(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.cp_size == 1:
            return [x]
        t = x.contiguous().to(self.comm_device)
        parts = [torch.empty_like(t) for _ in range(self.cp_size)]
        dist.all_gather(parts, t, group=self.cp_group)
        return [part.to(x.device) for part in parts]


def rendezvous() -> str:
    """The group's meeting point: a file store in a fresh private directory.
    A tcp:// store's server listens on every interface (whatever host the
    URL names) and asks no token; a file store opens no socket."""
    return f"file://{tempfile.mkdtemp(prefix='kvrelay-group-')}/store"


def _die_with_parent() -> None:
    """A rank whose parent is SIGKILLed would wait on its queue forever: ask
    the kernel to kill it with the parent (Linux; elsewhere nothing)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _worker(
    rank, sizes, init_method, model_dir, options, timeout_s, rank_setup, commands, results
):  # fmt: skip
    _die_with_parent()
    # Gloo binds its pair sockets on the interface named here: loopback only.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Ranks share the machine's cores; one intra-op thread each keeps them
    # from oversubscribing it.
    torch.set_num_threads(1)
    try:
        device, backend = options["device"], options.pop("collective", "gloo")
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=sizes.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        from kvrelay.model.draft_transfer import export_draft_prefix, import_draft_prefix
        from kvrelay.model.loader import load_engine
        from kvrelay.model.page_export import export_prefix, import_prefix

        parallel = list(sizes.all_ranks())[rank]
        comm = DistComm(parallel, device if backend == "nccl" else "cpu")
        engine = load_engine(model_dir, parallel=parallel, comm=comm, **options)
        # A worker's service, built inside the rank (its transfer agent and
        # cache client live here, next to the pool they fill).
        service = rank_setup(engine) if rank_setup is not None else None
    except Exception as error:  # reported to the parent, which raises it
        results.put((rank, False, _portable(error)))
        return
    results.put((rank, True, engine.spec))
    handlers = {
        "generate": engine.generate,
        "export": lambda tokens, arena: export_prefix(engine, tokens, arena),
        "import": lambda tokens, arena: import_prefix(engine, tokens, arena),
        "export_draft": lambda tokens, arena: export_draft_prefix(engine, tokens, arena),
        "import_draft": lambda tokens, arena: import_draft_prefix(engine, tokens, arena),
        "free_pages": lambda: engine.pool.free_pages,
        "draft_page_bytes": lambda: engine.draft.spec.page_bytes if engine.draft else 0,
        "clear_cache": engine.pool.clear_cache,
        "describe": lambda: _describe(engine),
    }
    if service is not None:
        handlers["serve"] = service.serve
    while True:
        name, args = commands.get()
        if name == "stop":
            break
        try:
            results.put((rank, True, handlers[name](*args)))
        except Exception as error:
            results.put((rank, False, _portable(error)))
    if service is not None:
        service.close()
    dist.destroy_process_group()


def _describe(engine) -> dict:
    """What this rank holds: its config, its pool's layers and heads."""
    plan = engine.shard.plan
    return {
        "parallel": engine.parallel,
        "layers": (plan.layer_start, plan.layer_end),
        "kv_heads": (plan.kv_head_start, plan.kv_head_start + plan.num_kv_heads),
        "q_heads": (plan.q_head_start, plan.q_head_start + plan.num_q_heads),
        "pool_layers": engine.pool.num_layers,
        # An MLA pool holds one latent head (replicated over TP).
        "pool_heads": getattr(engine.pool, "num_heads", 1),
    }


def _portable(error: Exception) -> Exception:
    """The error itself if it survives pickling, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError("".join(traceback.format_exception(error)))


class ParallelEngine:
    """A TP x PP engine; `generate`, `export_prefix`, `import_prefix` as for one
    process. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        model_dir,
        *,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        dtype: str = "float32",
        page_size: int = DEFAULT_PAGE_SIZE,
        num_pages: int = 256,
        timeout_s: float = 300.0,
        rank_setup=None,
        device: str = "cpu",
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        attention_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        speculative: int = 0,
        key_scheme: str = "kvrelay",
        batch_invariant_attention: bool = False,
    ) -> None:
        """`rank_setup(engine) -> service` (picklable, e.g. a module-level
        function or a partial of one) runs in each rank after its engine
        loads; `ask(payload)` then hands the bytes to every rank's
        `service.serve(payload) -> bytes` (a worker's typed commands,
        `kvrelay.worker.rank_ops`), and `service.close()` runs when the rank
        stops. Ranks die with the thread that starts them (parent-death
        signal): create the engine from a thread that outlives it, e.g. the
        main thread. `device` is the first rank's (`cpu`, `cuda`, `cuda:N`);
        rank r takes `rank_device`."""
        sizes = ParallelConfig(tp=tp, pp=pp, cp=cp)  # validates the sizes
        self.tp, self.pp, self.cp, self.world = tp, pp, cp, sizes.world_size
        base = parse_device(device)
        devices = [rank_device(base, r, self.world) for r in range(self.world)]
        self.timeout_s = timeout_s
        context = mp.get_context("spawn")
        self._commands = [context.Queue() for _ in range(self.world)]
        self._results = context.Queue()
        options = {"dtype": dtype, "page_size": page_size, "num_pages": num_pages,
                   "max_prefill_tokens": max_prefill_tokens,
                   "attention_chunk_tokens": attention_chunk_tokens}  # fmt: skip
        # The rest only when it differs from load_engine's defaults.
        extra = {"speculative": speculative, "key_scheme": key_scheme != "kvrelay" and key_scheme,
                 "batch_invariant_attention": batch_invariant_attention}  # fmt: skip
        options |= {name: value for name, value in extra.items() if value}
        self._rendezvous = rendezvous()
        self._procs = []
        options["collective"] = collective_backend(devices)
        for rank in range(self.world):
            rank_options = {**options, "device": str(devices[rank])}
            args = (rank, sizes, self._rendezvous, str(model_dir), rank_options, timeout_s,
                    rank_setup)  # fmt: skip
            queues = (self._commands[rank], self._results)
            self._procs.append(context.Process(target=_worker, args=args + queues, daemon=True))
        for proc in self._procs:
            proc.start()
        try:
            self.spec: ModelKVSpec = self._collect()[0]
        except BaseException:
            self.close()
            raise
        self.sampler_rank = sizes.with_rank(0, pp - 1, 0).rank

    # -- commands ---------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[Result]:
        return self._call("generate", requests)[self.sampler_rank]

    def export_prefix(self, tokens: list[int]) -> torch.Tensor:
        """Pages of the cached tokens `tokens` (a trailing partial page
        included), as unified page objects: every writer rank gathers its
        rectangle of the pages its CP rank owns into one shared arena."""
        num_pages = -(-len(tokens) // self.spec.page_size)
        arena = torch.zeros(num_pages, self.spec.page_bytes, dtype=torch.uint8).share_memory_()
        self._call("export", list(tokens), arena)
        return arena

    def import_prefix(self, tokens: list[int], arena: torch.Tensor) -> int:
        if not arena.is_shared():
            arena = arena.clone().share_memory_()
        return self._call("import", list(tokens), arena)[0]

    def export_draft_prefix(self, tokens: list[int]) -> torch.Tensor:
        """The draft pages of `tokens` (`kvrelay.model.draft_transfer`), in
        the draft spec's page layout."""
        num_pages = max(0, (len(tokens) - 1) // self.spec.page_size)
        # The draft's own spec (an MLA draft's page is not one target layer).
        page_bytes = max(self._call("draft_page_bytes"))
        arena = torch.zeros(num_pages, page_bytes, dtype=torch.uint8).share_memory_()
        self._call("export_draft", list(tokens), arena)
        return arena

    def import_draft_prefix(self, tokens: list[int], arena: torch.Tensor) -> int:
        if not arena.is_shared():
            arena = arena.clone().share_memory_()
        return self._call("import_draft", list(tokens), arena)[0]

    def free_pages(self) -> list[int]:
        """Each rank's free pages."""
        return self._call("free_pages")

    def clear_cache(self) -> None:
        self._call("clear_cache")

    def describe(self) -> list[dict]:
        """Each rank's share of the model and its pool."""
        return self._call("describe")

    def ask(self, payload: bytes) -> list[bytes]:
        """Hands `payload` to every rank's service; their answers in rank order."""
        return self._call("serve", payload)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.exitcode is None for p in self._procs)

    def _call(self, name: str, *args) -> list:
        if not self._procs:
            raise RuntimeError("the parallel engine is closed")
        for q in self._commands:
            q.put((name, args))
        return self._collect()

    def _collect(self) -> list:
        deadline = time.monotonic() + self.timeout_s
        answers: dict[int, tuple[bool, object]] = {}  # rank -> (ok, answer or exception)
        while len(answers) < self.world:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
                answers[rank] = (ok, value)
                if not ok:
                    # Ranks that went on may be blocked in a collective the
                    # failed rank will never join: give them a short grace.
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
            dead = [r for r in dead if r not in answers]
            if dead or time.monotonic() > deadline:
                self.close()
                errors = [value for ok, value in answers.values() if not ok]
                if errors:
                    raise errors[0]
                why = f"ranks {dead} exited" if dead else f"no answer in {self.timeout_s:.0f} s"
                raise RuntimeError(f"parallel engine tp={self.tp} pp={self.pp} cp={self.cp}: {why}")
        errors = [value for ok, value in answers.values() if not ok]
        if errors:
            if len(errors) < self.world:
                self.close()  # the ranks that went on are out of step with the others
            raise errors[0]
        return [answers[r][1] for r in range(self.world)]

    def close(self) -> None:
        procs, self._procs = self._procs, []
        for rank, proc in enumerate(procs):
            if proc.exitcode is None:
                self._commands[rank].put(("stop", ()))
        deadline = time.monotonic() + 10
        for proc in procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(os.path.dirname(self._rendezvous.removeprefix("file://")), ignore_errors=True)

    def __enter__(self) -> ParallelEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
