"""A launch's scratch folders on this machine's disk, under TMPDIR: the copies of token shards and plans read from
an object store (launch.local_folder) and the staging copy of an object-store run folder (run_mirror).

Each holds an owner file (pid, host). A launcher killed with SIGKILL (a pod's OOM kill, `kill -9`) never runs
the cleanup that deletes them, and its copies (token shards: up to hundreds of GB) would take the room the next
launch on the machine needs, which then stops on "no room for the copy". So every launch first deletes the
scratch folders whose owner ran on this host and is gone, and says what it freed. Folders of live launches, of
other hosts (a shared TMPDIR) and without an owner file are left alone. What a killed launch's staging copy held
beyond the store (at most the last push interval, and the checkpoint its ranks saved on the way out) is gone with
it: the next launch resumes from the store's newest checkpoint, as documented.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable

from dflash_core.publish import owner_gone

OWNER_FILE = ".dflash-owner.json"
PREFIXES = ("dflash-run-", "dflash-tokenized-", "dflash-plan-")


def scratch_dir(prefix: str) -> str:
    """A new folder under TMPDIR named `prefix`..., with this process as its owner."""
    assert prefix.startswith(PREFIXES), prefix
    folder = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(folder, OWNER_FILE), "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}, fh)
    return folder


def sweep_scratch(on_line: Callable[[str], None] = print, root: str | None = None) -> int:
    """Delete the scratch folders under `root` (TMPDIR) whose owner on this host is gone; the bytes freed."""
    root = root or tempfile.gettempdir()
    freed = 0
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(PREFIXES) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    for entry in entries:
        try:
            with open(os.path.join(entry.path, OWNER_FILE), encoding="utf-8") as fh:
                owner = json.load(fh)
        except (OSError, ValueError):
            continue  # no owner file (an older version's, or being created this instant): not ours to judge
        if not isinstance(owner, dict) or not owner_gone(owner):
            continue
        size = _size(entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)
        freed += size
        on_line(f"removed {entry.path} ({size / 2**30:.2f} GiB), the scratch folder of a launch that was killed "
                f"(pid {owner['pid']} on this host)")
    return freed


def _size(folder: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
