"""Replace a folder (local path or any fsspec URI) so that readers see the old one or the new one, never half.

The new content is written to a temporary sibling first; `swap_in` then moves the current folder aside, moves
the staged one into place and deletes the old one last. A crash while staging leaves the current folder
untouched. On a local disk the moves are renames (atomic): a crash between the two leaves `<final>.old-*`,
which `recover` moves back. On object storage a move is a copy then a delete, so a crash can leave `final` half
copied or half deleted: there `swap_in` keeps a journal, `<final>.swap.json`, naming its phase and folders, and
`recover` follows it (before `final` is complete: the old copy is put back; after: the leftovers are deleted).
"""

from __future__ import annotations

import json
import posixpath
import secrets
from collections.abc import Callable

import fsspec

from dflash_core.io import is_local

OLD, STAGED, JOURNAL = ".old-", ".staged-", ".swap.json"


def staging_path(final: str) -> str:
    """A fresh temporary sibling of `final` (same parent, so the final move is a rename)."""
    return f"{final.rstrip('/')}{STAGED}{secrets.token_hex(4)}"


def recover(fs: fsspec.AbstractFileSystem, final: str) -> None:
    """Undo what a crash mid-swap or mid-staging left: finish or roll back a journaled swap, restore
    `<final>.old-*` if `final` is gone; drop debris."""
    final = final.rstrip("/")
    journal = f"{final}{JOURNAL}"
    if fs.exists(journal):
        with fs.open(journal, "r") as fh:
            state = json.load(fh)
        if state["phase"] == "install":  # `final` may be half deleted or half copied: what was there comes back
            if fs.exists(final):
                fs.rm(final, recursive=True)
            if state["old"]:
                fs.copy(state["old"], final, recursive=True)
        fs.rm(journal)  # "backup": `final` untouched; "cleanup": `final` complete
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
    if not is_local(fs):
        _journaled_swap(fs, staged, final, old)
        return
    if fs.exists(final):
        fs.mv(final, old, recursive=True)
    fs.mv(staged, final, recursive=True)
    if fs.exists(old):
        fs.rm(old, recursive=True)


def _journaled_swap(fs: fsspec.AbstractFileSystem, staged: str, final: str, old: str) -> None:
    """swap_in where a move is a copy and a delete: each phase written to the journal before it starts."""
    journal = f"{final}{JOURNAL}"

    def phase(name: str, previous: str | None) -> None:
        with fs.open(journal, "w") as fh:
            json.dump({"phase": name, "old": previous, "staged": staged}, fh)

    existed = fs.exists(final)
    phase("backup", None)
    if existed:
        fs.copy(final, old, recursive=True)
    phase("install", old if existed else None)
    if existed:
        fs.rm(final, recursive=True)
    fs.copy(staged, final, recursive=True)
    phase("cleanup", None)
    for leftover in (old, staged):
        if fs.exists(leftover):
            fs.rm(leftover, recursive=True)
    fs.rm(journal)


def replace_dir(uri: str, write: Callable[[str], None]) -> None:
    """Write the new content of folder `uri` with `write(staged_uri)`, then swap it in."""
    fs, path = fsspec.core.url_to_fs(uri)
    recover(fs, path)
    staged = staging_path(path)
    write(fs.unstrip_protocol(staged))
    swap_in(fs, staged, path)
