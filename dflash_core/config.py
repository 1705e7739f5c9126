"""The pipeline config: one YAML file -> typed sections (data, plan, model, train, check, wandb, storage, eval)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
import yaml
from pydantic import Field, ValidationError

from dflash_core.data.config import DataConfig
from dflash_core.model.config import ModelConfig
from dflash_core.monitor.config import CheckConfig, WandbConfig
from dflash_core.plan.config import PlanConfig
from dflash_core.promotion.config import EvalConfig
from dflash_core.runtime.config import TrainConfig
from dflash_core.schema import StrictModel

REPO_ROOT = Path(__file__).resolve().parent.parent
PRESETS_DIR = REPO_ROOT / "infra" / "configs"


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


class StorageConfig(StrictModel):
    """Where the flow keeps stage outputs: a local path or any fsspec URI."""

    root: str = "./runs"


class PipelineConfig(StrictModel):
    """Every section of a retraining run; the Prefect flow takes this model as its parameter."""

    data: DataConfig
    plan: PlanConfig = Field(default_factory=PlanConfig)
    model: ModelConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    check: CheckConfig = Field(default_factory=CheckConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "<top level>"
    if err["type"] == "extra_forbidden":
        return f"unknown key '{key}'"
    if err["type"] == "missing":
        return f"missing key '{key}'"
    return f"key '{key}': {err['msg']} (got {err.get('input')!r})"


def parse_config(raw: Any, source: str = "<config>") -> PipelineConfig:
    """Validate a mapping as a PipelineConfig; errors name the source and every bad key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(_describe(e) for e in exc.errors())
        raise ConfigError(f"{source}: {problems}") from None


def resolve_config_path(path: str) -> str:
    """A preset name (e.g. 'tiny-cpu') or a path/URI to a YAML file."""
    preset = PRESETS_DIR / f"{path}.yaml"
    return str(preset) if "/" not in path and not path.endswith((".yaml", ".yml")) and preset.exists() else path


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would let the last one win silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read a YAML config (path, fsspec URI or preset name), apply dotted overrides, validate."""
    path = resolve_config_path(path)
    try:
        with fsspec.open(path, "r", encoding="utf-8") as fh:
            raw = yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
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
    raw = raw if raw is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections, got {type(raw).__name__}")
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value)
    try:
        return parse_config(raw, path)
    except ConfigError as exc:
        raise _blame_overrides(exc, path, overrides or {}) from None


def _blame_overrides(exc: ConfigError, path: str, overrides: dict[str, Any]) -> ConfigError:
    """A bad value that came from --set is reported as --set's, not as the config file's."""
    message = str(exc)
    culprits = [key for key in overrides if f"'{key}'" in message]
    if not culprits:
        return exc
    return ConfigError(message.replace(f"{path}: ", f"--set {', '.join(culprits)} (over {path}): ", 1))


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            where = ".".join(parents[: depth + 1])
            raise ConfigError(f"--set {dotted}: '{where}' is a value ({type(node).__name__}), not a section; "
                              "set it directly, e.g. --set " + f"{where}=...")
    node[leaf] = value


def dump_config(cfg: PipelineConfig, path: str) -> None:
    """Write a config back as YAML (the run folder keeps the exact config it ran with)."""
    with fsspec.open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.model_dump(mode="json"), fh, sort_keys=False)
