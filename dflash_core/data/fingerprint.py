"""Content fingerprint of a tokenize run: input bytes + tokenizer files + the parameters that shape the output."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import fsspec

from dflash_core.data.config import DataConfig
from dflash_core.data.sources import SourceFile, list_files

VERSION = "dflash-tokenized-v18"  # bump when the output format, the masking rules or the records read change
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
    "vocab.txt", "spiece.model",
)
# transformers saves a tokenizer's named chat templates beside the default one here (<name>.jinja); apply_chat_template
# renders a record with tools by the one named "tool_use" when there is one
TEMPLATES_DIR = "additional_chat_templates"
_CHUNK = 1 << 20


def output_params(cfg: DataConfig, block_size: int) -> dict[str, Any]:
    """The settings that change the output bytes (not paths, batch size or process count)."""
    keep = ("format", "messages_key", "role_map", "max_length", "overlong", "max_bad_fraction",
            "rows_per_part", "rows_per_group", "max_examples", "thinking", "system_turn", "same_role_turns")
    return {**cfg.model_dump(mode="json", include=set(keep)), "block_size": block_size}


def files_digest(files: list[SourceFile]) -> str:
    """sha256 over every input file's relative name and bytes, in input order (streamed); for a file on an object
    store that keeps a content checksum (sources.stored_checksum), over that instead of its bytes: a nightly
    fingerprint of a large bucket then downloads nothing."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.size}\0".encode())
        if f.checksum:
            h.update(f"\0stored {f.checksum}\0".encode())
            continue
        with fsspec.open(f.uri, "rb") as fh:
            while block := fh.read(_CHUNK):
                h.update(block)
    return h.hexdigest()


def tokenizer_digest(path: str, tokenizer: Any | None = None) -> str:
    """sha256 over the tokenizer's files when `path` is a local folder (its named chat templates too), else over the
    loaded tokenizer."""
    h = hashlib.sha256()
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))] if os.path.isdir(path) else []
    if names:
        for name in names + named_templates(path):
            with open(os.path.join(path, name), "rb") as fh:
                h.update(f"{name}\0".encode() + fh.read())
        h.update(f"model_type\0{_model_type(path)}".encode())
        return h.hexdigest()
    if tokenizer is None:
        from dflash_core.data.template import load_tokenizer

        tokenizer = load_tokenizer(path)
    state = [tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template, tokenizer.special_tokens_map,
             type(tokenizer).__name__]
    h.update(json.dumps(state, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _model_type(folder: str) -> str | None:
    """config.json's model_type beside a tokenizer: a tokenizer_config.json naming the generic TokenizersBackend
    (what transformers 5 saves) is loaded as the model type's own tokenizer class, which may tokenize otherwise
    (Qwen2Tokenizer splits digits), so the same tokenizer files beside another config are another tokenizer."""
    try:
        with open(os.path.join(folder, "config.json"), "rb") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


_SAMPLE = 1 << 20  # bytes of each end of a weight file a model digest reads


def named_templates(folder: str) -> list[str]:
    """The named chat templates a local tokenizer folder keeps (TEMPLATES_DIR/<name>.jinja), relative, sorted."""
    found = os.path.join(folder, TEMPLATES_DIR)
    return sorted(f"{TEMPLATES_DIR}/{e.name}" for e in os.scandir(found) if e.is_file()) if os.path.isdir(found) else []


def model_digest(target: str | None) -> str | None:
    """What tells a model's weights apart without reading them all (a nightly fingerprint of a 16-140 GB
    target): for a local folder, sha256 over each top-level file's name and size (and its named chat templates'),
    the whole of the small ones (config, tokenizer, index) and the first and last MiB of the large ones (a
    safetensors header names and places every tensor; a fine-tune changes the bytes at both ends); for a hub id,
    the commit of its snapshot in the local Hugging Face cache; None when neither is there (the id alone then
    names it)."""
    if target is None:
        return None
    if os.path.isdir(target):
        h = hashlib.sha256()
        names = [e.name for e in os.scandir(target) if e.is_file() and not e.name.startswith(".")]
        for name in sorted(names) + named_templates(target):  # the templates its server renders with, too
            path = os.path.join(target, name)
            size = os.path.getsize(path)
            h.update(f"{name}\0{size}\0".encode())
            with open(path, "rb") as fh:
                if size <= 4 * _SAMPLE:
                    h.update(fh.read())
                else:
                    h.update(fh.read(_SAMPLE))
                    fh.seek(size - _SAMPLE)
                    h.update(fh.read(_SAMPLE))
        return h.hexdigest()
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(target, "config.json")
    except Exception:  # noqa: BLE001 - not a repo id (a URI, a missing path): the id alone names it
        return None
    if isinstance(cached, str):  # .../snapshots/<commit>/config.json
        return f"hub commit {os.path.basename(os.path.dirname(cached))}"
    return None


def combine(files: str, tokenizer: str, params: dict[str, Any]) -> str:
    """The run's fingerprint from its three parts."""
    blob = json.dumps([VERSION, files, tokenizer, params], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def input_fingerprint(source: str, tokenizer: str, cfg: DataConfig, block_size: int) -> str:
    """The fingerprint tokenize_dataset writes to manifest.json, computed without tokenizing (for caching)."""
    return combine(files_digest(list_files(source)), tokenizer_digest(tokenizer), output_params(cfg, block_size))
