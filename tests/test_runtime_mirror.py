"""A run folder on an object store (memory:// here): trained in a local staging folder that is pulled from it
and pushed to it (dflash_core/runtime/run_mirror.py). The end-to-end launch is in tests/test_runtime_e2e.py."""

import json
import os
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import fsspec
import pytest

from dflash_core.runtime.run_mirror import REPUSH_BYTES_PER_S, MirrorError, RunMirror, staged_run


@pytest.fixture
def remote():
    uri = f"memory://runs-{uuid.uuid4().hex[:8]}/run"
    yield uri
    fs = fsspec.filesystem("memory")
    if fs.exists(uri):
        fs.rm(uri, recursive=True)


def _checkpoint(root: Path, step: int, complete: bool = True) -> None:
    folder = root / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * step)
    (folder / "train_state.pt").write_bytes(b"s" * step)
    if complete:
        (folder / "meta.json").write_text(json.dumps({"step": step, "complete": True}))


def _names(fs, uri: str) -> list[str]:
    return sorted(p[len(fs._strip_protocol(uri)) + 1:] for p in fs.find(uri))


def test_push_uploads_what_changed_complete_checkpoints_only_and_prunes_what_the_run_pruned(remote, tmp_path):
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    local.mkdir()
    mirror = RunMirror(remote, str(local))
    (local / "metrics.jsonl").write_text('{"step": 0}\n')
    _checkpoint(local, 2)
    _checkpoint(local, 4, complete=False)  # being written: not on the store until its meta.json is there
    (local / "checkpoints" / ".tmp-step-6-123").mkdir()
    (local / "checkpoints" / ".tmp-step-6-123" / "model.safetensors").write_bytes(b"x")
    assert mirror.push() == 4
    assert _names(fs, remote) == ["checkpoints/step-2/meta.json", "checkpoints/step-2/model.safetensors",
                                  "checkpoints/step-2/train_state.pt", "metrics.jsonl"]
    assert mirror.push() == 0  # nothing changed
    (local / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (local / "checkpoints" / "step-4" / "meta.json").write_text("{}")
    _checkpoint(local, 6)
    for name in ("model.safetensors", "train_state.pt", "meta.json"):  # the run keeps 2: step-2 pruned
        (local / "checkpoints" / "step-2" / name).unlink()
    (local / "checkpoints" / "step-2").rmdir()
    (local / "drafter").mkdir()
    (local / "drafter" / "config.json").write_text("{}")
    (local / "drafter.old-1234").mkdir()  # a local swap's debris: never mirrored
    (local / "drafter.old-1234" / "config.json").write_text("{}")
    fs.pipe(f"{remote}/checkpoints/step-1/model.safetensors", b"cut")  # a push cut off before its meta.json
    assert mirror.push() == 8
    assert fs.cat_file(f"{remote}/metrics.jsonl").count(b"\n") == 2
    names = _names(fs, remote)
    assert not any("step-2" in n or "step-1" in n or ".old-" in n or ".tmp-" in n for n in names)
    assert {"checkpoints/step-4/meta.json", "checkpoints/step-6/meta.json", "drafter/config.json"} <= set(names)


def test_pull_brings_back_what_a_resume_reads_and_the_newest_complete_checkpoint(remote, tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    (first / "metrics.jsonl").write_text('{"step": 0}\n')
    (first / "wandb_run_id").write_text("abc")
    _checkpoint(first, 2)
    _checkpoint(first, 4)
    RunMirror(remote, str(first)).push()
    fs = fsspec.filesystem("memory")
    fs.rm(f"{remote}/checkpoints/step-4/meta.json")  # a push cut off before its meta.json: not complete
    second = tmp_path / "second"
    second.mkdir()
    mirror = RunMirror(remote, str(second))
    assert mirror.pull() == "checkpoints/step-2"
    assert sorted(p.relative_to(second).as_posix() for p in second.rglob("*") if p.is_file()) == [
        "checkpoints/step-2/meta.json", "checkpoints/step-2/model.safetensors", "checkpoints/step-2/train_state.pt",
        "metrics.jsonl", "wandb_run_id"]
    assert mirror.push() == 0  # what was pulled is not sent back
    _checkpoint(first, 6)
    RunMirror(remote, str(first)).push()  # now step-2, step-6 complete on the store
    third = tmp_path / "third"
    third.mkdir()
    assert RunMirror(remote, str(third)).pull() == "checkpoints/step-6"
    # the older one as its meta.json alone: the run prunes it as one of its own (keep_checkpoints), the store too
    assert sorted(p.name for p in (third / "checkpoints" / "step-2").iterdir()) == ["meta.json"]
    assert len(list((third / "checkpoints" / "step-6").iterdir())) == 3


def _steps_logged(text: str) -> int:
    """The newest step a metrics.jsonl logged (-1: none)."""
    return max((json.loads(line)["step"] for line in text.splitlines() if line.strip()), default=-1)


def _newest_checkpoint(fs, remote: str) -> int:
    """The newest complete checkpoint's step on the store (0: none)."""
    return max((int(p.rstrip("/").rsplit("-", 1)[-1]) for p in fs.ls(f"{remote}/checkpoints", detail=False)
                if fs.exists(f"{p}/meta.json")), default=0)


def _log_steps(root: Path, upto: int) -> None:
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(upto)))


def test_the_store_metrics_reach_every_checkpoint_it_holds_when_one_is_saved_during_the_metrics_upload(
        remote, tmp_path, monkeypatch):
    # A checkpoint saved while metrics.jsonl uploads went to the store in the same push, after a metrics.jsonl
    # that ended before it: a resume from the store then lacked those steps for good.
    local = tmp_path / "staging"
    local.mkdir()
    _log_steps(local, 10)
    _checkpoint(local, 10)
    mirror = RunMirror(remote, str(local))
    real = mirror.fs.put_file

    def training_goes_on(lpath, rpath, **kwargs):
        real(lpath, rpath, **kwargs)
        if rpath.endswith("metrics.jsonl") and not (local / "checkpoints" / "step-20").exists():
            _log_steps(local, 20)  # steps 10..19 logged, then checkpoint step-20 saved
            _checkpoint(local, 20)

    monkeypatch.setattr(mirror.fs, "put_file", training_goes_on)
    fs = fsspec.filesystem("memory")
    for _ in range(2):  # the checkpoint saved during the upload goes with the next push
        mirror.push()
        assert _steps_logged(fs.cat_file(f"{remote}/metrics.jsonl").decode()) + 1 >= _newest_checkpoint(fs, remote)
    assert _newest_checkpoint(fs, remote) == 20
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    assert RunMirror(remote, str(resumed)).pull() == "checkpoints/step-20"
    assert _steps_logged((resumed / "metrics.jsonl").read_text()) == 19


def test_a_pull_during_a_push_gets_metrics_that_reach_the_checkpoint_it_resumes_from(remote, tmp_path, monkeypatch):
    # A launch that pulls while the one before still pushes (a pod being replaced): metrics.jsonl read first and the
    # checkpoints listed after it, the newest checkpoint could be newer than the metrics pulled.
    first = tmp_path / "first"
    first.mkdir()
    _log_steps(first, 10)
    _checkpoint(first, 10)
    pusher = RunMirror(remote, str(first))
    pusher.push()
    second = tmp_path / "second"
    second.mkdir()
    puller = RunMirror(remote, str(second))
    real = puller.fs.get_file

    def pushed_meanwhile(rpath, lpath, **kwargs):
        real(rpath, lpath, **kwargs)
        if rpath.endswith("metrics.jsonl") and not (first / "checkpoints" / "step-20").exists():
            _log_steps(first, 20)
            _checkpoint(first, 20)
            pusher.push()

    monkeypatch.setattr(puller.fs, "get_file", pushed_meanwhile)
    resumed = int(puller.pull().rsplit("-", 1)[-1])
    assert _steps_logged((second / "metrics.jsonl").read_text()) + 1 >= resumed


def test_a_local_run_folder_is_used_as_it_is_and_a_remote_one_is_staged_then_removed(remote, tmp_path):
    with staged_run(str(tmp_path / "local")) as run_dir:
        assert run_dir == str(tmp_path / "local")
    lines: list[str] = []
    with staged_run(remote, lines.append, every_s=0.05) as run_dir:
        assert Path(run_dir).name.startswith("dflash-run-")
        (Path(run_dir) / "metrics.jsonl").write_text('{"step": 0}\n')
        _checkpoint(Path(run_dir), 1)
        fs = fsspec.filesystem("memory")
        for _ in range(200):  # the periodic push, while the ranks still run
            if fs.exists(f"{remote}/checkpoints/step-1/meta.json"):
                break
            time.sleep(0.05)
        assert fs.exists(f"{remote}/checkpoints/step-1/meta.json")
    assert not Path(run_dir).exists() and "is on an object store" in lines[0]


def test_a_failed_final_push_keeps_the_staging_folder_and_says_where(remote, tmp_path, monkeypatch):
    def broken(self, final: bool = False) -> int:
        raise OSError("the store is down")

    with pytest.raises(MirrorError, match=r"final push .* failed \(OSError: the store is down\).*kept in"):
        with staged_run(remote, lambda _: None, every_s=60) as run_dir:
            (Path(run_dir) / "metrics.jsonl").write_text("{}\n")
            monkeypatch.setattr(RunMirror, "push", broken)
    assert (Path(run_dir) / "metrics.jsonl").exists()
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="training failed"):  # the run's own error stays the error
        with staged_run(remote, lines.append, every_s=60) as run_dir:
            raise RuntimeError("training failed")
    assert any("kept in" in line for line in lines) and Path(run_dir).exists()


def test_a_bare_worker_refuses_an_object_store_run_folder():
    """torchrun -m dflash_core.runtime.worker --out s3://... would write a relative 's3:/...' folder on the local
    disk: refused, naming the launcher that mirrors it."""
    from dflash_core.errors import InputError
    from dflash_core.runtime.worker import parse_args, run

    args = parse_args(["--tokenized", "t", "--plan", "p", "--out", "s3://bucket/runs/x", "--config", "c.yaml"])
    with pytest.raises(InputError, match="--out s3://bucket/runs/x: the ranks write .* launch with `dflash train`"):
        run(args, None)


def test_each_node_pulls_and_pushes_its_own_log(remote, tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{remote}/train.log", b"node 0 before\n")
    fs.pipe(f"{remote}/train.node-1.log", b"node 1 before\n")
    second = tmp_path / "node-1"
    second.mkdir()
    mirror = RunMirror(remote, str(second), "train.node-1.log")
    mirror.pull()
    assert sorted(p.name for p in second.iterdir()) == ["train.node-1.log"]  # not the first node's log
    with open(second / "train.node-1.log", "a") as fh:
        fh.write("node 1 now\n")
    assert mirror.push() == 1
    assert fs.cat_file(f"{remote}/train.node-1.log") == b"node 1 before\nnode 1 now\n"
    assert fs.cat_file(f"{remote}/train.log") == b"node 0 before\n"


def test_a_signal_during_the_final_push_lets_it_finish_first(remote, tmp_path, monkeypatch):
    fs = fsspec.filesystem("memory")
    calls, lines = [], []
    real = RunMirror.push

    def interrupted_once(self, final=False):
        calls.append(final)
        if len(calls) == 1:
            raise KeyboardInterrupt  # what Prefect's TerminationSignal is too: a BaseException from a handler
        return real(self, final)

    with pytest.raises(KeyboardInterrupt):
        with staged_run(remote, lines.append, every_s=60) as run_dir:
            (Path(run_dir) / "metrics.jsonl").write_text('{"step": 0}\n')
            monkeypatch.setattr(RunMirror, "push", interrupted_once)
    assert calls == [True, True] and fs.cat_file(f"{remote}/metrics.jsonl") == b'{"step": 0}\n'
    assert any("KeyboardInterrupt during the final push" in line and "finishing it first" in line for line in lines)
    assert not Path(run_dir).exists()  # pushed whole: the staging folder goes as after any final push


def test_a_push_killed_before_its_checkpoints_never_leaves_one_without_its_drafter_best(remote, tmp_path):
    """The store must not get a checkpoint whose best validation's weights (drafter-best/) it lacks: a resume from
    that checkpoint exports drafter-best/ again only when a later validation beats it. A push killed (a pod
    evicted) after the checkpoints and before the drafter-best/ swap left the store without it for good."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    local.mkdir()
    (local / "metrics.jsonl").write_text('{"step": 0}\n')
    (local / "drafter-best").mkdir()
    (local / "drafter-best" / "model.safetensors").write_bytes(b"best of step 3")
    _checkpoint(local, 4)  # its meta records best step 3
    mirror = RunMirror(remote, str(local))
    real_put = mirror.fs.put_file

    def killed_at_the_checkpoints(src, dst, **kw):
        if "/checkpoints/" in dst:
            raise KeyboardInterrupt("the pod is evicted")  # nothing after this point reaches the store
        return real_put(src, dst, **kw)

    mirror.fs.put_file = killed_at_the_checkpoints
    try:
        with pytest.raises(KeyboardInterrupt):
            mirror.push()
    finally:
        mirror.fs.put_file = real_put
    assert "drafter-best/model.safetensors" in _names(fs, remote)
    assert not any(name.startswith("checkpoints/") for name in _names(fs, remote))


def test_scratch_folders_of_a_killed_launch_are_removed_by_the_next_and_no_others(tmp_path, monkeypatch):
    """A launcher killed with SIGKILL never deletes its copies under TMPDIR (token shards: up to hundreds of GB);
    the next launch on the machine removes those no live launcher holds (the owner file's flock, which the kernel
    drops with its process in whatever PID namespace it ran), and only those."""
    import subprocess
    import sys

    from dflash_core.runtime.scratch import OWNER_FILE, disown_scratch, scratch_dir, sweep_scratch

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches TMPDIR
    mine, kept = scratch_dir("dflash-tokenized-"), scratch_dir("dflash-run-")
    disown_scratch(kept)  # a staging folder whose final push failed: the user's to copy
    holder = ("import fcntl, os, sys, time\nfrom dflash_core.runtime.scratch import scratch_dir\n"
              "print(scratch_dir(sys.argv[1]), flush=True)\ntime.sleep(float(sys.argv[2]))")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    killed = subprocess.Popen([sys.executable, "-c", holder, "dflash-run-", "600"], stdout=subprocess.PIPE, text=True,
                              env=env)
    live = subprocess.Popen([sys.executable, "-c", holder, "dflash-plan-", "600"], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        dead_folder, live_folder = killed.stdout.readline().strip(), live.stdout.readline().strip()
        killed.kill()
        killed.wait()
        (tmp_path / "dflash-run-older-version").mkdir()  # no owner file: left alone
        (Path(dead_folder) / "part-00000.parquet").write_bytes(b"x" * 1000)
        said: list[str] = []
        assert sweep_scratch(said.append) >= 1000
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {Path(f).name for f in (mine, kept, live_folder)} | {"dflash-run-older-version"}
        assert len(said) == 1 and dead_folder in said[0] and "killed" in said[0]
        assert not (Path(kept) / OWNER_FILE).exists() and (Path(live_folder) / OWNER_FILE).exists()
    finally:
        live.kill()
        live.wait()


def test_a_staging_folder_names_its_owner_and_the_record_stays_off_the_store(remote, tmp_path, monkeypatch):
    from dflash_core.runtime.scratch import OWNER_FILE

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches TMPDIR
    with staged_run(remote, on_line=lambda _: None, every_s=3600) as local:
        assert Path(local).parent == tmp_path and json.loads((Path(local) / OWNER_FILE).read_text())["pid"] == os.getpid()
        (Path(local) / "metrics.jsonl").write_text('{"step": 0}\n')
    assert _names(fsspec.filesystem("memory"), remote) == ["metrics.jsonl"]


class _Uploads:
    """A RunMirror on a fake clock whose uploads are counted by file (the clock moves only when told)."""

    def __init__(self, remote: str, local: Path, monkeypatch, every_s: float = 1.0) -> None:
        self.now, self.count = 0.0, Counter()
        self.mirror = RunMirror(remote, str(local), every_s=every_s, clock=lambda: self.now)
        real = self.mirror.fs.put_file

        def counted(lpath, rpath, **kwargs):
            self.count[Path(lpath).relative_to(local).as_posix()] += 1
            return real(lpath, rpath, **kwargs)

        monkeypatch.setattr(self.mirror.fs, "put_file", counted)  # fsspec's memory filesystem is one instance

    def tick(self, final: bool = False) -> None:
        self.now += self.mirror.every_s
        self.mirror.push(final=final)


def _append(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as fh:
        fh.write(data)


def test_a_big_growing_file_is_pushed_at_a_bounded_rate_and_whole_at_a_checkpoint_and_at_the_end(
        remote, tmp_path, monkeypatch):
    """metrics.jsonl grows ~1.5 KB a step and each push re-uploads it whole: pushed every 30 s, a 200k-step run sent
    it ~1.3 TB. A big one now waits size / REPUSH_BYTES_PER_S seconds between periodic uploads; a small file (the
    log here) still goes every push; a checkpoint push and the final one send it as it is."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    metrics, log = local / "metrics.jsonl", local / "train.log"
    _append(metrics, b"x" * (10 * REPUSH_BYTES_PER_S))  # big with every_s = 1 s (over REPUSH_BYTES_PER_S x 1 s)
    uploads = _Uploads(remote, local, monkeypatch)
    uploads.mirror.push()  # t = 0: first push, everything
    for _ in range(20):  # t = 1..20 s: ~10 s between its uploads
        _append(metrics, b"m" * 1000)
        _append(log, b"a log line\n")
        uploads.tick()
    assert uploads.count["metrics.jsonl"] == 2 and uploads.count["train.log"] == 20  # at t = 0 and 11
    _append(metrics, b"m" * 1000)
    _checkpoint(local, 21)
    uploads.tick()  # t = 21: not due (10 s since t = 11), but it must reach the checkpoint sent
    assert fs.cat_file(f"{remote}/metrics.jsonl") == metrics.read_bytes()
    assert fs.exists(f"{remote}/checkpoints/step-21/meta.json")
    _append(metrics, b"m" * 1000)
    uploads.tick()
    assert uploads.count["metrics.jsonl"] == 3
    uploads.tick(final=True)  # the end of the launch (done, failed or stopped): nothing stays behind
    assert uploads.count["metrics.jsonl"] == 4 and fs.cat_file(f"{remote}/metrics.jsonl") == metrics.read_bytes()


def test_the_wandb_folder_goes_with_checkpoint_pushes_and_the_final_one_only(remote, tmp_path, monkeypatch):
    """W&B's offline run file grows ~5 KB a step (~1 GB at 200k steps) and only `wandb sync` reads it: pushed every
    30 s it cost more than metrics.jsonl."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    run_file = local / "wandb" / "offline-run-1" / "run-1.wandb"
    uploads = _Uploads(remote, local, monkeypatch)
    for _ in range(5):
        _append(run_file, b"w" * 100)  # small: the rate of big files is not what holds it back
        _append(local / "metrics.jsonl", b'{"step": 0}\n')
        uploads.tick()
    assert uploads.count["wandb/offline-run-1/run-1.wandb"] == 0 and uploads.count["metrics.jsonl"] == 5
    _checkpoint(local, 5)
    uploads.tick()
    assert fs.cat_file(f"{remote}/wandb/offline-run-1/run-1.wandb") == run_file.read_bytes()
    _append(run_file, b"w" * 100)
    uploads.tick()
    assert uploads.count["wandb/offline-run-1/run-1.wandb"] == 1
    uploads.tick(final=True)
    assert fs.cat_file(f"{remote}/wandb/offline-run-1/run-1.wandb") == run_file.read_bytes()


def test_the_end_of_a_staged_run_pushes_what_periodic_pushes_hold_back(remote, tmp_path):
    with staged_run(remote, on_line=lambda _: None, every_s=3600) as run_dir:
        _append(Path(run_dir) / "wandb" / "offline-run-1" / "run-1.wandb", b"w")
        _append(Path(run_dir) / "metrics.jsonl", b'{"step": 0}\n')
    assert _names(fsspec.filesystem("memory"), remote) == ["metrics.jsonl", "wandb/offline-run-1/run-1.wandb"]


def test_a_pull_brings_the_runs_wandb_logs_and_a_push_removes_a_folder_the_resume_dropped(remote, tmp_path):
    """A resume reads W&B's transaction logs for the steps W&B holds (monitor.sinks.wandb_steps): each launch
    folder's `run-<id>.wandb` of this run comes back, nothing else of wandb/ (media, debug logs: `wandb sync`'s,
    left on the store). A folder the resume removes (an empty log stops `wandb sync`) goes from the store too."""
    fs = fsspec.filesystem("memory")
    first = tmp_path / "first"
    wandb = first / "wandb"
    for folder, run_id, body in (("offline-run-20261206_010000-abc", "abc", b"log"),
                                 ("offline-run-20261206_020000-abc", "abc", b""),  # killed before its first record
                                 ("offline-run-20261206_020000-abc-1", "abc", b"log2"),  # a second in that second
                                 ("offline-run-20261206_010000-xabc", "xabc", b"x")):  # another run's
        (wandb / folder / "logs").mkdir(parents=True)
        (wandb / folder / "logs" / "debug.log").write_text("debug")
        (wandb / folder / f"run-{run_id}.wandb").write_bytes(body)
    (first / "wandb_run_id").write_text("abc\n")
    RunMirror(remote, str(first)).push(final=True)
    second = tmp_path / "second"
    second.mkdir()
    mirror = RunMirror(remote, str(second))
    assert mirror.pull() is None
    assert sorted(p.relative_to(second).as_posix() for p in (second / "wandb").rglob("*") if p.is_file()) == [
        "wandb/offline-run-20261206_010000-abc/run-abc.wandb", "wandb/offline-run-20261206_020000-abc-1/run-abc.wandb",
        "wandb/offline-run-20261206_020000-abc/run-abc.wandb"]  # not another run's (xabc), nor the debug logs
    assert (second / "wandb" / "offline-run-20261206_020000-abc-1" / "run-abc.wandb").read_bytes() == b"log2"
    assert mirror.push() == 0  # pulled, not sent back
    # the resume drops the empty one (monitor.sinks._drop_empty_offline_runs)
    (second / "wandb" / "offline-run-20261206_020000-abc" / "run-abc.wandb").unlink()
    (second / "wandb" / "offline-run-20261206_020000-abc").rmdir()
    mirror.push()
    left = _names(fs, remote)
    assert not any("offline-run-20261206_020000-abc/" in name for name in left)
    assert "wandb/offline-run-20261206_010000-abc/logs/debug.log" in left
    assert "wandb/offline-run-20261206_020000-abc-1/run-abc.wandb" in left


def test_a_pull_without_a_wandb_run_id_or_folder_brings_no_wandb_file(remote, tmp_path):
    first = tmp_path / "first"
    (first / "wandb" / "offline-run-1-abc").mkdir(parents=True)
    (first / "wandb" / "offline-run-1-abc" / "run-abc.wandb").write_bytes(b"log")
    RunMirror(remote, str(first)).push(final=True)
    second = tmp_path / "second"
    second.mkdir()
    RunMirror(remote, str(second)).pull()
    assert not (second / "wandb").exists()  # no wandb_run_id: no run to read W&B's steps of
    third = tmp_path / "third"
    (third / "x").mkdir(parents=True)
    (third / "wandb_run_id").write_text("abc")
    other = f"{remote}-2"
    RunMirror(other, str(third)).push(final=True)
    fourth = tmp_path / "fourth"
    fourth.mkdir()
    RunMirror(other, str(fourth)).pull()
    assert (fourth / "wandb_run_id").exists() and not (fourth / "wandb").exists()  # no wandb/ on the store
    fsspec.filesystem("memory").rm(other, recursive=True)


def test_a_pull_takes_the_newest_checkpoint_by_step_the_ledger_and_skips_a_wandb_folder_without_its_log(
        remote, tmp_path):
    """step-10 is newer than step-9 (not in name order); every older one comes as its meta.json (the next push
    would delete one that did not); the launch ledger comes back; a W&B folder whose push was cut off before its
    run file does not stop the pull."""
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{remote}/wandb_run_id", b"abc")
    fs.pipe(f"{remote}/launches.jsonl", b'{"launch": 1}\n')
    fs.pipe(f"{remote}/wandb/offline-run-1-abc/logs/debug.log", b"d")
    fs.pipe(f"{remote}/wandb/offline-run-2-abc/run-abc.wandb", b"log")
    for step in (2, 9, 10):
        fs.pipe(f"{remote}/checkpoints/step-{step}/meta.json", b"{}")
    mirror = RunMirror(remote, str(tmp_path))
    assert mirror.pull() == "checkpoints/step-10"
    assert (tmp_path / "launches.jsonl").read_bytes() == b'{"launch": 1}\n'
    assert all((tmp_path / "checkpoints" / f"step-{step}" / "meta.json").exists() for step in (2, 9))
    assert (tmp_path / "wandb" / "offline-run-2-abc" / "run-abc.wandb").read_bytes() == b"log"
    assert not (tmp_path / "wandb" / "offline-run-1-abc").exists()
    assert mirror.push(final=True) == 0  # nothing pulled is sent back, W&B's logs included
