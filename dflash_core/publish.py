"""Stage outputs are published whole or not at all, and one writer at a time holds an output folder.

`staged_output(out, stage)` locks `out` (a sibling `<out>.lock` file naming its owner; see output_lock for the
`<out>.lock.hold` that keeps it held while processes the owner started run), hands the stage a fresh
temporary sibling folder to write into, and publishes it as `out` only when the stage returns: on a local disk
by an atomic exchange of the two folders (renameat2 RENAME_EXCHANGE; elsewhere `atomic_dir.swap_in`, whose
debris `atomic_dir.recover` repairs), then the old folder is deleted. A failure or Ctrl-C deletes the temporary folder and leaves `out` exactly as it
was. On object stores, which have no rename of folders, the staged files are copied into `out` and the stage's
own completion marker (written last, e.g. manifest.json) is what makes the folder count as complete.

An existing non-empty `out` that is not this stage's own output (no `.dflash-stage.json` naming the stage) is
refused, unless `overwrite` is set: a mistyped `--out` never deletes someone's folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import fsspec

from dflash_core.atomic_dir import recover, staging_path, swap_in
from dflash_core.errors import DflashError
from dflash_core.io import is_local, join_uri

STAGE_MARKER = ".dflash-stage.json"
LOCK_HEARTBEAT_S = 60.0  # a held lock is rewritten this often with the time
LOCK_STALE_S = 600.0  # a lock not rewritten for this long is a dead holder's, whatever host it was on
HOLD_SUFFIX = ".hold"  # <out>.lock.hold: flocked (shared) by the holder and the processes it lets join
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
log = logging.getLogger(__name__)


class OutputError(DflashError):
    """An output folder that cannot be used as asked (not this stage's, or not writable)."""

    exit_code = 2


class OutputLockedError(DflashError):
    """Another live process is writing the same output folder."""

    exit_code = 2


def stage_of(out: str) -> str | None:
    """The stage that published `out` (from its marker), None when there is no marker or no folder."""
    fs, root = fsspec.core.url_to_fs(out)
    marker = join_uri(root, STAGE_MARKER)
    if not fs.exists(marker):
        return None
    try:
        with fs.open(marker, "r", encoding="utf-8") as fh:
            return json.load(fh).get("stage")
    except (OSError, ValueError):
        return None


def check_output(out: str, stage: str, own_files: tuple[str, ...] = (), overwrite: bool = False,
                 overwritable: bool = True, inputs: dict[str, str] | None = None, locking: bool = True) -> None:
    """Refuse an existing `out` that is a file, a non-empty folder that this stage did not write
    (`overwritable`: the stage has an --overwrite flag to offer), the folder of one of the stage's `inputs`
    ({flag: uri}; publishing `out` would replace it, even with --overwrite), or, when this writer will lock it
    (`locking`), one another live process holds the lock on (a node joining a multi-node run does not lock:
    the first node's lock is its run's, not a rival's)."""
    fs, root = fsspec.core.url_to_fs(out)
    root = root.rstrip("/")
    for flag, uri in (inputs or {}).items():
        if _within(uri, out):
            raise OutputError(f"--out {out} holds this stage's input {flag} {uri}: publishing the output would "
                              "replace it; pick another --out")
    if locking and fs.exists(root + ".lock"):  # a live writer: fail at once, before any slow set-up
        holder = _read_lock(fs, root + ".lock")
        if _lock_state(fs, root + ".lock", holder) == "live":  # one `stopping` is output_lock's to wait for
            raise OutputLockedError(_locked_message(out, root + ".lock", holder))
    if fs.exists(root) and not fs.isdir(root):
        raise OutputError(f"--out {out} is an existing file, not a folder; choose a folder path")
    if not fs.exists(root):
        _creatable_parent(fs, root, out)
        return
    if overwrite:
        return
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    owner = stage_of(out)
    legacy = bool(own_files) and all(n in names for n in own_files)  # written before markers existed
    if names and owner != stage and not legacy:
        what = f"the output of `{owner}`" if owner else f"not a `{stage}` output ({len(names)} entries)"
        raise OutputError(f"--out {out} already holds files and is {what}; pick an empty or new folder"
                          + (", or pass --overwrite to replace it" if overwritable else ""))


def _within(uri: str, folder: str) -> bool:
    """Whether `uri` is `folder` or lies inside it (same filesystem; local paths through their real paths)."""
    try:
        (fs_a, a), (fs_b, b) = fsspec.core.url_to_fs(uri), fsspec.core.url_to_fs(folder)
    except (ValueError, ImportError):  # a URI of a filesystem not installed here (the stage will say so) or a hub id
        return False
    if fs_a.protocol != fs_b.protocol:
        return False
    if is_local(fs_a):
        a, b = os.path.realpath(a), os.path.realpath(b)
    a, b = a.rstrip("/"), b.rstrip("/")
    return a == b or a.startswith(b + "/")


def _creatable_parent(fs: fsspec.AbstractFileSystem, root: str, out: str) -> None:
    """Fail before any work when the folder that will hold `out` cannot be created or written."""
    parent = root.rsplit("/", 1)[0] if "/" in root else "."
    try:
        fs.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {parent} for --out {out}: {exc.strerror or exc}") from None
    if is_local(fs) and not os.access(parent, os.W_OK):
        raise OutputError(f"--out {out}: {parent} is not writable")


@contextlib.contextmanager
def output_lock(out: str, stage: str, wait_s: float = 0.0,
                say: Callable[[str], None] = log.warning) -> Iterator[str | None]:
    """Hold `<out>.lock` for the block; a live holder makes this fail at once with its pid and host. The holder
    rewrites the lock every LOCK_HEARTBEAT_S: a lock not rewritten for LOCK_STALE_S is a dead holder's, on
    whatever host (a preempted node, a killed pod), and is taken over, as is one whose owner on this host is
    gone, unless processes it started are still running: on a local disk the holder keeps a shared flock on
    `<out>.lock.hold`, the path it yields (None elsewhere), and processes that may outlive it (the ranks of a
    launcher killed outright, stopping with a checkpoint) hold it too (join_hold); the kernel drops each with its
    process. A lock whose owner is gone but whose hold is held is waited for up to `wait_s` (saying so through
    `say`), then refused; the lock is only let go, at the end of the block, once nothing else holds it."""
    fs, root = fsspec.core.url_to_fs(out)
    lock = root.rstrip("/") + ".lock"
    parent = lock.rsplit("/", 1)[0] if "/" in lock else "."
    try:
        fs.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {parent} for --out {out}: {exc.strerror or exc}") from None
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "stage": stage, "since": time.time(),
             "hold": is_local(fs)}  # a hold not taken after all (no flock there) is never found held
    _acquire(fs, lock, owner, out, wait_s, say)
    hold = _take_hold(fs, lock)
    beat = _Heartbeat(fs, lock, owner)
    beat.start()
    try:
        yield None if hold is None else lock + HOLD_SUFFIX
    finally:
        beat.stop()
        _let_go(fs, lock, owner, hold)


def wait_while_written(out: str, poll_s: float = 15.0) -> None:
    """Return once no live process holds `out`'s lock: its holder let go, or is gone (a lock not rewritten for
    LOCK_STALE_S, or whose owner on this host no longer runs). For a caller that would make the same output and
    can take the other writer's instead."""
    while being_written(out):
        time.sleep(poll_s)


def being_written(out: str) -> bool:
    """Whether a live process holds `out`'s lock now (one look: wait_while_written's test)."""
    fs, root = fsspec.core.url_to_fs(out)
    lock = root.rstrip("/") + ".lock"
    return fs.exists(lock) and _lock_state(fs, lock, _read_lock(fs, lock)) == "live"


def join_hold(hold: str | None) -> int | None:
    """Keep the lock whose hold file is `hold` (output_lock's) from looking abandoned while this process runs:
    a shared flock on it, released when the returned descriptor is closed or the process ends; None when there
    is no hold to join."""
    if not hold:
        return None
    try:
        fd = os.open(hold, os.O_RDONLY | os.O_CLOEXEC)  # never created here: a hold is its lock holder's
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:  # a filesystem without flock: the lock's pid and beat are all there is
        os.close(fd)
        return None
    return fd


def _take_hold(fs: fsspec.AbstractFileSystem, lock: str) -> int | None:
    """The new holder's own share of `<lock>.hold` (created), None off a local disk or where flock fails."""
    if not is_local(fs):
        return None
    try:
        os.close(os.open(lock + HOLD_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError:
        return None
    fd = join_hold(lock + HOLD_SUFFIX)
    if fd is None:  # no flock on this filesystem: no hold file either
        with contextlib.suppress(OSError):
            os.unlink(lock + HOLD_SUFFIX)
    return fd


def _held(hold: str) -> bool:
    """Whether any process holds `hold` (a shared flock, which an exclusive one, tried, meets)."""
    try:
        fd = os.open(hold, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # no flock here: the pid and the beat decide
    finally:
        os.close(fd)  # closing drops the lock this took
    return False


def _let_go(fs: fsspec.AbstractFileSystem, lock: str, owner: dict[str, Any], hold: int | None) -> None:
    """Remove the lock, and its hold first, unless a process this holder let join still holds it (ranks that
    outlived a torchrun killed at the end of their grace): the lock then stays, marked `left`, and the next
    writer, this process's own retry included, waits for them."""
    if hold is not None:
        os.close(hold)
        if _held(lock + HOLD_SUFFIX):
            log.warning("%s stays until the processes started under it have exited (`fuser -v %s` lists them)",
                        lock, lock + HOLD_SUFFIX)
            with contextlib.suppress(OSError):
                _write_lock(fs, lock, {**owner, "left": time.time()})
            return
        with contextlib.suppress(OSError):
            os.unlink(lock + HOLD_SUFFIX)
    with contextlib.suppress(OSError):
        fs.rm(lock)


class _Heartbeat(threading.Thread):
    """Rewrites a held lock with the time (`beat`) every LOCK_HEARTBEAT_S, while it still names its owner."""

    def __init__(self, fs: fsspec.AbstractFileSystem, lock: str, owner: dict[str, Any]) -> None:
        super().__init__(name=f"heartbeat {lock}", daemon=True)
        self.fs, self.lock, self.owner = fs, lock, owner
        self.stopped = threading.Event()

    def run(self) -> None:
        mine = {k: self.owner[k] for k in ("pid", "host", "since")}
        while not self.stopped.wait(LOCK_HEARTBEAT_S):
            # a storage hiccup (or a lock unreadable this instant) skips one beat: the next comes long before the
            # lock would look stale; a lock deleted, or naming another holder, is not ours any more
            try:
                holder = _read_lock(self.fs, self.lock)
                if not holder and self.fs.exists(self.lock):
                    continue
                if {k: holder.get(k) for k in mine} != mine:
                    log.warning("%s no longer names this process (taken over as stale, or deleted); not refreshed",
                                self.lock)
                    return
                _write_lock(self.fs, self.lock, {**self.owner, "beat": time.time()})
            except Exception:  # noqa: BLE001 - logged; retried at the next beat
                log.warning("could not refresh %s; trying again in %s s", self.lock, LOCK_HEARTBEAT_S, exc_info=True)

    def stop(self) -> None:
        """End the heartbeat (before the lock is removed)."""
        self.stopped.set()
        self.join(timeout=10)


def _write_lock(fs: fsspec.AbstractFileSystem, lock: str, holder: dict[str, Any]) -> None:
    if is_local(fs):  # beside it, then renamed over it: a reader never sees half a lock
        tmp = f"{lock}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(holder, fh)
        os.replace(tmp, lock)
    else:
        with fs.open(lock, "w") as fh:
            json.dump(holder, fh)


def _acquire(fs: fsspec.AbstractFileSystem, lock: str, owner: dict[str, Any], out: str, wait_s: float,
             say: Callable[[str], None]) -> None:
    for _ in range(2):  # the second try follows the removal of a stale lock
        if is_local(fs):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                fd = None
            except OSError as exc:
                raise OutputError(f"cannot lock --out {out}: {exc.strerror or exc} ({lock})") from None
            if fd is not None:
                with os.fdopen(fd, "w") as fh:
                    json.dump(owner, fh)
                return
        elif not fs.exists(lock):  # object stores: best effort (no exclusive create)
            _write_lock(fs, lock, owner)
            return
        holder = _read_lock(fs, lock)
        state = _lock_state(fs, lock, holder)
        if state == "live":
            raise OutputLockedError(_locked_message(out, lock, holder))
        if state == "stopping":
            _await_stop(lock, holder, out, wait_s, say)
        with contextlib.suppress(OSError):
            fs.rm(lock)
    raise OutputLockedError(f"--out {out}: could not take the lock {lock}; another writer raced for it")


def lock_holder(out: str) -> str | None:
    """Who holds `out`'s lock, as its lock file says ("pid P on H, stage S, since T"), for a caller that waits for
    it; None when there is no lock file to read (let go) or it cannot be read this instant."""
    fs, root = fsspec.core.url_to_fs(out)
    holder = _read_lock(fs, root.rstrip("/") + ".lock")
    return _holder_text(holder) if holder else None


def _who(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, stage {holder.get('stage')}"


def _holder_text(holder: dict[str, Any]) -> str:
    return f"{_who(holder)}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('since', 0)))}"


def _locked_message(out: str, lock: str, holder: dict[str, Any]) -> str:
    return (f"--out {out} is being written by another process ({_holder_text(holder)}); wait for it, or delete "
            f"{lock} if that process is gone")


def _await_stop(lock: str, holder: dict[str, Any], out: str, wait_s: float, say: Callable[[str], None]) -> None:
    """Wait up to `wait_s` for the processes a gone holder left running (they hold `<lock>.hold`) to exit;
    OutputLockedError, saying so, when they have not."""
    hold, who = lock + HOLD_SUFFIX, _who(holder)
    deadline = time.monotonic() + wait_s
    if wait_s > 0:
        say(f"--out {out}: the last writer ({who}) has ended, but processes it started are still stopping (the "
            f"ranks of a killed launch write their checkpoint first); waiting up to {wait_s:.0f} s for them to exit")
    while _held(hold):
        if time.monotonic() >= deadline:
            waited = f" after {wait_s:.0f} s" if wait_s > 0 else ""
            raise OutputLockedError(
                f"--out {out}: the last writer ({who}) has ended, but processes it started are still running or "
                f"stopping{waited} (the ranks of a killed launch write their checkpoint first); run the same command "
                f"again once they have exited (`fuser -v {hold}` lists them)")
        time.sleep(0.2)


def _read_lock(fs: fsspec.AbstractFileSystem, lock: str) -> dict[str, Any]:
    try:
        with fs.open(lock, "r") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}  # a lock file being written this instant, or garbage: treat as held, with unknown owner


def _lock_state(fs: fsspec.AbstractFileSystem, lock: str, holder: dict[str, Any]) -> str:
    """`live` (its holder runs), `stopping` (its holder is gone or has let go, `left`, but processes it started
    still hold `<lock>.hold`) or `stale` (to be taken over)."""
    if not holder and _untouched_for(fs, lock, LOCK_STALE_S):  # empty or garbage and not rewritten since: a holder
        return "stale"  # killed between creating it and writing it, or a full disk (a live one rewrites it each beat)
    if not holder.get("left") and not _is_stale(holder):
        return "live"
    if holder.get("hold") and is_local(fs) and _held(lock + HOLD_SUFFIX):
        return "stopping"
    return "stale"


def _untouched_for(fs: fsspec.AbstractFileSystem, path: str, seconds: float) -> bool:
    try:
        return time.time() - fs.modified(path).timestamp() > seconds
    except (OSError, NotImplementedError, ValueError):
        return False


def _is_stale(holder: dict[str, Any]) -> bool:
    """A lock whose holder stopped rewriting it LOCK_STALE_S ago (any host), or whose owner was on this host and
    is no longer running (a killed run never unlocks)."""
    beat = holder.get("beat", holder.get("since"))
    if isinstance(beat, int | float) and time.time() - beat > LOCK_STALE_S:
        return True
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextlib.contextmanager
def staged_output(out: str, stage: str, own_files: tuple[str, ...] = (), overwrite: bool = False,
                  overwritable: bool = True, inputs: dict[str, str] | None = None) -> Iterator[str]:
    """Lock `out`, yield a fresh temporary sibling to write into, publish it as `out` on success."""
    check_output(out, stage, own_files, overwrite, overwritable, inputs)
    with output_lock(out, stage):
        fs, root = fsspec.core.url_to_fs(out)
        root = root.rstrip("/")
        recover(fs, root)  # debris of a killed run (we hold the lock, so none of it is live)
        tmp = staging_path(root)
        fs.makedirs(tmp, exist_ok=True)
        try:
            yield fs.unstrip_protocol(tmp) if not is_local(fs) else tmp
            _write_marker(fs, tmp, stage)
            _publish(fs, tmp, root)
        except BaseException:
            with contextlib.suppress(OSError):
                fs.rm(tmp, recursive=True)
            raise


def _write_marker(fs: fsspec.AbstractFileSystem, folder: str, stage: str) -> None:
    with fs.open(f"{folder}/{STAGE_MARKER}", "w", encoding="utf-8") as fh:
        json.dump({"stage": stage}, fh)  # no time: same input, same bytes


def mark_stage(out: str, stage: str) -> None:
    """Mark a folder that its stage writes in place (training's run folder) as that stage's output, so that its
    next launch resumes it instead of refusing it as someone else's folder."""
    fs, root = fsspec.core.url_to_fs(out)
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)
    if stage_of(out) != stage:
        _write_marker(fs, root, stage)


def _publish(fs: fsspec.AbstractFileSystem, tmp: str, root: str) -> None:
    """One atomic exchange where the kernel offers it; else atomic_dir's move-aside, move-in, delete-old."""
    if is_local(fs) and os.path.exists(root) and _exchange(tmp, root):
        shutil.rmtree(tmp, ignore_errors=True)  # `tmp` now holds the old folder
        return
    swap_in(fs, tmp, root)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the call is unavailable."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0
