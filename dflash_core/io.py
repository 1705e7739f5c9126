"""Small file helpers shared by every stage: joining paths under a local or fsspec-URI root, writing JSONL."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from typing import Any

import fsspec


def join_uri(root: str, *parts: str) -> str:
    """Join path parts under a local path or URI root (`s3://b/x` + `y/` -> `s3://b/x/y`)."""
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def write_jsonl(path: str, records: Iterable[Any], *, sort_keys: bool = False, gz: bool = False) -> str:
    """Write records one JSON object per line (UTF-8; gzip when gz) to a path or fsspec URI; returns the path."""
    data = "".join(json.dumps(r, sort_keys=sort_keys, ensure_ascii=False) + "\n" for r in records).encode()
    with fsspec.open(path, "wb") as fh:
        fh.write(gzip.compress(data, mtime=0) if gz else data)
    return path


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """The protocol names of an fsspec filesystem (fsspec gives one name or a tuple)."""
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether an fsspec filesystem is the local disk (renames are atomic, os calls work on its paths)."""
    return "file" in protocols(fs)


def expand_home(uri: str) -> str:
    """A local path or file URI with a leading ~ expanded (fsspec expands it, plain os and Path calls do not: a
    folder both write would be split between $HOME and a literal ./~); any other URI as it is."""
    path = uri.removeprefix("file://")
    return os.path.expanduser(path) if "://" not in path and path.startswith("~") else uri


def looks_local(path: str) -> bool:
    """A path no hub id can be: absolute, relative with ./ or ~, a file URI, or deeper than owner/name."""
    return path.startswith(("/", ".", "~", "file:")) or "\\" in path or path.count("/") > 1 or path.endswith("/")


def missing_local_folder(path: str) -> bool:
    """A model or tokenizer path that can only be a local folder, and is none (from_pretrained would take it for a
    hub id and say its name is malformed)."""
    return looks_local(path) and not os.path.isdir(os.path.expanduser(path.removeprefix("file://")))
