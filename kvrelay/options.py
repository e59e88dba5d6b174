"""One source for a process's settings: its config dataclass.

Each field carries its default and its help (`option(...)`); the command
line is generated from the fields (`add_arguments`), and so are the
environment variables (`KVRELAY_<FIELD>`, e.g. `KVRELAY_TOKEN`): a value
given on the command line wins, then the environment, then the default.
Nothing else restates a default.

Field types understood: int, float, str, bool (`--x/--no-x`), `str | None`,
a `StrEnum` (its values are the choices), and `tuple[str, ...]`
(comma-separated on the command line and in the environment). Metadata:
`flag` (another option name), `scale` (the command line takes the value in
larger units, e.g. GiB, and the field holds it times `scale`), `choices`,
`minimum`/`maximum` (inclusive bounds), `positive`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from typing import Any

ENV_PREFIX = "KVRELAY_"
_UNSET = object()


def option(default: Any = dataclasses.MISSING, *, help: str, **meta) -> Any:
    """A config field: its default (omit for a required one), its help, and
    `flag`, `scale`, `choices`, `minimum`, `maximum`, `positive` as above."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def _kind(cls, field: dataclasses.Field):
    hint = typing.get_type_hints(cls)[field.name]
    args = typing.get_args(hint)
    if hint in (int, float, str, bool) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return hint
    if typing.get_origin(hint) is tuple:
        return tuple
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0]
    raise TypeError(f"{cls.__name__}.{field.name}: no command line for {hint!r}")


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def env_of(field: dataclasses.Field) -> str:
    return ENV_PREFIX + field.name.upper()


def add_arguments(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One option per field of `cls` (all default to "not given", so
    `from_args` can tell a flag from the environment and the default)."""
    for field in dataclasses.fields(cls):
        if field.name in skip or "help" not in field.metadata:
            continue
        kind = _kind(cls, field)
        shown = "required" if field.default is dataclasses.MISSING else f"default {field.default!r}"
        if field.metadata.get("scale"):
            shown = "required" if shown == "required" else "see help"
        text = f"{field.metadata['help']} ({shown}; ${env_of(field)})"
        kwargs: dict[str, Any] = {"default": _UNSET, "help": text, "dest": field.name}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = (
                str if kind is tuple else (float if field.metadata.get("scale") else kind)
            )
            if field.metadata.get("choices"):
                kwargs["choices"] = field.metadata["choices"]
            elif issubclass(kind, enum.Enum):
                kwargs["choices"] = list(kind)
        parser.add_argument(flag_of(field), **kwargs)


def _parse(kind, text: str, name: str):
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: not a boolean: {text!r}")
    if kind is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return kind(text)


def from_args(cls, args: argparse.Namespace | None = None, env=None, **overrides):
    """An instance of `cls`: each field from `overrides`, the command line,
    the environment or its default, in that order. Raises SystemExit naming
    the flag and the variable for a missing or invalid value."""
    env = os.environ if env is None else env
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in overrides:
            values[field.name] = overrides[field.name]
            continue
        kind = _kind(cls, field) if "help" in field.metadata else None
        given = getattr(args, field.name, _UNSET) if args is not None else _UNSET
        try:
            if given is not _UNSET and given is not None:
                value = _parse(kind, given, field.name) if kind is tuple else given
            elif kind is not None and env.get(env_of(field)) is not None:
                value = _parse(kind, env[env_of(field)], env_of(field))
                if field.metadata.get("scale"):
                    value = float(value)
            else:
                continue  # the dataclass default
        except ValueError as exc:
            raise SystemExit(f"{flag_of(field)} / {env_of(field)}: {exc}") from None
        if field.metadata.get("scale") and value is not None:
            value = int(value * field.metadata["scale"])
        values[field.name] = value
    for field in dataclasses.fields(cls):
        missing = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        if missing and field.name not in values:
            raise SystemExit(f"give {flag_of(field)} or set {env_of(field)}")
        _check_range(field, values.get(field.name, field.default))
    return cls(**values)


def _check_range(field: dataclasses.Field, value) -> None:
    if value is None or isinstance(value, str | tuple):
        return
    meta, flag = field.metadata, flag_of(field)
    if meta.get("positive") and not value > 0:
        raise SystemExit(f"{flag} must be > 0, got {value}")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise SystemExit(f"{flag} must be >= {meta['minimum']}, got {value}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise SystemExit(f"{flag} must be <= {meta['maximum']}, got {value}")
