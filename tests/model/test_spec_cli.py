"""`make-model --mtp 1 [--mtp-fit-steps]`, `generate --speculative K --json`
(with `--prefix-parallel`: target and draft pages from another config) and
`bench spec`."""

import json

import pytest

from kvrelay.cli import main
from kvrelay.model import Request, SamplingParams, load_engine
from tests.support.models import prompt_tokens

MAKE = ["--arch", "llama", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2"]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spec-cli") / "llama-mtp"
    main(["make-model", *MAKE, "--vocab", "128", "--std", "0.2", "--mtp", "1", str(directory)])
    return directory


def generate(capsys, *args):
    main(["generate", *args, "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


@pytest.mark.cluster  # starts rank or CLI processes
def test_generate_speculative_json_and_reuse_across_configs(mtp_model, capsys):
    ids = ",".join(map(str, prompt_tokens(37, vocab=128, seed=2)))
    common = ["--model", str(mtp_model), "--prompt-ids", ids, "--max-new-tokens", "12",
              "--dtype", "float64", "--page-size", "16"]  # fmt: skip
    plain = generate(capsys, *common)
    assert "spec" not in plain
    spec = generate(capsys, *common, "--speculative", "2")
    assert spec["tokens"] == plain["tokens"]
    assert set(spec["spec"]) == {"proposed", "accepted", "steps"}
    carried = generate(capsys, *common, "--speculative", "2", "--reuse-prefix", "33",
                       "--prefix-parallel", "tp=2,pp=1")  # fmt: skip
    assert carried == spec
    # CP=2 prefill, then speculation; and a prefix (target and draft) written at CP=2.
    assert generate(capsys, *common, "--speculative", "2", "--cp", "2") == spec
    carried = generate(capsys, *common, "--speculative", "2", "--reuse-prefix", "33",
                       "--prefix-parallel", "cp=2")  # fmt: skip
    assert carried == spec


def test_speculation_needs_an_mtp_layer(tmp_path, capsys):
    plain = tmp_path / "plain"
    main(["make-model", *MAKE, "--vocab", "128", str(plain)])
    with pytest.raises(SystemExit, match="MTP layer"):
        main(["generate", "--model", str(plain), "--prompt-ids", "1,2,3", "--speculative", "1"])
    with pytest.raises(SystemExit, match="--mtp 1"):
        main(["make-model", *MAKE, "--vocab", "128", "--mtp-fit-steps", "5", str(tmp_path / "x")])


def test_copied_mtp_layer_agrees_with_a_one_layer_target_on_new_prompts(tmp_path, capsys):
    directory = tmp_path / "copy"
    one_layer = [*MAKE[:2], "--layers", "1", *MAKE[4:], "--vocab", "128", "--std", "0.2"]
    main(["make-model", *one_layer, "--mtp", "1", "--mtp-init", "copy", str(directory)])
    engine = load_engine(directory, dtype="float32", page_size=16, num_pages=32, speculative=1)
    prompts = [prompt_tokens(24, vocab=128, seed=s) for s in (5, 6)]
    results = engine.generate([Request(p, SamplingParams(24)) for p in prompts])
    accepted = sum(r.spec["accepted"] for r in results)
    proposed = sum(r.spec["proposed"] for r in results)
    assert accepted >= 0.5 * proposed  # a random MTP layer accepts a few percent


def test_mtp_fit_raises_agreement_on_its_fitting_data(tmp_path, capsys):
    main(["make-model", *MAKE, "--vocab", "64", "--mtp", "1", "--mtp-fit-steps", "30",
          str(tmp_path / "fit")])  # fmt: skip
    line = capsys.readouterr().out.strip().splitlines()[-1]
    before, after = (
        float(x.rstrip("%")) for x in line.split("target ")[1].split(" (")[0].split(" -> ")
    )
    assert after > before


@pytest.mark.cluster  # starts rank or CLI processes
def test_bench_spec_prints_both_halves(tmp_path, capsys):
    out = tmp_path / "spec.json"
    main(["bench", "spec", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
          "--vocab", "128", "--k", "1,2", "--prompt-tokens", "20", "--decode-tokens", "6",
          "--batch", "1", "--runs", "1", "--page-size", "16", "--cp-prompt-tokens", "40",
          "--json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "acceptance" in printed and "x CP=1" in printed
    result = json.loads(out.read_text())
    assert set(result["speculation"]) == {"0", "1", "2"}
    assert result["speculation"]["2"]["proposed"] > 0
    assert set(result["cp_prefill"]["cp"]) == {"1", "2"}
