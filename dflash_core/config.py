"""The pipeline config: one YAML file -> typed sections (data, plan, model, train, check, wandb, storage, eval).

Preset names (`tiny-cpu`) are the application's business (dflash_app.config); this module reads files.
"""

from __future__ import annotations

from typing import Any

import fsspec
import yaml
from pydantic import Field

from dflash_core.data.config import DataConfig
from dflash_core.errors import ConfigError
from dflash_core.io import join_uri
from dflash_core.model.config import ModelConfig
from dflash_core.monitor.config import CheckConfig, WandbConfig
from dflash_core.plan.config import PlanConfig
from dflash_core.promotion.config import EvalConfig
from dflash_core.runtime.config import TrainConfig
from dflash_core.schema import StrictModel, read_yaml, validate_mapping

__all__ = ["ConfigError", "PipelineConfig", "StorageConfig", "dump_config", "load_config", "parse_config",
           "write_run_config"]


class StorageConfig(StrictModel):
    """Where the flow keeps stage outputs: a local path or any fsspec URI."""

    root: str = Field("./runs", description="folder (path or fsspec URI) under which the flow writes regenerated/, "
                      "tokenized/, plans/, runs/ and promoted/")


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


def parse_config(raw: Any, source: str = "<config>") -> PipelineConfig:
    """Validate a mapping as a PipelineConfig; errors name the source and every bad key."""
    return validate_mapping(PipelineConfig, raw, source)


def load_config(path: str, overrides: dict[str, Any] | None = None,
                labels: dict[str, str] | None = None) -> PipelineConfig:
    """Read a YAML config (path or fsspec URI), apply dotted overrides, validate. A bad override is blamed on
    its label (how the user gave it: a command-line flag; `--set KEY` by default), not on the file."""
    raw = read_yaml(path)
    raw = raw if raw is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections, got {type(raw).__name__}")
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value)
    try:
        return parse_config(raw, path)
    except ConfigError as exc:
        raise _blame_overrides(exc, path, overrides or {}, labels or {}) from None


def _blame_overrides(exc: ConfigError, path: str, overrides: dict[str, Any], labels: dict[str, str]) -> ConfigError:
    """A bad value that came from an override is reported as the override's, not as the config file's: a key at
    fault is the override's when it is that key, lies under it, or is the unknown section or key it names."""
    culprits = [key for key in overrides
                if any(bad == key or bad.startswith(f"{key}.") or key.startswith(f"{bad}.") for bad in exc.keys)]
    if not culprits:
        return exc
    named = ", ".join(labels.get(key, f"--set {key}") for key in culprits)
    return ConfigError(str(exc).replace(f"{path}: ", f"{named} (over {path}): ", 1))


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


def write_run_config(cfg: PipelineConfig, out: str) -> str:
    """Write `<out>/config.yaml`, the file the training workers read (URIs must be resolved); its path."""
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    path = join_uri(out, "config.yaml")
    dump_config(cfg, path)
    return path
