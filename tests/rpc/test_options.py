"""Config dataclasses as the one source of flags, environment and defaults."""

import argparse
import enum
from dataclasses import dataclass

import pytest

from kvrelay import options
from kvrelay.cache.server import CacheServerConfig
from kvrelay.control.config import ControlConfig
from kvrelay.options import option
from kvrelay.worker.config import WorkerConfig


class Mode(enum.StrEnum):
    FAST = "fast"
    SAFE = "safe"


@dataclass
class Example:
    token: str = option(help="a required one")
    rate: float = option(1.5, help="positive", positive=True)
    count: int = option(2, help="bounded", minimum=0, maximum=5)
    names: tuple[str, ...] = option((), help="comma list")
    on: bool = option(True, help="a switch")
    size: int | None = option(None, help="in GiB", flag="--size-gb", scale=1 << 30)
    mode: Mode = option(Mode.SAFE, help="an enum: its values are the choices")  # noqa: RUF009


def parse(argv, env=None):
    parser = argparse.ArgumentParser()
    options.add_arguments(parser, Example)
    return options.from_args(Example, parser.parse_args(argv), env=env or {})


def test_flag_then_environment_then_default():
    assert parse(["--token", "t"]) == Example("t")
    got = parse(["--token", "t", "--names", "a, b", "--no-on", "--size-gb", "0.5"])
    assert got == Example("t", names=("a", "b"), on=False, size=1 << 29)
    env = {"KVRELAY_TOKEN": "e", "KVRELAY_RATE": "3", "KVRELAY_ON": "false",
           "KVRELAY_NAMES": "x,y", "KVRELAY_SIZE": "2"}  # fmt: skip
    assert parse([], env) == Example("e", 3.0, names=("x", "y"), on=False, size=2 << 30)
    assert parse(["--rate", "4"], env).rate == 4.0  # the flag wins
    assert parse(["--token", "t", "--mode", "fast"]).mode is Mode.FAST
    assert parse(["--token", "t"], {"KVRELAY_MODE": "fast"}).mode is Mode.FAST


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [([], {}, "give --token or set KVRELAY_TOKEN"),
     (["--token", "t", "--rate", "0"], {}, "--rate must be > 0"),
     (["--token", "t", "--count", "6"], {}, "--count must be <= 5"),
     (["--token", "t"], {"KVRELAY_COUNT": "many"}, "--count / KVRELAY_COUNT"),
     (["--token", "t"], {"KVRELAY_ON": "maybe"}, "not a boolean"),
     (["--token", "t"], {"KVRELAY_MODE": "reckless"}, "--mode / KVRELAY_MODE")],
)  # fmt: skip
def test_bad_values_name_the_flag_and_the_variable(argv, env, message):
    with pytest.raises(SystemExit, match=message):
        parse(argv, env)


def test_every_process_config_has_help_for_every_field():
    """No field without a flag: the CLI is the dataclass, nothing restated."""
    for cls in (ControlConfig, WorkerConfig, CacheServerConfig):
        parser = argparse.ArgumentParser()
        options.add_arguments(parser, cls)
        flags = {a.dest for a in parser._actions if a.dest != "help"}
        assert flags == set(cls.__dataclass_fields__), cls


def test_worker_prefill_bounds_default_to_the_engines():
    """The flags restate two engine defaults (the CLI must not load torch to
    read them): they must not drift apart."""
    from kvrelay.model.engine import DEFAULT_MAX_PREFILL_TOKENS
    from kvrelay.model.paged_attention import DEFAULT_CHUNK_TOKENS

    config = WorkerConfig(model_dir="m", token="t")
    assert config.max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS
    assert config.attention_chunk_tokens == DEFAULT_CHUNK_TOKENS
