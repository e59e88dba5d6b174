"""A real SGLang server in a process group of its own, on CPU, for tests and benches.

`SGLangServer` starts `kvrelay.adapters.sglang.cpu.launch_server` (SGLang's
launcher with the CPU stand-ins) for a model directory, with HiCache and an
L3 (`kvrelay` through SGLang's `dynamic` backend, SGLang's own `file` or
`mooncake`, or none), waits for its health check and speaks its native HTTP
API: `/generate` with token ids (the server runs with `--skip-tokenizer-init`),
`/flush_cache`.
Every wait is bounded; `stop()` ends the whole process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.ports import free_port

L3_KINDS = ("kvrelay", "mooncake", "file", "none")
# HiCache's io backend per host layout (both stood in for by the CPU layer):
# `direct` moves per-layer token slots and whole pages of all layers, the
# `kernel` backend token rows of page_first and page_head pools.
IO_BACKENDS = {
    "layer_first": "direct",
    "page_first_direct": "direct",
    "page_first": "kernel",
    "page_head": "kernel",
}


def kvrelay_extra(servers, token: str, **settings) -> dict:
    """The extra config that loads kvrelay as SGLang's L3 (the README's line)."""
    return {
        "backend_name": "kvrelay",
        "module_path": "kvrelay.adapters.sglang.storage",
        "class_name": "KvrelayHiCacheStorage",
        "interface_v1": 1,
        "servers": list(servers),
        "token": token,
        **settings,
    }


@dataclass
class Reply:
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    storage_tokens: int  # of cached_tokens, read from the L3
    ttft_s: float | None = None  # streamed requests: time to the first token
    spec: dict = field(default_factory=dict)  # speculative decoding: SGLang's spec_* counts


@dataclass
class SGLangServer:
    model_dir: Path
    log_path: Path
    l3: str = "kvrelay"
    extra: dict = field(default_factory=dict)  # kvrelay, mooncake: the extra config
    file_dir: Path | None = None  # file: SGLang's HiCacheFile directory
    layout: str = "layer_first"
    page_size: int = 16
    dtype: str = "bfloat16"
    device_tokens: int = 8192  # --max-total-tokens
    host_ratio: float = 2.0  # host pool = ratio x device pool
    hierarchical: bool = True
    tp: int = 1  # tensor parallel ranks (gloo on CPU), one core each
    # torch's intra-op threads per rank (OMP_NUM_THREADS); None: torch's
    # default, every core. On a shared host one thread keeps a rank's time
    # steady: OpenMP threads that wait on each other at every op stall
    # whenever a neighbour holds one of their cores.
    threads: int | None = None
    # MTP / EAGLE speculative decoding: a draft chain (topk 1) of this many
    # steps, verified as steps + 1 tokens; 0: none.
    speculative_steps: int = 0
    # Requests wait for their L3 prefetch to finish: the hit is what the L3
    # holds, not what it delivers before a deadline (SGLang's default).
    prefetch_policy: str = "wait_complete"
    # An idle scheduler polls its sockets instead of spinning: servers left
    # up beside others (the bench keeps one per mode) then take no CPU.
    sleep_on_idle: bool = False
    start_timeout_s: float = 300.0
    request_timeout_s: float = 120.0
    port: int = 0
    process: subprocess.Popen | None = None
    _deadline: float = 0.0

    def command(self) -> list[str]:
        args = [
            sys.executable, "-m", "kvrelay.adapters.sglang.cpu.launch_server",
            "--model-path", str(self.model_dir), "--dtype", self.dtype, "--device", "cpu",
            "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(self.port),
            "--max-total-tokens", str(self.device_tokens), "--page-size", str(self.page_size),
            "--log-level", "info", "--tp-size", str(self.tp),
        ]  # fmt: skip
        if self.sleep_on_idle:
            args.append("--sleep-on-idle")
        if self.speculative_steps:
            steps = self.speculative_steps
            args += [
                "--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1),
            ]  # fmt: skip
        if self.hierarchical:
            if self.layout not in IO_BACKENDS:
                raise ValueError(f"host layout {self.layout!r}: one of {sorted(IO_BACKENDS)}")
            args += [
                "--enable-hierarchical-cache", "--hicache-io-backend", IO_BACKENDS[self.layout],
                "--hicache-mem-layout", self.layout, "--hicache-ratio", str(self.host_ratio),
                "--hicache-size", "0",
            ]  # fmt: skip
        if self.l3 != "none":
            args += ["--hicache-storage-prefetch-policy", self.prefetch_policy]
        if self.l3 in ("kvrelay", "mooncake"):
            backend = "dynamic" if self.l3 == "kvrelay" else "mooncake"
            args += ["--hicache-storage-backend", backend,
                     "--hicache-storage-backend-extra-config", json.dumps(self.extra)]  # fmt: skip
        elif self.l3 == "file":
            args += ["--hicache-storage-backend", "file"]
        elif self.l3 != "none":
            raise ValueError(f"l3 must be one of {L3_KINDS}, not {self.l3!r}")
        return args

    def start(self) -> SGLangServer:
        return self.launch().wait_healthy()

    def launch(self) -> SGLangServer:
        """Start the process; `wait_healthy` waits for it (several servers can
        then import and load side by side)."""
        self.port = self.port or free_port()
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.tp > 1:  # SGLang binds each rank's threads to its cores ("0|1")
            cores = os.cpu_count() or 1
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                str(rank % cores) for rank in range(self.tp)
            )
        if self.l3 == "file":
            if self.file_dir is None:
                raise ValueError("the file L3 needs file_dir")
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(self.file_dir)
        if self.l3 == "mooncake":
            # Mooncake's transfer engine reads it at setup (its listeners
            # ignore it in 0.3.13.post1: kvrelay.bench.sglang_mooncake).
            env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        self._deadline = time.monotonic() + self.start_timeout_s
        return self

    def wait_healthy(self) -> SGLangServer:
        rebinds = 0
        while time.monotonic() < self._deadline:
            if self._port_was_taken() and rebinds < self.REBINDS:
                # Another process bound the port while this one imported:
                # SGLang's HTTP server then neither serves nor exits.
                rebinds += 1
                self.stop()
                self.port = free_port()
                self.launch()
                continue
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang server exited ({self.process.returncode}): "
                                   f"{self.log_tail()}")  # fmt: skip
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"SGLang server not healthy in {self.start_timeout_s} s: "
                           f"{self.log_tail()}")  # fmt: skip

    REBINDS = 3  # relaunches on a fresh port when the given one was taken

    def _port_was_taken(self) -> bool:
        return f"('127.0.0.1', {self.port}): address already in use" in self.log_tail(40)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _post(self, path: str, body: dict | None, timeout: float) -> bytes:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, method="POST",
            headers={"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.read()

    def generate(self, input_ids: list[int], max_new_tokens: int = 8) -> Reply:
        """Greedy generation; raises on any HTTP error (a failed request)."""
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
        body = {"input_ids": list(input_ids), "sampling_params": sampling}
        start = time.monotonic()
        request = urllib.request.Request(
            f"{self.url}/generate", data=json.dumps({**body, "stream": True}).encode(),
            method="POST", headers={"content-type": "application/json"},
        )  # fmt: skip
        first, last = None, None
        with urllib.request.urlopen(request, timeout=self.request_timeout_s) as r:
            for line in r:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(f"SGLang request failed: {chunk['error']}")
                if first is None and chunk.get("output_ids"):
                    first = time.monotonic() - start
                last = chunk
        if last is None:
            raise RuntimeError("SGLang answered no tokens")
        meta = last["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return Reply(
            output_ids=list(last["output_ids"]), prompt_tokens=meta["prompt_tokens"],
            cached_tokens=meta["cached_tokens"], storage_tokens=details.get("storage", 0),
            ttft_s=first, spec={k: v for k, v in meta.items() if k.startswith("spec_")},
        )  # fmt: skip

    def flush(self, timeout_s: float = 60.0) -> None:
        """Empty the device and host caches (the L3 keeps its pages)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                answer = self._post("/flush_cache", None, timeout_s).decode()
            except urllib.error.HTTPError as exc:  # requests still running: retry
                answer = exc.read().decode(errors="replace")
            if answer.startswith("Cache flushed"):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang did not flush its cache: {answer}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Children left in the group (scheduler, detokenizer) go with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
