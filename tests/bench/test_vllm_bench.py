"""`kvrelay bench vllm`'s own measurements that need no engine: the CPU a
process tree keeps busy while it should be idle."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from kvrelay.bench.vllm import idle_cores

SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"


def test_idle_cores_sees_a_polling_child_and_not_a_sleeping_one():
    # The polling one is a grandchild: engines poll in processes they spawn.
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])"
    parent = [sys.executable, "-c", spawn]
    polling = subprocess.Popen(parent)
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)  # both started
        busy = idle_cores([polling.pid], seconds=1.0)
        quiet = idle_cores([sleeping.pid], seconds=1.0)
    finally:
        for process in (polling, sleeping):
            process.kill()
            process.wait(10)
    assert busy > 0.3  # a core, less what two cores shared with others leave it
    assert quiet < 0.1


def test_a_missing_lmcache_environment_is_reported_absent_with_its_make_target(tmp_path, capsys):
    # No engine starts: the only connector asked for is LMCache, whose
    # environment is not there.
    from kvrelay.cli import main

    out = tmp_path / "bench.json"
    main(["bench", "vllm", "--vllm-python", sys.executable, "--parts", "reuse",
          "--reuse-connectors", "lmcache", "--lmcache-python", str(tmp_path / "none" / "python"),
          "--layers", "1", "--hidden", "32", "--heads", "1", "--kv-heads", "1",
          "--reuse-sizes", "300", "--out", str(tmp_path / "logs"), "--json", str(out)])  # fmt: skip
    absent = json.loads(out.read_text())["reuse_peers"]["lmcache"]["absent"]
    assert "make lmcache-deps" in absent and str(tmp_path / "none" / "python") in absent
    assert "lmcache: absent: " in capsys.readouterr().out
