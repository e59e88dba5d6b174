"""`kvrelay bench layout|transfer --device cuda`: refused clearly without
CUDA (CPU build), and on a GPU a table and JSON with the device baseline."""

import json
import subprocess
import sys

import pytest
import torch

from kvrelay.cli import main


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU build's refusal")
@pytest.mark.parametrize("bench", ["layout", "transfer"])
def test_gpu_benches_refuse_on_a_cpu_build_in_one_line(bench):
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "bench", bench, "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"kvrelay bench {bench}: --device cuda needs a CUDA build of torch" in done.stderr


def test_gpu_transfer_bench_refuses_host_only_flags(monkeypatch):
    # The device is checked first: make this torch look like a CUDA one with a
    # GPU, so the flag check is reached (nothing touches a GPU before it).
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="--modes, --no-perftest are host-only"):
        main(["bench", "transfer", "--device", "cuda", "--modes", "tcp", "--no-perftest"])


@pytest.mark.gpu
def test_bench_layout_on_cuda_against_a_device_copy(tmp_path, capsys):
    out = tmp_path / "layout.json"
    main(["bench", "layout", "--device", "cuda", "--tokens", "1024", "--layers", "4",
          "--runs", "3", "--json", str(out)])  # fmt: skip
    assert "device-to-device copy_" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["device"] == "cuda:0"
    for result in data["results"]:
        assert result["gather"]["median"] > 0 and result["memcpy"]["median"] > 0


@pytest.mark.gpu
def test_bench_transfer_on_cuda_pulls_every_direction(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    main(["bench", "transfer", "--device", "cuda", "--arena-mib", "8", "--sizes-mib", "1",
          "--batch", "16", "--runs", "2", "--json", str(out)])  # fmt: skip
    assert "x copy_" in capsys.readouterr().out
    data = json.loads(out.read_text())
    directions = {r["direction"] for r in data["results"]}
    assert directions == {"gpu<-gpu", "gpu<-host", "host<-gpu"}
    assert all(r["pull"]["median"] > 0 and r["copy"]["median"] > 0 for r in data["results"])
