"""The message tables of `docs/serving-protocol.md`, generated from the types.

`python -m kvrelay.rpc.schema` rewrites the generated block of the doc in
place; `tests/rpc/test_schema.py` fails when the doc and the types differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
from msgspec import inspect as mi

from kvrelay.rpc import agent_ops, cache_ops, handoff_ops, messages, worker_ops

BEGIN = "<!-- BEGIN GENERATED from kvrelay.rpc (python -m kvrelay.rpc.schema) -->"
END = "<!-- END GENERATED -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "serving-protocol.md"

SECTIONS = (
    ("Every service", messages, (messages.Hello, messages.Error, messages.Ok)),
    ("Control <-> workers", worker_ops, None),
    ("Clients <-> cache servers", cache_ops, None),
    ("Transfer agent <-> agent", agent_ops, None),
    ("vLLM decode <-> vLLM prefill (P/D handoff)", handoff_ops, None),
)


def _bounds(t) -> str:
    parts = [f"{name} {getattr(t, name)}" for name in ("ge", "gt", "le", "lt")
             if getattr(t, name, None) is not None]  # fmt: skip
    lo, hi = getattr(t, "min_length", None), getattr(t, "max_length", None)
    if lo is not None and lo == hi:
        parts.append(f"length {lo}")
    else:
        parts += [f"length >= {lo}"] * (lo is not None) + [f"length <= {hi}"] * (hi is not None)
    return f" ({', '.join(parts)})" if parts else ""


def type_name(t) -> str:
    simple = {
        mi.IntType: "int",
        mi.FloatType: "float",
        mi.StrType: "str",
        mi.BytesType: "bytes",
        mi.BoolType: "bool",
        mi.NoneType: "null",
        mi.AnyType: "any",
    }
    for cls, name in simple.items():  # fmt: skip
        if isinstance(t, cls):
            return name + _bounds(t)
    if isinstance(t, mi.ListType):
        return f"[{type_name(t.item_type)}]{_bounds(t)}"
    if isinstance(t, mi.TupleType):
        return "(" + ", ".join(type_name(i) for i in t.item_types) + ")"
    if isinstance(t, mi.DictType):
        return f"{{{type_name(t.key_type)}: {type_name(t.value_type)}}}"
    if isinstance(t, mi.UnionType):
        return " | ".join(type_name(i) for i in t.types)
    if isinstance(t, mi.LiteralType):
        return " | ".join(f'"{v}"' for v in t.values)
    if isinstance(t, mi.EnumType):
        return " | ".join(f'"{m.value}"' for m in t.cls)
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    raise TypeError(f"no name for {t!r}")


def _default(field: mi.Field) -> str:
    if field.required:
        return ""
    factory = field.default_factory
    if isinstance(factory, type) and issubclass(factory, msgspec.Struct):
        return f" = {factory.__name__}()"
    value = field.default if field.default is not msgspec.NODEFAULT else factory()
    return f" = {msgspec.json.encode(value).decode()}"


def describe(cls) -> str:
    info = mi.type_info(cls)
    fields = ", ".join(f"{f.encode_name}: {type_name(f.type)}{_default(f)}" for f in info.fields)
    tag = f'op "{info.tag}"' if info.tag is not None else "map"
    if info.array_like:
        tag = "array"
    return f"- `{cls.__name__}` ({tag}): {{{fields}}}"


def _structs(module) -> list[type]:
    found = [v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, msgspec.Struct)
             and v.__module__ == module.__name__ and v is not messages.Message]  # fmt: skip
    return found


def generate() -> str:
    lines = [BEGIN, "", f"Wire version {messages.WIRE_VERSION}.", ""]
    for title, module, types in SECTIONS:
        lines += [f"#### {title} (`{module.__name__}`)", ""]
        lines += [describe(t) for t in (types or _structs(module))]
        lines.append("")
    return "\n".join([*lines, END])


def replace_block(text: str, block: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def main() -> int:
    text = DOC.read_text()
    DOC.write_text(replace_block(text, generate()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
