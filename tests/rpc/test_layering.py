"""The control process stays off the data plane: importing its app and its
launcher loads neither torch nor the transfer, cache or model packages
(DESIGN.md section 2: control imports rpc and layout only)."""

import json
import os
import subprocess
import sys

PROBE = """
import json, sys
import kvrelay.control.app, kvrelay.control.launch
print(json.dumps(sorted(sys.modules)))
"""


def test_control_imports_no_torch_and_no_data_plane():
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stdout.splitlines()[-1])
    assert "kvrelay.control.app" in modules  # the probe did import control
    forbidden = ("torch", "kvrelay.transfer", "kvrelay.cache", "kvrelay.model", "kvrelay.cuda_ext")
    loaded = [m for m in modules if m.split(".")[0] == "torch" or m.startswith(forbidden)]
    assert loaded == [], f"control imported {loaded[:10]}"
