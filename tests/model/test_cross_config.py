"""`kvrelay generate --cp` and `--reuse-prefix K --prefix-parallel tp=T,pp=P,cp=C`:
a prefix computed under one parallel config, exported as unified pages and
imported by another, gives the plain run's tokens."""

import argparse
import json

import pytest

from kvrelay.cli import build_parser, main
from kvrelay.layout import ParallelConfig
from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.commands import run_generate
from kvrelay.model.cross_config import parse_parallel
from tests.support.models import prompt_tokens

PAGE = 16
PROMPT = 50
PREFIX = 35  # two full pages and a partial third


@pytest.fixture(scope="module")
def plain(model_dirs):
    model_dir = model_dirs("parallel")
    prompt = prompt_tokens(PROMPT, seed=41)
    engine = load_engine(model_dir, dtype="float64", page_size=PAGE)
    want = engine.generate([Request(prompt, SamplingParams(10))])[0].tokens
    assert len(set(want)) >= 5
    return model_dir, prompt, want


def generate_args(model_dir, prompt, *extra):
    args = ["generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt))]
    args += ["--max-new-tokens", "10", "--dtype", "float64", "--page-size", str(PAGE), "--json"]
    return build_parser().parse_args([*args, *extra])


@pytest.mark.parametrize(
    ("run", "prefix"),
    [(["--cp", "2"], "tp=2,pp=1,cp=1"), ([], "cp=2")],
    ids=["cp2-reads-tp2", "cp1-reads-cp2"],
)
def test_a_prefix_from_another_config_gives_the_plain_tokens(plain, capsys, run, prefix):
    model_dir, prompt, want = plain
    args = generate_args(model_dir, prompt, *run, "--reuse-prefix", str(PREFIX))
    args.prefix_parallel = parse_parallel(prefix)
    out = run_generate(args)
    assert out["tokens"] == want
    assert out["cached_tokens"] == PREFIX  # the imported pages, partial page included
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line) for line in lines] == [{"tokens": want}]


def test_parse_parallel():
    assert parse_parallel("tp=2,pp=1,cp=4") == ParallelConfig(tp=2, pp=1, cp=4)
    assert parse_parallel("cp=2") == ParallelConfig(cp=2)
    for bad in ("tp=2,tp=2", "xp=2", "tp=two", "cp=0", "tp=-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_parallel(bad)


def test_bad_parallel_options_are_refused(plain, capsys):
    model_dir, prompt, _ = plain
    ids = ",".join(map(str, prompt))
    base = ["generate", "--model", str(model_dir), "--prompt-ids", ids]
    with pytest.raises(SystemExit, match="needs --reuse-prefix"):
        main([*base, "--prefix-parallel", "cp=2"])
    with pytest.raises(SystemExit, match="cp must be a positive int"):
        main([*base, "--cp", "0"])
    with pytest.raises(SystemExit):
        main([*base, "--reuse-prefix", "3", "--prefix-parallel", "cp=2,xp=1"])
    assert "tp=T,pp=P,cp=C" in capsys.readouterr().err
