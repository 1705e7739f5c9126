"""Configs as the application sees them: preset names, dotted overrides, example:// resolved once, here."""

from __future__ import annotations

from importlib import resources
from typing import Any

from dflash_core import config as core_config
from dflash_core.config import PipelineConfig
from dflash_core.example import resolve_uri

PRESETS = "presets"  # package data of dflash_app: installed with the project, no source checkout needed


def preset_names() -> list[str]:
    """The names of the shipped presets (file names without .yaml)."""
    folder = resources.files(__package__).joinpath(PRESETS)
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(name_or_path: str) -> str:
    """A preset name (e.g. 'tiny-cpu') -> the installed preset file; a path or URI is returned unchanged."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return name_or_path
    preset = resources.files(__package__).joinpath(PRESETS, f"{name_or_path}.yaml")
    return str(preset) if preset.is_file() else name_or_path


def load_config(name_or_path: str, overrides: dict[str, Any] | None = None,
                labels: dict[str, str] | None = None) -> PipelineConfig:
    """A preset name or a YAML path/URI, with dotted overrides (blamed by `labels` when refused), validated."""
    return core_config.load_config(resolve_config_path(name_or_path), overrides, labels)


def resolve_config(cfg: PipelineConfig) -> PipelineConfig:
    """The config with example:// URIs replaced by the built (or cached) example assets."""
    data = cfg.data.model_copy(update={"source": resolve_uri(cfg.data.source),
                                       "tokenizer": resolve_uri(cfg.data.tokenizer)})
    model = cfg.model.model_copy(update={"target": resolve_uri(cfg.model.target)})
    evaluation = cfg.eval.model_copy(update={"data": cfg.eval.data and resolve_uri(cfg.eval.data)})
    return cfg.model_copy(update={"data": data, "model": model, "eval": evaluation})
