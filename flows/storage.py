"""Paths under the configurable storage root (local path or any fsspec URI)."""

from __future__ import annotations

import fsspec

from dflash_core.io import join_uri as join  # the one URI join of the project, under the name the flows use

__all__ = ["as_link", "exists", "join"]


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
