"""`kvrelay bench vllm`'s handle on one engine process (`kvrelay.bench.vllm_engine`,
run with the Python of the environment that holds vLLM and the connector
under test): a request per stdin line, a reply per stdout line."""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import time
from pathlib import Path

from kvrelay.procfs import die_with_parent, end_process

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 128  # vLLM's CPU block size: one kvrelay page


def longest_prompt(args) -> int:
    """The longest prompt either part of the bench sends (the engines' context)."""
    return max(int(s) for text in (args.sizes, args.reuse_sizes) for s in text.split(",") if s)


def warm_up(sizes: list[int]) -> list[int]:
    """An uncounted prompt: an engine's first request pays one-time costs
    (first forward of each shape, a connector's first connection)."""
    rnd = random.Random(99)
    return [rnd.randrange(512) for _ in range(min(sizes))]


class Engine:
    """One `vllm_engine` process: a request per stdin line, a reply per stdout line.

    `python`: the interpreter of the environment to run it in (default
    `--vllm-python`; LMCache's engines run in `.venv-lmcache`)."""

    def __init__(self, name: str, args, model_dir: Path, work: Path, transfer, env=None,
                 python: str | None = None) -> None:  # fmt: skip
        self.name, self.timeout_s = name, args.engine_timeout_s
        config = {"model": str(model_dir),
                  "max_model_len": longest_prompt(args) + args.decode_tokens + BLOCK,
                  "dtype": args.dtype, "kv_transfer_config": transfer}  # fmt: skip
        self.log = work / f"{name}.log"
        self._pending = b""
        # `--threads 1`: two engines share the host, and vLLM's processes spin
        # (`sched_yield`) for a second after each step, so an OpenMP team of
        # every core waits at each op for a thread a spinner displaced.
        threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
        full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                        PYTHONPATH=str(ROOT), **threads, **(env or {}))  # fmt: skip
        with self.log.open("w") as err:
            # die_with_parent: a bench killed outright (no `finally`) takes its engines along
            self.process = subprocess.Popen(
                [python or args.vllm_python, "-m", "kvrelay.bench.vllm_engine", json.dumps(config)],
                cwd=ROOT, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True, preexec_fn=die_with_parent(),
            )  # fmt: skip

    def ready(self) -> Engine:
        """Waits for the engine to come up (engines start side by side)."""
        self._read()  # {"ready": true}
        return self

    def _read(self) -> dict:
        """The next JSON line on the engine's stdout (other lines are vLLM's).
        Read from the descriptor, not the buffered file: a line left in the
        file's buffer would never wake `select` again."""
        deadline = time.monotonic() + self.timeout_s
        fd = self.process.stdout.fileno()
        while time.monotonic() < deadline:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                self._pending += chunk
            elif self.process.poll() is not None:
                break
        self.close()
        raise RuntimeError(f"engine {self.name} stopped: {self.log.read_text()[-3000:]}")

    def ask(self, tokens: list[int], max_tokens: int, params: dict | None = None) -> dict:
        ask = {"tokens": tokens, "max_tokens": max_tokens, "kv_transfer_params": params}
        self.process.stdin.write(json.dumps(ask) + "\n")
        self.process.stdin.flush()
        return self._read()

    def stop(self) -> None:
        """Ends the engine now (a bench interrupted mid-run: an engine still
        loading or computing would read its closed stdin only when done)."""
        end_process(self.process, 15.0, 10.0)

    def close(self) -> None:
        """Ends the engine as a client would: no more requests (stdin closed)."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
