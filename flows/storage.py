"""Paths under the configurable storage root (local path or any fsspec URI)."""

from __future__ import annotations

from urllib.parse import quote

import fsspec

from dflash_core.io import join_uri as join  # the one URI join of the project, under the name the flows use

__all__ = ["console_url", "display_path", "exists", "join"]


def exists(uri: str) -> bool:
    """Whether a file or folder exists at a local path or URI."""
    fs, path = fsspec.core.url_to_fs(uri)
    return fs.exists(path)


def console_url(uri: str, folder: bool = False) -> str | None:
    """The cloud console page of an s3:// or gs:// object (or folder); None for other storage.

    Artifact links must open from any browser: a file:// link only works on the machine that ran the flow.
    """
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    key = key.rstrip("/")
    if scheme in ("s3", "s3a"):
        if folder:
            prefix = f"?prefix={quote(key)}/" if key else ""  # the bucket root has no prefix
            return f"https://s3.console.aws.amazon.com/s3/buckets/{bucket}{prefix}"
        return f"https://s3.console.aws.amazon.com/s3/object/{bucket}?prefix={quote(key)}"
    if scheme in ("gs", "gcs"):
        page = "browser" if folder else "browser/_details"
        return f"https://console.cloud.google.com/storage/{page}/{bucket}/{quote(key)}"
    return None


def display_path(uri: str) -> str:
    """A local path as a plain absolute path (never file://); any other URI as given."""
    if "://" in uri and not uri.startswith("file://"):
        return uri
    return fsspec.core.url_to_fs(uri)[1]
