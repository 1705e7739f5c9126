"""A launch's scratch folders on this machine's disk, under TMPDIR: the copies of token shards and plans read from
an object store (launch.local_folder) and the staging copy of an object-store run folder (run_mirror).

Each holds an owner file that its launcher keeps locked (flock) for as long as it uses the folder. A launcher
killed with SIGKILL (a pod's OOM kill, `kill -9`) never runs the cleanup that deletes them, and its copies (token
shards: up to hundreds of GB) would take the room the next launch on the machine needs, which then stops on "no
room for the copy". So every launch first deletes the scratch folders whose lock it can take: the kernel drops a
lock with its process, in whatever container or PID namespace it ran (a process id would not tell: a restarted
container reuses them, and another namespace cannot see them). Folders without an owner file (an older
version's, or a staging folder kept after a failed final push, which is the user's to copy) are left alone. What
a killed launch's staging copy held beyond the store (at most the last push interval, and the checkpoint its
ranks saved on the way out) is gone with it: the next launch resumes from the store's newest checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable

OWNER_FILE = ".dflash-owner.json"
PREFIXES = ("dflash-run-", "dflash-tokenized-", "dflash-plan-")
_held: dict[str, int] = {}  # folder -> the open, locked descriptor of its owner file


def scratch_dir(prefix: str) -> str:
    """A new folder under TMPDIR named `prefix`..., its owner file locked by this process until remove_scratch or
    disown_scratch (or the process's end)."""
    assert prefix.startswith(PREFIXES), prefix
    folder = tempfile.mkdtemp(prefix=prefix)
    fd = os.open(os.path.join(folder, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
    _held[folder] = fd
    return folder


def remove_scratch(folder: str) -> None:
    """Delete a scratch folder of this process."""
    _release(folder)
    shutil.rmtree(folder, ignore_errors=True)


def disown_scratch(folder: str) -> None:
    """Keep a scratch folder for the user (a staging folder whose final push failed): no sweep deletes it."""
    _release(folder)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, OWNER_FILE))


def _release(folder: str) -> None:
    fd = _held.pop(folder, None)
    if fd is not None:
        os.close(fd)


def sweep_scratch(on_line: Callable[[str], None] = print, root: str | None = None) -> int:
    """Delete the scratch folders under `root` (TMPDIR) that no live launcher holds; the bytes freed."""
    root = root or tempfile.gettempdir()
    freed = 0
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(PREFIXES) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    for entry in entries:
        if entry.path in _held or not _abandoned(os.path.join(entry.path, OWNER_FILE)):
            continue
        size = _size(entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)
        freed += size
        on_line(f"removed {entry.path} ({size / 2**30:.2f} GiB), the scratch folder of a launch that was killed")
    return freed


def _abandoned(owner_file: str) -> bool:
    """Whether an owner file exists and no process holds its lock (its launcher is gone)."""
    try:
        fd = os.open(owner_file, os.O_RDONLY)
    except OSError:
        return False  # no owner file: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: a live launch
    finally:
        os.close(fd)  # closing drops a lock this took
    return True


def _size(folder: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
