"""The README's commands, run as written, as a new user runs them after the
two set-up commands: every ```sh block, from the repository root, with no
virtualenv on PATH (the launchers must find the project's environment).

The first block is the set-up itself (clone, `make test`, `make demo`): CI
runs `make test` around this very test, and `make demo` (minutes of the
whole workload) is run with a smaller workload by
tests/integration/test_demo.py. Blocks in ```text are templates with
placeholders, not commands.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
SERVER_BLOCK = "examples/launch_local_cluster.sh"
READY_LINE = "cluster up"
READY_TIMEOUT_S = 300
BLOCK_TIMEOUT_S = 120


def sh_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", text, re.S)]


def new_user_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment without any virtualenv on PATH."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env["PATH"] = os.pathsep.join(
        part for part in env["PATH"].split(os.pathsep) if not Path(part, "activate").exists()
    )
    env["LOGDIR"] = str(tmp_path / "logs")
    return env


def start_server(block: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            ["bash", "-c", block],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while READY_LINE not in log.read_text():
        if proc.poll() is not None:
            pytest.fail(f"`{block}` exited {proc.returncode} before it was up:\n{log.read_text()}")
        if time.monotonic() > deadline:
            stop_server(proc)
            pytest.fail(f"`{block}` not up after {READY_TIMEOUT_S} s:\n{log.read_text()}")
        time.sleep(0.5)
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C, as the README says; the launcher stops its processes itself."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def run_block(block: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert out.returncode == 0, f"`{block}` failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_readme_sh_blocks_run_as_written(tmp_path):
    blocks = sh_blocks((ROOT / "README.md").read_text())
    assert blocks and blocks[0].startswith("git clone"), "the first block is the set-up"
    assert SERVER_BLOCK in blocks, "the README starts the local cluster"
    env = new_user_env(tmp_path)
    server = None
    outputs = {}
    try:
        for block in blocks[1:]:
            if block == SERVER_BLOCK:
                server = start_server(block, env, tmp_path / "cluster.log")
            else:
                outputs[block] = run_block(block, env)
    finally:
        if server is not None:
            stop_server(server)
    assert server is not None and server.returncode is not None
    text = "\n".join(outputs.values())
    # What the curl lines answer: a completion, two streams, the stats.
    assert '"choices"' in text
    assert text.count("data: [DONE]") >= 2
    assert '"hit_rates"' in text
