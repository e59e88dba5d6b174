"""`kvrelay make-model`, `kvrelay generate` and `kvrelay bench model`."""

import json
import subprocess
import sys

import pytest

from kvrelay.cli import main
from kvrelay.model import Request, SamplingParams, load_engine
from tests.support.models import prompt_tokens

MAKE = ["--arch", "qwen2", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"]


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli") / "qwen"
    main(["make-model", *MAKE, "--vocab", "300", "--seed", "3", "--std", "0.2", str(directory)])
    return directory


def test_make_model_writes_an_hf_directory(cli_model):
    assert (cli_model / "config.json").is_file() and (cli_model / "model.safetensors").is_file()
    config = json.loads((cli_model / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] == 300
    assert config["num_key_value_heads"] == 2


def generate(capsys, *args):
    main(["generate", *args, "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_generate_prints_the_engines_tokens(cli_model, capsys):
    prompt = prompt_tokens(40, vocab=300, seed=1)
    ids = ",".join(map(str, prompt))
    out = generate(
        capsys,
        "--model",
        str(cli_model),
        "--prompt-ids",
        ids,
        "--max-new-tokens",
        "12",
        "--dtype",
        "float64",
        "--page-size",
        "16",
    )
    engine = load_engine(cli_model, dtype="float64", page_size=16)
    want = engine.generate([Request(prompt, SamplingParams(12))])[0].tokens
    assert out == {"tokens": want}
    reused = generate(
        capsys,
        "--model",
        str(cli_model),
        "--prompt-ids",
        ids,
        "--max-new-tokens",
        "12",
        "--dtype",
        "float64",
        "--page-size",
        "16",
        "--reuse-prefix",
        "35",
    )
    assert reused == {"tokens": want}


def test_generate_under_tp_and_pp_in_a_fresh_process(cli_model):
    prompt = prompt_tokens(20, vocab=300, seed=2)
    args = [
        "--model",
        str(cli_model),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-new-tokens",
        "8",
        "--dtype",
        "float64",
        "--page-size",
        "16",
    ]
    command = [sys.executable, "-m", "kvrelay.cli", "generate", *args, "--json"]
    # Both at once: each is a fresh process importing torch (the parallel one
    # spawns 4 ranks); one after the other only added the waits.
    runs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in (command, [*command, "--tp", "2", "--pp", "2", "--reuse-prefix", "17"])
    ]
    try:
        single, parallel = [run.communicate(timeout=300) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait(10)
    assert [run.returncode for run in runs] == [0, 0], single[1][-2000:] + parallel[1][-2000:]
    assert parallel[0].count("\n") == 1
    assert json.loads(parallel[0]) == json.loads(single[0])
    assert len(json.loads(single[0])["tokens"]) == 8


def test_generate_reads_long_prompts_from_a_file(cli_model, tmp_path, capsys):
    """Ids from a file (@path or --prompt-ids-file; commas, whitespace or a JSON
    list), chunked prefill on: the engine's tokens."""
    prompt = prompt_tokens(300, vocab=300, seed=4)
    (tmp_path / "ids.txt").write_text("\n".join(map(str, prompt)))
    (tmp_path / "ids.json").write_text(json.dumps(prompt))
    common = ["--model", str(cli_model), "--max-new-tokens", "6", "--dtype", "float64"]
    common += ["--page-size", "16", "--max-prefill-tokens", "64"]
    engine = load_engine(cli_model, dtype="float64", page_size=16, num_pages=64)
    want = {"tokens": engine.generate([Request(prompt, SamplingParams(6))])[0].tokens}
    assert generate(capsys, *common, "--prompt-ids", f"@{tmp_path / 'ids.txt'}") == want
    assert generate(capsys, *common, "--prompt-ids-file", str(tmp_path / "ids.json")) == want
    with pytest.raises(SystemExit):
        main(["generate", *common, "--prompt-ids", f"@{tmp_path / 'missing'}"])
    assert "cannot read token ids" in capsys.readouterr().err


def test_generate_with_a_bad_model_dir_says_so(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["generate", "--model", str(tmp_path / "none"), "--prompt-ids", "1,2"])


def test_generate_with_out_of_vocab_ids_says_so(cli_model):
    with pytest.raises(SystemExit, match=r"prompt token ids must lie in \[0, 300\)"):
        main(["generate", "--model", str(cli_model), "--prompt-ids", "1,300"])


def test_bench_model_reports_ratios_to_hf(tmp_path, capsys):
    out = tmp_path / "model.json"
    main(
        [
            "bench",
            "model",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--intermediate",
            "128",
            "--vocab",
            "256",
            "--contexts",
            "64,160",
            "--decode-tokens",
            "3",
            "--page-size",
            "16",
            "--runs",
            "2",
            "--json",
            str(out),
        ]
    )
    table = capsys.readouterr().out
    assert "x HF" in table and "90% hit" in table
    data = json.loads(out.read_text())
    assert data["benchmark"] == "model"
    assert [r["context"] for r in data["results"]] == [64, 160]
    for result in data["results"]:
        # 90 % of the prompt, rounded down to full pages.
        assert result["cached_tokens"] == int(result["context"] * 0.9) // 16 * 16
        for key in ("prefill_vs_hf", "decode_vs_hf", "hit_saved_fraction", "prefill_tok_s"):
            summary = result[key]
            assert len(summary["runs"]) == 2
            assert summary["min"] <= summary["median"] <= summary["max"]
        assert result["prefill_tok_s"]["median"] > 0
