"""Regenerate stage: the target re-answers the chat data through OpenAI-compatible servers (before tokenize).

Kept import-light (the data config imports this package's config): the stage's modules load on first use."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "regenerate_dataset": "dflash_core.regenerate.stage",
    "regenerate_fingerprint": "dflash_core.regenerate.stage",
    "count_records": "dflash_core.regenerate.stage",
    "RegenerateConfig": "dflash_core.regenerate.config",
    "RegenerateError": "dflash_core.regenerate.errors",
    "EndpointError": "dflash_core.regenerate.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_core.regenerate' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
