"""What a mutation audit of dflash_core/runtime/run_mirror.py found unpinned: the exact upload-rate thresholds,
meta.json last, checkpoints pruned during a push, the store's checkpoints a push deletes and keeps, folders swapped
in whole, stores that list folders with a trailing slash, and what staged_run hands its mirror and says."""

import json
import os
import tempfile
import threading
from pathlib import Path

import fsspec
import pytest
from test_runtime_mirror import _append, _checkpoint, _names, _Uploads, remote  # noqa: F401 - remote: the fixture

from dflash_core.runtime.run_mirror import MirrorError, RunMirror, staged_run
from dflash_core.runtime.scratch import OWNER_FILE

# The documented budget (REPUSH_BYTES_PER_S = 128 KiB/s) over the default 30 s between pushes: 3.75 MiB.
SMALL_AT_30_S = 30 * 128 * 1024


def test_a_file_of_every_s_times_the_rate_goes_with_every_push_and_a_bigger_one_waits_size_over_the_rate(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """Up to 3.75 MiB (30 s x 128 KiB/s) a changed file is uploaded by each push, even one at the same instant;
    a 7.5 MiB one is uploaded again only once 60 s (7.5 MiB / 128 KiB/s) have passed since its last upload."""
    local = tmp_path / "staging"
    log, metrics = local / "train.log", local / "metrics.jsonl"
    _append(log, b"l" * (SMALL_AT_30_S - 10))
    _append(metrics, b"m" * (2 * SMALL_AT_30_S - 10))
    uploads = _Uploads(remote, local, monkeypatch, every_s=30.0)
    uploads.mirror.push()  # t = 0: both sent
    _append(log, b"l" * 10)  # exactly 3.75 MiB
    _append(metrics, b"m" * 10)  # exactly 7.5 MiB: 60 s of the budget
    uploads.mirror.push()  # still t = 0
    assert uploads.count["train.log"] == 2 and uploads.count["metrics.jsonl"] == 1
    uploads.now = 30.0
    uploads.mirror.push()
    assert uploads.count["metrics.jsonl"] == 1
    uploads.now = 60.0
    uploads.mirror.push()
    assert uploads.count["metrics.jsonl"] == 2


def test_each_checkpoint_file_is_uploaded_before_its_meta_json(remote, tmp_path, monkeypatch):  # noqa: F811
    """A reader takes a checkpoint on the store as complete once its meta.json is there: it goes last, after the
    weights and train state (meta.json sorts before both)."""
    local = tmp_path / "staging"
    _checkpoint(local, 2)
    mirror = RunMirror(remote, str(local))
    order: list[str] = []
    real = mirror.fs.put_file

    def recorded(lpath, rpath, **kwargs):
        order.append(Path(lpath).name)
        return real(lpath, rpath, **kwargs)

    monkeypatch.setattr(mirror.fs, "put_file", recorded)
    assert mirror.push() == 3
    assert order == ["model.safetensors", "train_state.pt", "meta.json"]


def test_a_checkpoint_pruned_while_it_uploads_never_gets_its_meta_json_on_the_store(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """The run prunes a checkpoint (rmtree) while the push uploads it: its weights vanish before its meta.json does.
    The push goes on with the others and does not send that meta.json, which would make a half-uploaded
    checkpoint look complete."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    _checkpoint(local, 2)
    _checkpoint(local, 4)
    mirror = RunMirror(remote, str(local))
    real = mirror.fs.put_file

    def pruned_meanwhile(lpath, rpath, **kwargs):
        if lpath.endswith("step-2/model.safetensors"):
            Path(lpath).unlink()  # rmtree got this far: meta.json is still there
        return real(lpath, rpath, **kwargs)

    monkeypatch.setattr(mirror.fs, "put_file", pruned_meanwhile)
    mirror.push()
    assert not fs.exists(f"{remote}/checkpoints/step-2/meta.json")
    assert {"checkpoints/step-4/meta.json", "checkpoints/step-4/model.safetensors"} <= set(_names(fs, remote))


def test_a_checkpoint_pruned_right_after_the_push_listed_it_is_skipped(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """The push lists the complete checkpoints first; one the run prunes before the push looks at it is passed
    over, not an error."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    _checkpoint(local, 2)
    _checkpoint(local, 4)
    mirror = RunMirror(remote, str(local))
    real = mirror._complete_steps

    def listed_then_pruned() -> list[int]:
        steps = real()
        for path in (local / "checkpoints" / "step-2").iterdir():
            path.unlink()
        (local / "checkpoints" / "step-2").rmdir()
        return steps

    monkeypatch.setattr(mirror, "_complete_steps", listed_then_pruned)
    assert mirror.push() == 3
    assert _names(fs, remote) == ["checkpoints/step-4/meta.json", "checkpoints/step-4/model.safetensors",
                                  "checkpoints/step-4/train_state.pt"]


def test_a_file_removed_before_its_upload_is_not_counted_and_does_not_fail_the_push(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """W&B writes and removes files of its own in wandb/: one gone by the time the push uploads it is skipped."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    _append(local / "metrics.jsonl", b'{"step": 0}\n')
    _append(local / "wandb" / "offline-run-1-abc" / "tmp-1.json", b"{}")
    mirror = RunMirror(remote, str(local))
    real = mirror.fs.put_file

    def removed_meanwhile(lpath, rpath, **kwargs):
        if lpath.endswith("tmp-1.json"):
            Path(lpath).unlink()
        return real(lpath, rpath, **kwargs)

    monkeypatch.setattr(mirror.fs, "put_file", removed_meanwhile)
    assert mirror.push(final=True) == 1
    assert _names(fs, remote) == ["metrics.jsonl"]


def test_the_debris_of_local_swaps_and_a_file_vanishing_as_the_push_lists_it_stay_off_the_store(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """A swap's staged folder and journal (atomic_dir) are never mirrored; a file removed between the listing and
    its look-up is passed over."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    _append(local / "metrics.jsonl", b'{"step": 0}\n')
    _append(local / "drafter.staged-1a2b" / "config.json", b"{}")
    _append(local / "drafter.swap.json", b"{}")
    _append(local / "train.log", b"line\n")
    mirror = RunMirror(remote, str(local))
    real = mirror._changed

    def vanishing(rel: str):
        if rel == "train.log":
            (local / rel).unlink()
        return real(rel)

    monkeypatch.setattr(mirror, "_changed", vanishing)
    assert mirror.push(final=True) == 1
    assert _names(fs, remote) == ["metrics.jsonl"]


def test_a_push_without_a_complete_local_checkpoint_leaves_the_stores_checkpoints_alone(
        remote, tmp_path):  # noqa: F811
    """Before the run saves its first checkpoint, a push deletes nothing of checkpoints/ on the store (a cut-off
    one included): only a checkpoint sent tells which of the store's are the run's older ones."""
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{remote}/checkpoints/step-1/model.safetensors", b"cut")
    local = tmp_path / "staging"
    _append(local / "metrics.jsonl", b'{"step": 0}\n')
    assert RunMirror(remote, str(local)).push() == 1
    assert fs.exists(f"{remote}/checkpoints/step-1/model.safetensors")


def test_a_push_deletes_the_stores_older_cut_off_checkpoints_and_keeps_newer_ones(
        remote, tmp_path):  # noqa: F811
    """A checkpoint older than the newest one sent and not the run's own goes (a cut-off step-3 between the run's
    step-2 and step-4); a newer one stays (step-9: another launch of the run, still pushing, may have sent it)."""
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{remote}/checkpoints/step-3/model.safetensors", b"cut")
    fs.pipe(f"{remote}/checkpoints/step-9/meta.json", b"{}")
    local = tmp_path / "staging"
    _checkpoint(local, 2)
    _checkpoint(local, 4)
    RunMirror(remote, str(local)).push()
    steps = {name.split("/")[1] for name in _names(fs, remote)}
    assert steps == {"step-2", "step-4", "step-9"}


def test_a_folder_swapped_in_whole_goes_again_only_when_a_file_of_it_changed_and_then_all_of_it(
        remote, tmp_path):  # noqa: F811
    """drafter/ unchanged is not uploaded again; one file of it rewritten (same size, newer mtime) sends the whole
    folder again, every file of it counted."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    (local / "drafter").mkdir(parents=True)
    (local / "drafter" / "config.json").write_text('{"a": 1}')
    (local / "drafter" / "model.safetensors").write_bytes(b"weights")
    mirror = RunMirror(remote, str(local))
    assert mirror.push() == 2
    assert mirror.push() == 0
    config = local / "drafter" / "config.json"
    mtime = config.stat().st_mtime_ns
    config.write_text('{"a": 2}')
    os.utime(config, ns=(mtime + 10**9, mtime + 10**9))
    assert mirror.push() == 2
    assert fs.cat_file(f"{remote}/drafter/config.json") == b'{"a": 2}'
    assert fs.cat_file(f"{remote}/drafter/model.safetensors") == b"weights"


def test_a_file_of_a_whole_folder_rewritten_while_the_folder_uploads_goes_with_the_next_push(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """What a push records as sent is each file as it was before its upload: a drafter/ file the run rewrites
    meanwhile is seen as changed by the next push, which sends the folder again."""
    fs = fsspec.filesystem("memory")
    local = tmp_path / "staging"
    _append(local / "drafter" / "config.json", b"{}")
    _append(local / "drafter" / "model.safetensors", b"old weights")
    mirror = RunMirror(remote, str(local))
    real = mirror.fs.put_file

    def rewritten_meanwhile(lpath, rpath, **kwargs):
        real(lpath, rpath, **kwargs)
        if lpath.endswith("model.safetensors") and fs.cat_file(rpath) == b"old weights":
            _append(Path(lpath), b", then new ones")

    monkeypatch.setattr(mirror.fs, "put_file", rewritten_meanwhile)  # the swap writes through the same instance
    mirror.push()
    mirror.push()
    assert fs.cat_file(f"{remote}/drafter/model.safetensors") == b"old weights, then new ones"


def test_a_pull_into_a_fresh_folder_from_a_file_uri_store_creates_the_folders_it_fills(tmp_path):
    """The local copy of a checkpoint lands in folders the pull creates (a store's get_file need not make them)."""
    store, local = tmp_path / "store", tmp_path / "staging"
    _checkpoint(store, 2)
    _checkpoint(store, 4)
    local.mkdir()
    assert RunMirror(f"file://{store}", str(local)).pull() == "checkpoints/step-4"
    assert (local / "checkpoints" / "step-2" / "meta.json").exists()
    assert (local / "checkpoints" / "step-4" / "model.safetensors").read_bytes() == b"w" * 4


def test_a_store_that_lists_folders_with_a_trailing_slash_is_pulled_the_same(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """Some stores (gcsfs) list a folder as `name/`: the checkpoints and W&B launch folders are still found."""
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{remote}/wandb_run_id", b"abc")
    fs.pipe(f"{remote}/wandb/offline-run-1-abc/run-abc.wandb", b"log")
    for step in (2, 10):
        fs.pipe(f"{remote}/checkpoints/step-{step}/meta.json", b"{}")
    mirror = RunMirror(remote, str(tmp_path))
    real = mirror.fs.ls

    def slashed(path, detail=False, **kwargs):
        return [p + "/" if fs.isdir(p) else p for p in real(path, detail=detail, **kwargs)]

    monkeypatch.setattr(mirror.fs, "ls", slashed)
    assert mirror.pull() == "checkpoints/step-10"
    assert (tmp_path / "checkpoints" / "step-2" / "meta.json").exists()
    assert (tmp_path / "wandb" / "offline-run-1-abc" / "run-abc.wandb").read_bytes() == b"log"


def test_a_pull_takes_wandb_logs_from_this_runs_launch_folders_only(remote, tmp_path):  # noqa: F811
    """A W&B folder not named as a launch of the run (`latest-run`, a copy of W&B's link that a sync tool made)
    is left on the store even when it holds the run's log: the resume would count those steps twice."""
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{remote}/wandb_run_id", b"abc")
    fs.pipe(f"{remote}/wandb/offline-run-1-abc/run-abc.wandb", b"log")
    fs.pipe(f"{remote}/wandb/latest-run/run-abc.wandb", b"log")
    RunMirror(remote, str(tmp_path)).pull()
    assert sorted(p.name for p in (tmp_path / "wandb").iterdir()) == ["offline-run-1-abc"]


def test_a_file_uri_run_folder_is_handed_to_the_ranks_as_a_path(tmp_path):
    with staged_run(f"file://{tmp_path}/run") as run_dir:
        assert run_dir == f"{tmp_path}/run"


def test_a_staged_run_pulls_this_nodes_log_and_says_which_checkpoint_it_resumes_from(
        remote, tmp_path):  # noqa: F811
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{remote}/train.node-1.log", b"node 1 before\n")
    fs.pipe(f"{remote}/checkpoints/step-3/meta.json", b"{}")
    lines: list[str] = []
    with staged_run(remote, lines.append, log_name="train.node-1.log", every_s=3600) as run_dir:
        assert (Path(run_dir) / "train.node-1.log").read_bytes() == b"node 1 before\n"
    assert lines[0].endswith("(resuming from its checkpoints/step-3)")


@pytest.mark.parametrize("failure", [OSError("the store is down"), KeyboardInterrupt("stopped")])
def test_a_failed_or_interrupted_pull_leaves_no_staging_folder(
        remote, tmp_path, monkeypatch, failure):  # noqa: F811
    def unreachable(self) -> str | None:
        raise failure

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches TMPDIR
    monkeypatch.setattr(RunMirror, "pull", unreachable)
    with pytest.raises(type(failure)):
        with staged_run(remote, lambda _: None, every_s=3600):
            pass
    assert list(tmp_path.iterdir()) == []


def test_a_final_push_that_fails_once_is_not_retried_and_the_staging_folder_is_disowned(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """Only a signal makes the final push run again; a store error keeps the staging folder, without the owner
    record by which a later launch's sweep would delete it."""
    calls: list[bool] = []
    real = RunMirror.push

    def fails_once(self, final: bool = False) -> int:
        calls.append(final)
        if len(calls) == 1:
            raise OSError("the store is down")
        return real(self, final)

    with pytest.raises(MirrorError, match="kept in"):
        with staged_run(remote, lambda _: None, every_s=3600) as run_dir:
            (Path(run_dir) / "metrics.jsonl").write_text("{}\n")
            monkeypatch.setattr(RunMirror, "push", fails_once)
    assert calls == [True]
    assert (Path(run_dir) / "metrics.jsonl").exists() and not (Path(run_dir) / OWNER_FILE).exists()


def test_a_final_push_interrupted_twice_keeps_the_staging_folder_and_names_it(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """A signal during the final push runs it again; a second one during that run stops it, and the staging folder
    (what the store may lack) is kept without its owner record, so a later launch's sweep cannot delete it."""
    def interrupted(self, final: bool = False) -> int:
        raise KeyboardInterrupt("stopped")

    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with staged_run(remote, lines.append, every_s=3600) as run_dir:
            (Path(run_dir) / "metrics.jsonl").write_text("{}\n")
            monkeypatch.setattr(RunMirror, "push", interrupted)
    assert (Path(run_dir) / "metrics.jsonl").exists() and not (Path(run_dir) / OWNER_FILE).exists()
    assert f"kept in {run_dir}" in lines[-1] and "interrupted twice" in lines[-1]


def test_periodic_pushes_are_not_final_and_their_failures_are_said_once(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """While the ranks run the mirror pushes what is due (not everything), with the staged run's every_s as the
    period its upload rate is measured over; a store that fails several pushes in
    a row gets one warning, not one each time."""
    calls: list[bool] = []
    every: set[float] = set()
    three_failed = threading.Event()
    real = RunMirror.push

    def flaky(self, final: bool = False) -> int:
        calls.append(final)
        every.add(self.every_s)
        if not final and len(calls) <= 3:
            if len(calls) == 3:
                three_failed.set()
            raise OSError("the store hiccups")
        return real(self, final)

    monkeypatch.setattr(RunMirror, "push", flaky)
    lines: list[str] = []
    with staged_run(remote, lines.append, every_s=0.01) as run_dir:
        (Path(run_dir) / "metrics.jsonl").write_text('{"step": 0}\n')
        assert three_failed.wait(60)
    assert calls[:3] == [False, False, False] and calls[-1] is True and every == {0.01}
    assert sum("warning: pushing the run folder" in line for line in lines) == 1
    assert json.loads(fsspec.filesystem("memory").cat_file(f"{remote}/metrics.jsonl")) == {"step": 0}


def test_a_store_that_answers_file_not_found_to_an_upload_fails_the_push_and_the_run_is_kept(
        remote, tmp_path, monkeypatch):  # noqa: F811
    """s3fs and gcsfs answer an upload into a bucket that does not exist with FileNotFoundError. The mirror took it
    for a local file pruned during its upload: every push sent nothing and said nothing, and the end of the launch
    deleted the staging folder, the whole run with it. The push fails instead, and the staging folder is kept."""
    store = fsspec.filesystem("memory")

    def no_such_bucket(lpath, rpath, **kwargs):
        raise FileNotFoundError(f"NoSuchBucket: {rpath}")

    local = tmp_path / "staging"
    _checkpoint(local, 2)
    mirror = RunMirror(remote, str(local))
    monkeypatch.setattr(mirror.fs, "put_file", no_such_bucket)  # fsspec's memory filesystem is one instance
    with pytest.raises(MirrorError, match="uploading checkpoints/step-2/model.safetensors .*NoSuchBucket"):
        mirror.push()
    monkeypatch.undo()
    with pytest.raises(MirrorError, match="final push .* failed .*NoSuchBucket"):
        with staged_run(remote, lambda _: None, every_s=3600) as run_dir:
            (Path(run_dir) / "metrics.jsonl").write_text('{"step": 0}\n')
            monkeypatch.setattr(store, "put_file", no_such_bucket)
    assert (Path(run_dir) / "metrics.jsonl").exists()
