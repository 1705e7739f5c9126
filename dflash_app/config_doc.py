"""The configuration reference: every key of the pipeline config with its type, default and meaning, generated from
the pydantic models (the same descriptions the Prefect UI shows on a deployment's run form).

`python -m dflash_app.config_doc --write README.md` rewrites the README's block between the two markers;
`--check README.md` exits 1 when it is stale (tests/test_config_doc.py runs the check).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from dflash_core.config import PipelineConfig

START = "<!-- config-reference:start (python -m dflash_app.config_doc --write README.md) -->"
END = "<!-- config-reference:end -->"
BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
          (annotated_types.Le, "le", "<="))


def reference(model: type[BaseModel] = PipelineConfig) -> str:
    """The Markdown reference: one table per section (nested sections after their parent)."""
    parts: list[str] = []
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            parts.append(_table(name, section))
    return "\n\n".join(parts)


def _table(key: str, model: type[BaseModel]) -> str:
    lead = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ").removeprefix(f"`{key}`: ")
    rows = [f"**`{key}`**: {lead}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested: list[str] = []
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            nested.append(_table(f"{key}.{name}", section))
            continue
        rows.append(f"| `{key}.{name}` | {_cell(type_text(field.annotation, field.metadata))} | "
                    f"{_cell(default_text(field))} | {_cell(field.description or '')} |")
    return "\n\n".join(["\n".join(rows), *nested])


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def type_text(annotation: Any, metadata: list[Any] | tuple[Any, ...] = ()) -> str:
    """A type as a user writes its value: `auto | keep | merge`, `int > 0`, `list of str`, `float or null`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0], args[1:])
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        text = " | ".join(type_text(a, metadata) for a in options)  # a Field's bounds hold for the value
        return f"{text} or null" if len(options) < len(args) else text
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is tuple:
        return f"[{', '.join(type_text(a) for a in args)}]"
    if origin is dict:
        return f"mapping {type_text(args[0])} -> {type_text(args[1])}"
    name = getattr(annotation, "__name__", str(annotation))
    bounds = [f"{sign} {getattr(m, attr)}" for m in metadata for kind, attr, sign in BOUNDS if isinstance(m, kind)]
    return " ".join([name, ", ".join(bounds)]) if bounds else name


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it; `required` when there is none."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def with_reference(readme: str) -> str:
    """The README with its reference block regenerated."""
    try:
        head, rest = readme.split(START, 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise SystemExit(f"the README has no block between {START!r} and {END!r}") from None
    return f"{head}{START}\n{reference()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_app.config_doc", description=__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--write", metavar="README", help="rewrite the reference block in this file")
    which.add_argument("--check", metavar="README", help="exit 1 when the reference block in this file is stale")
    args = parser.parse_args(argv)
    path = Path(args.write or args.check)
    text = path.read_text(encoding="utf-8")
    fresh = with_reference(text)
    if args.write:
        path.write_text(fresh, encoding="utf-8")
        return 0
    if fresh != text:
        print(f"{path}: the configuration reference is stale; run python -m dflash_app.config_doc --write {path}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
