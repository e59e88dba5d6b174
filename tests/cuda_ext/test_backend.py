import os
import subprocess
import sys

from kvrelay.cuda_ext import BACKEND_NAME
from tests.cuda_ext.impls import NO_EXT

PROBE = "import kvrelay.cuda_ext as c; print(c.BACKEND_NAME)"


def run_probe(**env):
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=os.environ | env,
        timeout=120,
        check=True,
    )


def test_the_compiled_module_is_used_when_built():
    assert ("numba" if NO_EXT else "cpp") == BACKEND_NAME


def test_no_ext_selects_numba_with_a_one_line_warning():
    out = run_probe(KVRELAY_NO_EXT="1")
    assert out.stdout.strip() == "numba"
    warning = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(warning) == 1 and "KVRELAY_NO_EXT=1" in warning[0] and "numba" in warning[0]


def test_compiled_selection_is_silent():
    if NO_EXT:
        return
    out = run_probe(KVRELAY_NO_EXT="0")
    assert out.stdout.strip() == "cpp" and out.stderr.strip() == ""
