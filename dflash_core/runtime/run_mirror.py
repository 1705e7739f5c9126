"""A run folder on an object store, trained in a folder on this machine's disk and mirrored to the store.

The ranks write their run folder with local file operations (checkpoints renamed into place, metrics.jsonl
appended and flushed every step, the exported drafter swapped in): an object store has no rename and no append.
So a launch whose `--out` is an s3:// / gs:// / ... URI trains into a local staging folder (under TMPDIR) and this
mirror keeps the store up to date:

- before the launch it pulls what a resume reads: metrics.jsonl, this node's log (train.log on the first or only
  node), wandb_run_id, the launch ledger (launches.jsonl), the newest complete checkpoint (of the older ones
  only their meta.json: the run prunes them as its own, and the store with it) and the transaction log of each
  earlier launch's W&B folder (`wandb/*-<id>/run-<id>.wandb`, ~5 KB a step: the steps W&B holds, which the
  resume logs what it lacks after); a W&B folder the resume removes (an empty log, which stops `wandb sync`)
  is removed from the store by the next push;
- while training runs, every `every_s` seconds, and once more when the launch ends (failed or not), it pushes
  what changed: files as they are; a checkpoint folder only once complete (`meta.json` present), `meta.json`
  last, so a reader never takes a half-uploaded one for complete; checkpoints pruned locally are deleted from
  the store; drafter/ and drafter-best/ swapped in whole (atomic_dir.replace_dir);
- a file that keeps growing is re-uploaded whole (no append on a store), so pushing it every `every_s` seconds
  would cost the square of the run's length (metrics.jsonl: ~1.5 KB a step, 306 MB and ~1.3 TB uploaded over 200k
  steps; W&B's run file ~5 KB a step). A changed file up to `every_s` x REPUSH_BYTES_PER_S goes with every push;
  a bigger one once size / REPUSH_BYTES_PER_S seconds have passed since its last upload, so each such file costs
  at most REPUSH_BYTES_PER_S bytes a second of upload. W&B's folder (wandb/: read only by `wandb sync`)
  waits for a checkpoint push. A push that sends a checkpoint, and the final one, send every changed file;
- the store's metrics.jsonl always reaches the newest checkpoint the store holds (a resume from it would otherwise
  lack the steps before that checkpoint for good): the run logs a step before it saves the checkpoint after it,
  and a push lists the complete checkpoints it will send *before* it uploads metrics.jsonl, then sends them (one
  completed during the upload waits for the next push); a pull, the other way round, lists the store's
  checkpoints before it reads metrics.jsonl. drafter-best/ goes the same way: it is swapped in before the listed
  checkpoints are sent, so the store never holds a checkpoint whose best validation's weights it lacks (a
  resume exports drafter-best/ again only when a validation beats the checkpoint's best);
- a pod that is killed loses at most the last `every_s` seconds of uploads (of a big growing file the appends
  since its last upload, of wandb/ those since the last checkpoint push): the checkpoints pushed before stay, with
  the metrics.jsonl that reaches them, and the next launch (on any machine) resumes from the newest of them.

The staging folder is deleted after the final push; if that push fails it is kept and named, so nothing the run
wrote is lost.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec

from dflash_core.atomic_dir import JOURNAL, OLD, STAGED, replace_dir
from dflash_core.errors import DflashError
from dflash_core.io import is_local, join_uri
from dflash_core.monitor.sinks import is_launch_folder, wandb_run_file
from dflash_core.runtime.scratch import OWNER_FILE, disown_scratch, remove_scratch, scratch_dir

__all__ = ["RunMirror", "staged_run"]

PUSH_EVERY_S = 30.0
# Upload budget of each growing file between checkpoint pushes, in bytes a second (see top): ~0.45 GB per hour of
# training however long the run, a small share of any pod's uplink. What a user sees: the store's metrics.jsonl (the
# Prefect UI's live progress page reads it) and log lag the run by every_s (30 s) up to 3.75 MiB (~2,500 steps),
# then by size / 128 KiB/s (8 s per MB): ~10 min at 77 MB (50k steps), ~40 min at 306 MB (200k steps); never by
# more than the time to the next checkpoint push (checkpoint_every steps), which sends them too.
REPUSH_BYTES_PER_S = 128 * 1024
_JOIN_S = 600.0  # how long the end of a launch waits for a push in flight
_STEP = re.compile(r"^step-(\d+)$")
# what a resumed run reads back, besides its checkpoint and log (launches.jsonl: the launcher appends to it)
_PULLED = ("metrics.jsonl", "wandb_run_id", "launches.jsonl")
_WHOLE = ("drafter", "drafter-best")  # folders a reader takes as a whole: swapped in, never half-written
_WANDB = "wandb"  # W&B's folder: pushed with checkpoints and at the end (see top)
_NOT_MIRRORED = (OLD, STAGED, JOURNAL, ".tmp-", OWNER_FILE)  # debris and staging names of local swaps and saves;
# the staging folder's owner record (runtime/scratch)


class MirrorError(DflashError):
    """The run folder could not be pushed to (or pulled from) its object store."""


class RunMirror:
    """Keeps the object-store run folder `remote` up to date with the local folder `local`."""

    def __init__(self, remote: str, local: str, log_name: str = "train.log", every_s: float = PUSH_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(remote)
        self.remote, self.local, self.log_name = remote, Path(local), log_name
        self.every_s, self._clock = every_s, clock
        self._seen: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) as last pushed or pulled
        self._sent_at: dict[str, float] = {}  # relative path -> clock() at the push that last uploaded it
        self._pulled_wandb: set[str] = set()  # W&B launch folders pulled (relative): removed locally, from the store
        self._lock = threading.Lock()

    # ---- pull ----------------------------------------------------------------------------------------------

    def pull(self) -> str | None:
        """Copy what a resume reads from the store; returns the newest complete checkpoint's name, if any. The
        older complete checkpoints come as their meta.json alone: the run counts them when it prunes to
        keep_checkpoints, and what it prunes the next push deletes from the store."""
        steps = sorted(self._remote_steps())  # before metrics.jsonl: the one read then reaches these (see top)
        for name in (*_PULLED, self.log_name):
            src = join_uri(self.root, name)
            if self.fs.isfile(src):
                self._get(src, name)
        self._pull_wandb_logs()
        for step in steps[:-1]:
            self._get(join_uri(self.root, "checkpoints", f"step-{step}", "meta.json"),
                      f"checkpoints/step-{step}/meta.json")
        if not steps:
            return None
        name = f"checkpoints/step-{steps[-1]}"
        for src in self.fs.find(join_uri(self.root, name)):
            self._get(src, f"{name}/{src[len(join_uri(self.root, name)) + 1:]}")
        return name

    def _pull_wandb_logs(self) -> None:
        """The transaction log of each W&B launch folder of the run named by the pulled wandb_run_id: what the
        resume reads for the steps W&B holds (monitor.sinks.wandb_steps); the rest of those folders stays on
        the store, for `wandb sync`."""
        try:
            run_id = (self.local / "wandb_run_id").read_text().strip()
        except FileNotFoundError:
            return
        if not run_id:
            return
        try:
            folders = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(join_uri(self.root, _WANDB), detail=False)]
        except FileNotFoundError:
            return
        for name in sorted(folders):
            src = join_uri(self.root, _WANDB, name, wandb_run_file(run_id))
            if is_launch_folder(name, run_id) and self.fs.isfile(src):
                self._get(src, f"{_WANDB}/{name}/{wandb_run_file(run_id)}")
                self._pulled_wandb.add(f"{_WANDB}/{name}")

    def _get(self, src: str, rel: str) -> None:
        dst = self.local / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(src, str(dst))
        self._seen[rel] = _signature(dst)

    def _remote_steps(self, complete: bool = True) -> list[int]:
        """Steps of the checkpoints on the store: the complete ones (a folder with meta.json), or all."""
        root = join_uri(self.root, "checkpoints")
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(root, detail=False)]
        except FileNotFoundError:
            return []
        return [int(m[1]) for n in names if (m := _STEP.match(n))
                and (not complete or self.fs.exists(join_uri(root, n, "meta.json")))]

    # ---- push ----------------------------------------------------------------------------------------------

    def push(self, final: bool = False) -> int:
        """Upload what changed since the last push and is due (see top); returns the number of files uploaded.
        `final` (the end of a launch): everything that changed."""
        with self._lock:
            return self._push(final)

    def _push(self, final: bool) -> int:
        # Checkpoints listed first; then drafter/ and drafter-best/, then metrics.jsonl, then those checkpoints:
        # every step before them was logged, and their best validation's weights exported, before they were
        # saved, so the store's metrics.jsonl and drafter-best/ reach every checkpoint it gets (a resume does not
        # export drafter-best/ again until a validation beats the checkpoint's best: a push killed between the
        # checkpoints and drafter-best/ left the store without it, or with an older one, for good).
        steps = self._complete_steps()
        everything = final or self._unsent(steps)  # a checkpoint push: metrics.jsonl must reach the checkpoints
        pushed = sum(self._push_whole(folder) for folder in _WHOLE)
        pushed += self._push_files(everything)
        pushed += self._push_checkpoints(steps)
        self._remove_dropped_wandb()
        return pushed

    def _remove_dropped_wandb(self) -> None:
        """The pulled W&B launch folders the resume removed locally (monitor.sinks: an empty transaction log,
        which stops `wandb sync`) removed from the store as well."""
        for rel in sorted(self._pulled_wandb):
            if not (self.local / rel).exists():
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(join_uri(self.root, rel), recursive=True)
                self._pulled_wandb.discard(rel)

    def _push_files(self, everything: bool) -> int:
        """The changed files pushed one by one: those due, or all (`everything`)."""
        now, pushed = self._clock(), 0
        for rel, size in self._changed_files():
            if (everything or self._due(rel, size, now)) and self._put(rel):
                self._sent_at[rel] = now
                pushed += 1
        return pushed

    def _due(self, rel: str, size: int, now: float) -> bool:
        """Whether a changed file goes with a periodic push: a small one always, a big one once its last upload is
        size / REPUSH_BYTES_PER_S seconds old, W&B's folder never (see top)."""
        if rel.split("/", 1)[0] == _WANDB:
            return False
        waited = now - self._sent_at.get(rel, -math.inf)
        return size <= REPUSH_BYTES_PER_S * self.every_s or waited >= size / REPUSH_BYTES_PER_S

    def _unsent(self, steps: list[int]) -> bool:
        """Whether a complete checkpoint of `steps` is not on the store yet (its meta.json not pushed)."""
        for step in steps:
            meta = f"checkpoints/step-{step}/meta.json"
            with contextlib.suppress(FileNotFoundError):  # pruned since listed
                if self._changed(meta):
                    return True
        return False

    def _changed_files(self) -> list[tuple[str, int]]:
        """The files pushed one by one that changed, with their size: all but checkpoints and the folders swapped in
        whole."""
        out = []
        for path in sorted(self.local.rglob("*")):
            rel = path.relative_to(self.local).as_posix()
            if rel.split("/", 1)[0] in ("checkpoints", *_WHOLE):
                continue
            if not path.is_file() or any(mark in rel for mark in _NOT_MIRRORED):
                continue
            with contextlib.suppress(FileNotFoundError):  # removed while listing (a pruned checkpoint)
                if signature := self._changed(rel):
                    out.append((rel, signature[0]))
        return out

    def _put(self, rel: str, strict: bool = False) -> int:
        """Upload one file (1) or nothing when it is gone (0; `strict`: FileNotFoundError); MirrorError when the
        store answers FileNotFoundError for a file still here."""
        path = self.local / rel
        try:
            signature = _signature(path)
            self.fs.put_file(str(path), join_uri(self.root, rel))
        except FileNotFoundError as exc:  # pruned or swapped while uploading: the next push sees what replaced it
            if path.exists():  # the store's own answer (s3fs, gcsfs: a bucket that does not exist), not a prune
                raise MirrorError(f"uploading {rel} to {self.remote} failed ({exc})") from exc
            if strict:
                raise
            return 0
        self._seen[rel] = signature
        return 1

    def _complete_steps(self) -> list[int]:
        """Steps of the complete local checkpoints (meta.json present), oldest first."""
        local_root = self.local / "checkpoints"
        return sorted(int(m[1]) for p in local_root.glob("step-*") if (m := _STEP.match(p.name))
                      and (p / "meta.json").exists()) if local_root.exists() else []

    def _push_checkpoints(self, steps: list[int]) -> int:
        """The checkpoints of `steps` not on the store yet, meta.json last; then the store's older ones that the
        local folder pruned are deleted."""
        pushed = 0
        for step in steps:
            folder = f"checkpoints/step-{step}"
            files = [p for p in sorted((self.local / folder).rglob("*")) if p.is_file() and p.name != "meta.json"]
            rels = [p.relative_to(self.local).as_posix() for p in files] + [f"{folder}/meta.json"]
            try:
                for rel in rels:  # meta.json last: the store's copy is complete only once it is there
                    if self._changed(rel):
                        pushed += self._put(rel, strict=True)
            except FileNotFoundError:
                continue  # pruned while uploading: its meta.json is not sent
        if steps:  # the run's pruned ones, and pushes cut off before their meta.json
            for old in self._remote_steps(complete=False):
                if old < steps[-1] and old not in steps:
                    self.fs.rm(join_uri(self.root, "checkpoints", f"step-{old}"), recursive=True)
        return pushed

    def _push_whole(self, folder: str) -> int:
        path = self.local / folder
        if not path.is_dir():
            return 0
        files = [p.relative_to(self.local).as_posix() for p in path.rglob("*") if p.is_file()]
        changed = {rel: signature for rel in files if (signature := self._changed(rel))}
        if not changed:
            return 0

        def write(staged: str) -> None:
            fs, target = fsspec.core.url_to_fs(staged)
            for rel in files:
                fs.put_file(str(self.local / rel), join_uri(target, rel[len(folder) + 1:]))

        replace_dir(join_uri(self.remote, folder), write)
        self._seen.update(changed)  # the unchanged files' signatures are recorded already
        return len(files)

    def _changed(self, rel: str) -> tuple[int, int] | None:
        """The local file's signature when it differs from the one it had when last pushed or pulled, else None
        (FileNotFoundError when it is gone)."""
        signature = _signature(self.local / rel)
        return signature if self._seen.get(rel) != signature else None


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@contextlib.contextmanager
def staged_run(out: str, on_line: Callable[[str], None] = print, log_name: str = "train.log",
               every_s: float = PUSH_EVERY_S) -> Iterator[str]:
    """The run folder the ranks write: `out` itself on the local disk; for an object-store `out`, a local staging
    folder pulled from it first and mirrored to it while the ranks run and once more at the end."""
    fs, _ = fsspec.core.url_to_fs(out)
    if is_local(fs):
        yield out.removeprefix("file://")  # the ranks take it as a path
        return
    local = scratch_dir("dflash-run-")
    mirror = RunMirror(out, local, log_name, every_s)
    try:
        resumed = mirror.pull()
    except BaseException:
        remove_scratch(local)
        raise
    on_line(f"run folder {out} is on an object store: the ranks write {local}, pushed to it every "
            f"{every_s:.0f} s (a big growing file less often, wandb/ with each checkpoint) and at the end"
            + (f" (resuming from its {resumed})" if resumed else ""))
    stop = threading.Event()
    failures: list[BaseException] = []

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                mirror.push()
            except Exception as exc:  # a store hiccup: said, and the next push (or the final one) tries again
                if not failures:
                    on_line(f"warning: pushing the run folder to {out} failed ({type(exc).__name__}: {exc}); "
                            "trying again")
                failures.append(exc)

    thread = threading.Thread(target=loop, name="run-mirror", daemon=True)
    thread.start()
    failed: BaseException | None = None
    try:
        yield local
    except BaseException as exc:
        failed = exc
        raise
    finally:
        stop.set()
        thread.join(timeout=_JOIN_S)
        try:
            if thread.is_alive():  # a store call that never returns: the final push would wait on it too
                raise TimeoutError(f"a push still runs after {_JOIN_S:.0f} s")
            interrupted = _final_push(mirror, on_line)
        except BaseException as exc:  # the store failed, or a second signal stopped the final push's second run
            signal = not isinstance(exc, Exception)
            why = "was interrupted twice" if signal else f"failed ({type(exc).__name__}: {exc})"
            kept = MirrorError(f"the final push of the run folder to {out} {why}; everything the run wrote is kept in "
                               f"{local}: copy it there, or run the same command again"
                               f"{'' if signal else ' once the store answers'} (it resumes from the newest "
                               f"checkpoint the store holds)")
            disown_scratch(local)  # the user's to copy: no later launch's sweep deletes it
            if signal:
                on_line(f"error: {kept}")
                raise
            if failed is None:
                raise kept from exc
            on_line(f"error: {kept}")  # the run's own failure stays the error raised
        else:
            remove_scratch(local)
            if interrupted is not None:
                raise interrupted


def _final_push(mirror: RunMirror, on_line: Callable[[str], None]) -> BaseException | None:
    """The last push, finished even when a signal's exception (Prefect's TerminationSignal on a cancel, a Ctrl-C)
    lands in the middle of it: pushes are idempotent, so it runs once more; the interruption is returned, for the
    caller to raise once the staging folder is dealt with."""
    try:
        mirror.push(final=True)
    except Exception:
        raise
    except BaseException as interrupted:
        on_line(f"{type(interrupted).__name__} during the final push to {mirror.remote}: finishing it first")
        mirror.push(final=True)
        return interrupted
    return None
