"""Tokenize stage: chat data -> token shards with assistant-only loss masks; readers of the shards.

Kept import-light (the config imports this package): the stage's modules load on first use."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "tokenize_dataset": "dflash_core.data.tokenize",
    "input_fingerprint": "dflash_core.data.fingerprint",
    "read_index": "dflash_core.data.shards",
    "read_manifest": "dflash_core.data.shards",
    "ShardReader": "dflash_core.data.shards",
    "ShardError": "dflash_core.data.shards",
    "DataError": "dflash_core.data.errors",
    "BadInputError": "dflash_core.data.errors",
    "TemplateError": "dflash_core.data.errors",
    "Conversation": "dflash_core.data.formats",
    "to_conversation": "dflash_core.data.formats",
    "chat_template_inputs": "dflash_core.data.template",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_core.data' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
