"""Device placement: --device parsing and validation, placing TP x PP ranks on
GPUs, the collective backend (CPU tests); and the runner on CUDA against HF,
TP/PP on GPUs, page export/import between a GPU pool and GPU or host staging
(`gpu` tests, skipped without CUDA)."""

import subprocess
import sys

import pytest
import torch

from kvrelay.model import ParallelEngine, Request, SamplingParams, load_engine
from kvrelay.model.device import (
    DeviceError,
    collective_backend,
    parse_device,
    rank_device,
)
from kvrelay.model.page_export import export_prefix, import_prefix
from tests.model.oracle import hf_greedy, hf_model
from tests.support.models import prompt_tokens

CPU_TORCH = torch.version.cuda is None
cpu_build_only = pytest.mark.skipif(not CPU_TORCH, reason="checks the CPU build's refusal")


def max_diff(a, b) -> float:
    return float((a.to(torch.float64).cpu() - b.to(torch.float64).cpu()).abs().max())


# -- CPU ------------------------------------------------------------------------
def test_parse_device_accepts_cpu_and_refuses_what_is_not_a_device():
    assert parse_device("cpu") == torch.device("cpu")
    for bad in ["tpu", "gpu0", "", "cuda:x", "meta"]:
        with pytest.raises(DeviceError, match="cpu, cuda or cuda:N"):
            parse_device(bad)


@cpu_build_only
@pytest.mark.parametrize("text", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_on_the_cpu_build_of_torch_is_refused_with_the_fix(text):
    with pytest.raises(DeviceError, match=r"needs a CUDA build of torch.*TORCH_SPEC"):
        parse_device(text)


def test_ranks_go_on_consecutive_gpus_or_all_on_the_only_one(monkeypatch):
    assert rank_device("cpu", 3, 4) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [rank_device("cuda:1", r, 3) for r in range(3)] == [
        torch.device("cuda", i) for i in (1, 2, 3)
    ]
    with pytest.raises(DeviceError, match="need GPUs up to cuda:4; 4 visible"):
        rank_device("cuda:1", 0, 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert {rank_device("cuda", r, 4) for r in range(4)} == {torch.device("cuda", 0)}


def test_nccl_only_when_every_rank_has_a_gpu_of_its_own():
    gpus = [torch.device("cuda", i) for i in range(2)]
    assert collective_backend(gpus) == "nccl"
    assert collective_backend([gpus[0], gpus[0]]) == "gloo"  # NCCL refuses a shared GPU
    assert collective_backend([torch.device("cpu")] * 2) == "gloo"


def test_the_cpu_runs_the_same_code_path_with_device_given(model_dirs):
    """--device cpu is the default spelled out: identical tokens and logits."""
    model_dir = model_dirs("llama-gqa")
    prompt = prompt_tokens(40, seed=4)
    request = [Request(prompt, SamplingParams(6), return_logits=True)]
    plain = load_engine(model_dir, dtype="float64", page_size=16).generate(request)[0]
    placed = load_engine(model_dir, dtype="float64", page_size=16, device="cpu")
    assert placed.pool.device == torch.device("cpu")
    got = placed.generate(request)[0]
    assert got.tokens == plain.tokens
    assert torch.equal(got.prompt_logits, plain.prompt_logits)


@pytest.mark.cluster  # starts rank or CLI processes
@cpu_build_only
@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt-ids", "1,2,3", "--device", "cuda"],
        ["launch", "prefill", "--token", "t", "--device", "cuda:1"],
        ["launch", "decode", "--token", "t", "--device", "cuda"],
    ],
    ids=["generate", "launch-prefill", "launch-decode"],
)
def test_the_cli_refuses_cuda_on_a_cpu_build_in_one_line(model_dirs, command):
    model_dir = model_dirs("llama-gqa")
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", *command, "--model", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "needs a CUDA build of torch" in done.stderr
    assert "Traceback" not in done.stderr


# -- GPU ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-mha"])
def test_float32_on_cuda_matches_hf_on_cuda(model_dirs, name):
    """Tolerance: prompt logits within 1e-4 (DESIGN.md's float32 bound, TF32
    off as torch defaults); greedy tokens exactly equal, 24 of them."""
    model_dir = model_dirs(name)
    prompt = prompt_tokens(100, seed=21)
    oracle = hf_greedy(hf_model(model_dir, torch.float32).to("cuda:0"), prompt, 24)
    engine = load_engine(model_dir, dtype="float32", page_size=16, device="cuda:0")
    assert engine.pool.storage.is_cuda and engine.shard.weights.lm_head.is_cuda
    got = engine.generate([Request(prompt, SamplingParams(24), return_logits=True)])[0]
    assert max_diff(got.prompt_logits, oracle.prompt_logits) < 1e-4
    assert got.tokens == oracle.tokens


@pytest.mark.gpu
def test_bfloat16_on_cuda_matches_hf(model_dirs):
    """Tolerance: bf16 prompt logits within 5% of the largest float32 logit
    (bf16 keeps ~3 significant digits); greedy tokens equal HF's own bf16 run
    on the same GPU, 8 of them."""
    model_dir = model_dirs("llama-gqa")
    prompt = prompt_tokens(60, seed=22)
    want = hf_greedy(hf_model(model_dir, torch.float32).to("cuda:0"), prompt, 1)
    same = hf_greedy(hf_model(model_dir, torch.bfloat16).to("cuda:0"), prompt, 8)
    engine = load_engine(model_dir, dtype="bfloat16", page_size=16, device="cuda:0")
    got = engine.generate([Request(prompt, SamplingParams(8), return_logits=True)])[0]
    assert got.prompt_logits.dtype == torch.bfloat16
    scale = float(want.prompt_logits.abs().max())
    assert max_diff(got.prompt_logits, want.prompt_logits) < 0.05 * scale
    assert got.tokens == same.tokens


@pytest.mark.gpu
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tp_and_pp_on_gpus_equal_one_gpu(model_dirs, tp, pp):
    """Ranks on cuda:0, cuda:1 (nccl), or all on cuda:0 (gloo through host)."""
    model_dir = model_dirs("parallel")
    prompt = prompt_tokens(70, seed=23)
    one = load_engine(model_dir, dtype="float64", page_size=16, device="cuda:0")
    want = one.generate([Request(prompt, SamplingParams(12))])[0].tokens
    options = {"dtype": "float64", "page_size": 16, "device": "cuda:0", "timeout_s": 240}
    with ParallelEngine(model_dir, tp=tp, pp=pp, **options) as group:
        assert group.generate([Request(prompt, SamplingParams(12))])[0].tokens == want


@pytest.mark.gpu
def test_gpu_pool_pages_through_gpu_and_pinned_staging_are_identical(model_dirs):
    """The PD hand-off from a GPU prefill: its pages exported into a GPU arena
    (the kernel) and into a pinned host arena (kernel, then bounce) are the
    same bytes; imported into a CPU and a GPU decode engine they continue
    prompt + first token without recomputing the prompt, equal to one run."""
    model_dir = model_dirs("llama-gqa")
    prompt = prompt_tokens(75, seed=24)  # 4 full pages of 16 and a partial one
    whole = load_engine(model_dir, dtype="float64", page_size=16, device="cuda:0")
    want = whole.generate([Request(prompt, SamplingParams(10))])[0].tokens
    prefill = load_engine(model_dir, dtype="float64", page_size=16, device="cuda:0")
    first = prefill.generate([Request(prompt, SamplingParams(1))])[0].tokens
    rows = -(-len(prompt) // 16)
    on_gpu = torch.zeros(rows + 2, prefill.spec.page_bytes, dtype=torch.uint8, device="cuda:0")
    on_host = torch.zeros(rows + 2, prefill.spec.page_bytes, dtype=torch.uint8).pin_memory()
    order = list(range(rows + 1, 1, -1))  # reversed rows: row placement is honoured
    assert export_prefix(prefill, prompt, on_gpu, order) == rows
    assert export_prefix(prefill, prompt, on_host, order) == rows
    assert torch.equal(on_gpu.cpu(), on_host)
    assert on_host[:2].eq(0).all() and on_host[2:].ne(0).any()

    continuation = [Request(prompt + first, SamplingParams(9))]
    for device in ("cpu", "cuda:0"):
        decode = load_engine(model_dir, dtype="float64", page_size=16, device=device)
        assert import_prefix(decode, prompt, on_host, order) == rows
        rest = decode.generate(continuation)[0]
        assert rest.cached_tokens == len(prompt)
        assert first + rest.tokens == want
