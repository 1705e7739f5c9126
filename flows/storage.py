"""Paths under the configurable storage root (local path or any fsspec URI)."""

from __future__ import annotations

import fsspec


def join(root: str, *parts: str) -> str:
    """Join path parts under a local path or URI root."""
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def exists(uri: str) -> bool:
    """Whether a file or folder exists at a local path or URI."""
    fs, path = fsspec.core.url_to_fs(uri)
    return fs.exists(path)


def as_link(uri: str) -> str:
    """A clickable link for the Prefect UI: local paths become file:// URIs."""
    if "://" in uri:
        return uri
    fs, path = fsspec.core.url_to_fs(uri)
    return f"file://{path}"
