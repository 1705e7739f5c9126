"""Replace a folder (local path or any fsspec URI) so that readers see the old one or the new one, never half.

The new content is written to a temporary sibling first; `swap_in` then moves the current folder aside, moves
the staged one into place and deletes the old one last. A crash while staging leaves the current folder
untouched; a crash between the two moves leaves `<final>.old-*`, which `recover` moves back. On a local disk
the moves are renames (atomic); on object storage fsspec copies, which is the best such a store offers.
"""

from __future__ import annotations

import posixpath
import secrets
from collections.abc import Callable

import fsspec

OLD, STAGED = ".old-", ".staged-"


def staging_path(final: str) -> str:
    """A fresh temporary sibling of `final` (same parent, so the final move is a rename)."""
    return f"{final.rstrip('/')}{STAGED}{secrets.token_hex(4)}"


def recover(fs: fsspec.AbstractFileSystem, final: str) -> None:
    """Undo what a crash mid-swap or mid-staging left: restore `<final>.old-*` if `final` is gone; drop debris."""
    final = final.rstrip("/")
    olds = sorted(fs.glob(f"{final}{OLD}*"))
    if olds and not fs.exists(final):
        fs.mv(olds.pop(), final, recursive=True)
    for debris in olds + fs.glob(f"{final}{STAGED}*"):
        fs.rm(debris, recursive=True)


def swap_in(fs: fsspec.AbstractFileSystem, staged: str, final: str) -> None:
    """Move the fully written `staged` folder to `final`; an existing `final` is deleted only afterwards."""
    final = final.rstrip("/")
    fs.makedirs(posixpath.dirname(final) or ".", exist_ok=True)
    old = f"{final}{OLD}{secrets.token_hex(4)}"
    if fs.exists(final):
        fs.mv(final, old, recursive=True)
    fs.mv(staged, final, recursive=True)
    if fs.exists(old):
        fs.rm(old, recursive=True)


def replace_dir(uri: str, write: Callable[[str], None]) -> None:
    """Write the new content of folder `uri` with `write(staged_uri)`, then swap it in."""
    fs, path = fsspec.core.url_to_fs(uri)
    recover(fs, path)
    staged = staging_path(path)
    write(fs.unstrip_protocol(staged))
    swap_in(fs, staged, path)
