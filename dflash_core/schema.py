"""The base of every config section (strict pydantic models) and reading YAML configs into them."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, TypeVar

import fsspec
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from dflash_core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """A config section: unknown keys are rejected, values are validated on assignment, a number must be finite
    (YAML's .inf and .nan are no setting: `temperature: .inf` passed `ge=0`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would let the last one win silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> Any:
    """A YAML file (path or fsspec URI) as Python data; errors name the file and the line."""
    try:
        with fsspec.open(path, "r", encoding="utf-8") as fh:
            return yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a folder; --config takes a YAML file or a preset name") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file; --config takes a YAML file or a preset name") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{path}: invalid YAML: {where}{getattr(exc, 'problem', exc)}") from None


TOP_LEVEL = "<top level>"  # the key of a check across keys (a model validator)


def _key(err: Any) -> str:
    # a union's members add their own tag to the location (plan.buckets.literal['auto'], ...list[int]): not a key
    return ".".join(str(p) for p in err["loc"] if "[" not in str(p)) or TOP_LEVEL


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The config sections a field's type holds (`RegenerateConfig`, `RegenerateConfig | None`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _sections(arg)]
    return []


def _key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a config model, sections and the keys inside them."""
    paths = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        for section in _sections(field.annotation):
            paths.extend(_key_paths(section, f"{prefix}{name}."))
    return paths


def _did_you_mean(model: type[BaseModel], key: str) -> str:
    """For an unknown key: the same name in another section (`train.block_size` -> `model.block_size`), else a
    close spelling beside it (`train.lrr` -> `train.lr`), else a close spelling anywhere; '' when none is near."""
    paths = _key_paths(model)
    parent, _, leaf = key.rpartition(".")
    found = [p for p in paths if p.rpartition(".")[2] == leaf]
    if not found:
        beside = [p.rpartition(".")[2] for p in paths if p.rpartition(".")[0] == parent]
        found = [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(leaf, beside, n=3, cutoff=0.7)]
    if not found:
        found = difflib.get_close_matches(key, paths, n=3, cutoff=0.8)
    return f" (did you mean {' or '.join(repr(p) for p in found)}?)" if found else ""


def _describe(model: type[BaseModel], key: str, errs: list[Any]) -> str:
    if errs[0]["type"] == "extra_forbidden":
        return f"unknown key '{key}'{_did_you_mean(model, key)}"
    if errs[0]["type"] == "missing":
        return f"missing key '{key}'"
    said = " or ".join(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in errs))
    if key == TOP_LEVEL:  # its message names the keys
        return said
    return f"key '{key}': {said} (got {errs[0].get('input')!r})"


def validate_mapping(model: type[M], raw: Any, source: str) -> M:
    """Validate a mapping as `model`; errors name the source and every bad key (ConfigError.keys lists them)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        by_key: dict[str, list[Any]] = {}
        for err in exc.errors():
            by_key.setdefault(_key(err), []).append(err)
        problems = "; ".join(_describe(model, key, errs) for key, errs in by_key.items())
        error = ConfigError(f"{source}: {problems}")
        error.keys = list(by_key)
        raise error from None
