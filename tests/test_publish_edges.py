"""Edges of publishing and locking outputs (dflash_core.publish, atomic_dir, io) that test_publish.py leaves out:
which inputs count as inside --out, what counts as this stage's folder, heartbeats that stop once the lock is no
longer theirs, locks on object stores, and the debris an exchange or a swap must not leave behind."""

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from dflash_core import atomic_dir
from dflash_core.publish import OutputError, OutputLockedError, check_output, output_lock, staged_output


def test_an_input_is_inside_out_only_under_it_not_beside_it_with_a_common_prefix(tmp_path: Path) -> None:
    out = tmp_path / "run"
    check_output(str(out), "plan", inputs={"--tokenized": str(tmp_path / "run2")})  # a sibling, not inside
    check_output(
        str(out), "plan", inputs={"--tokenized": f"memory://{tmp_path}/run"}
    )  # same path, other store
    with pytest.raises(OutputError, match="holds this stage's input --tokenized"):
        check_output(str(out), "plan", inputs={"--tokenized": str(out / "tok")})


def test_an_input_reached_through_a_symlinked_out_is_inside_it(tmp_path: Path) -> None:
    (tmp_path / "data" / "tok").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    with pytest.raises(OutputError, match="holds this stage's input --tokenized"):
        check_output(
            str(tmp_path / "link"),
            "plan",
            overwrite=True,
            inputs={"--tokenized": str(tmp_path / "data" / "tok")},
        )


def test_a_folder_written_before_markers_is_the_stages_only_with_all_its_own_files(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    out.mkdir()
    (out / "plan.json").write_text("{}")
    (out / "thesis.tex").write_text("years of work")
    own = ("plan.json", "summary.json")
    with pytest.raises(OutputError, match="not a `plan` output"):
        check_output(str(out), "plan", own)  # one of the plan's files is not enough
    (out / "summary.json").write_text("{}")
    check_output(str(out), "plan", own)


def test_an_existing_empty_folder_is_written_into(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    check_output(str(out), "plan", overwritable=False)
    with staged_output(str(out), "plan") as staging:
        Path(staging, "plan.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == [".dflash-stage.json", "plan.json"]


def _owner(**kw) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "stage": "plan", "since": time.time(), **kw}


@pytest.mark.parametrize("lock_now", ["another holder's", "deleted"])
def test_a_heartbeat_stops_once_its_lock_is_no_longer_its_own(
    tmp_path: Path, monkeypatch, lock_now: str
) -> None:
    """A lock taken over as stale, or deleted, must not be rewritten by its former holder's heartbeat (it would
    put back a lock naming a holder that no longer holds it)."""
    from dflash_core import publish

    monkeypatch.setattr(publish, "LOCK_HEARTBEAT_S", 0.01)
    lock = tmp_path / "out.lock"
    other = _owner(pid=1, host="gpu-node-7")
    if lock_now != "deleted":
        lock.write_text(json.dumps(other))
    beat = publish._Heartbeat(fsspec.filesystem("file"), str(lock), _owner())
    beat.start()
    beat.join(5)
    try:
        assert not beat.is_alive()  # it ended by itself
        assert (json.loads(lock.read_text()) == other) if lock_now != "deleted" else not lock.exists()
    finally:
        beat.stop()


def test_the_heartbeat_ends_with_the_block_that_holds_the_lock(tmp_path: Path) -> None:
    with output_lock(str(tmp_path / "out"), "plan"):
        assert [t for t in threading.enumerate() if t.name.startswith("heartbeat ")]
    assert not [t for t in threading.enumerate() if t.name.startswith("heartbeat ")]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_object_store_lock_refuses_a_second_writer_and_is_let_go() -> None:
    out = f"memory://locks-{uuid.uuid4().hex}/out"
    fs, root = fsspec.core.url_to_fs(out)
    with output_lock(out, "plan") as hold:
        assert hold is None  # no flock on an object store
        with pytest.raises(OutputLockedError, match="being written by another process"):
            check_output(out, "plan")
        with pytest.raises(OutputLockedError, match="being written by another process"):
            with output_lock(out, "plan"):
                pass
        assert json.loads(fs.cat(f"{root}.lock"))["pid"] == os.getpid()
    assert not fs.exists(f"{root}.lock")


def test_a_gone_writers_lock_held_by_its_processes_is_refused_at_once_without_a_wait_message(
    tmp_path: Path,
) -> None:
    from dflash_core.publish import join_hold

    out, lock = str(tmp_path / "run"), tmp_path / "run.lock"
    lock.write_text(json.dumps(_owner(stage="train", hold=True, left=time.time())))
    (tmp_path / "run.lock.hold").touch()
    fd = join_hold(str(tmp_path / "run.lock.hold"))  # a rank still running (another open file: another flock)
    assert fd is not None
    said: list[str] = []
    try:
        with pytest.raises(OutputLockedError, match="still running or stopping \\(the ranks"):
            with output_lock(out, "train", say=said.append):
                pass
        assert said == [] and lock.exists()
    finally:
        os.close(fd)
    with output_lock(out, "train", say=said.append):  # the rank has exited
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert said == [] and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_fresh_lock_of_another_users_live_process_is_not_taken_for_a_dead_ones(
    tmp_path: Path, monkeypatch
) -> None:
    def not_permitted(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    lock = tmp_path / "out.lock"
    lock.write_text(json.dumps(_owner(pid=424242)))
    monkeypatch.setattr(os, "kill", not_permitted)
    with pytest.raises(OutputLockedError, match="pid 424242"):
        with output_lock(str(tmp_path / "out"), "plan"):
            pass
    assert json.loads(lock.read_text())["pid"] == 424242


def test_a_local_swap_leaves_only_the_new_folder(tmp_path: Path) -> None:
    final = tmp_path / "promoted"
    for text in ("A", "B"):
        atomic_dir.replace_dir(str(final), lambda staged, text=text: _folder(staged, text))
    assert (final / "f.txt").read_text() == "B"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["promoted"]


def test_recover_after_the_new_folder_is_in_deletes_every_old_copy_and_keeps_the_new_one(
    tmp_path: Path,
) -> None:
    """A kill after the new folder was moved in, before the old one was deleted (or a second such kill): the
    new folder is whole and stays; the old copies are debris."""
    fs = fsspec.filesystem("file")
    final = tmp_path / "promoted"
    for name, text in (
        ("promoted", "new"),
        ("promoted.old-00000001", "old1"),
        ("promoted.old-00000002", "old2"),
    ):
        _folder(str(tmp_path / name), text)
    atomic_dir.recover(fs, str(final))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["promoted"]
    assert sorted(p.name for p in final.iterdir()) == ["f.txt"] and (final / "f.txt").read_text() == "new"


def _folder(folder: str, text: str) -> None:
    folder = folder.removeprefix("file://")  # replace_dir hands its writer a URI
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, "f.txt").write_text(text)


def test_join_uri_joins_under_any_root_with_one_slash_between_parts() -> None:
    from dflash_core.io import join_uri

    assert join_uri("s3://b/x/", "/y/", "z.json") == "s3://b/x/y/z.json"
    assert join_uri("/r", "a/") == "/r/a"


def test_write_jsonl_writes_utf8_text_and_gzip_without_a_timestamp(tmp_path: Path) -> None:
    import gzip

    from dflash_core.io import write_jsonl

    plain = write_jsonl(str(tmp_path / "a.jsonl"), [{"b": "é", "a": 1}], sort_keys=True)
    assert Path(plain).read_bytes() == '{"a": 1, "b": "é"}\n'.encode()
    packed = Path(write_jsonl(str(tmp_path / "a.jsonl.gz"), [{"b": "é"}], gz=True)).read_bytes()
    assert packed[4:8] == b"\0\0\0\0"  # gzip's mtime field: same records, same bytes
    assert gzip.decompress(packed) == '{"b": "é"}\n'.encode()


def test_a_local_path_is_told_from_a_hub_id(tmp_path: Path) -> None:
    from dflash_core.io import expand_home, looks_local, missing_local_folder

    assert expand_home("file://~/models") == os.path.expanduser("~/models")
    assert expand_home("s3://b/~x") == "s3://b/~x"
    assert not looks_local("Qwen/Qwen3-8B")
    assert all(looks_local(p) for p in ("org/name/sub", "name/", "C:\\models\\q", "./q", "~/q", "file:///q"))
    (tmp_path / "weights.bin").write_text("x")
    assert missing_local_folder(str(tmp_path / "weights.bin"))  # a file is no model folder
    assert not missing_local_folder(str(tmp_path)) and not missing_local_folder("Qwen/Qwen3-8B")


def test_a_rerun_published_by_exchange_leaves_no_copy_of_the_old_folder_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for text in ("old", "new"):
        with staged_output(str(out), "tokenize") as staging:
            Path(staging, "part.parquet").write_text(text)
    assert (out / "part.parquet").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old shards are not kept (disk)


def test_mark_stage_marks_a_folder_as_the_stage_that_now_writes_it(tmp_path: Path) -> None:
    from dflash_core.publish import mark_stage, stage_of

    out = str(tmp_path / "run")
    assert stage_of(out) is None
    mark_stage(out, "tokenize")
    mark_stage(out, "train")
    assert stage_of(out) == "train"
    check_output(out, "train", overwritable=False)


def test_being_written_and_lock_holder_see_only_a_live_holder(tmp_path: Path) -> None:
    from dflash_core.publish import being_written, join_hold, lock_holder

    out, lock = str(tmp_path / "run"), tmp_path / "run.lock"
    assert not being_written(out) and lock_holder(out) is None
    with output_lock(out, "train") as hold:
        assert being_written(out) and lock_holder(out).startswith(f"pid {os.getpid()} on ")
        fd = join_hold(hold)
    try:  # the holder let go; a process it started still runs: nobody writes the output any more
        assert json.loads(lock.read_text())["left"] > 0
        assert not being_written(out)
    finally:
        os.close(fd)


def test_a_fresh_lock_from_another_host_is_live_whatever_pids_run_here(tmp_path: Path) -> None:
    lock = tmp_path / "out.lock"
    lock.write_text(json.dumps(_owner(pid=2**22 + 7, host="gpu-node-7")))  # no such pid on this host
    with pytest.raises(OutputLockedError, match="on gpu-node-7"):
        with output_lock(str(tmp_path / "out"), "plan"):
            pass


def test_a_damaged_stage_marker_names_no_stage(tmp_path: Path) -> None:
    from dflash_core.publish import STAGE_MARKER, stage_of

    out = tmp_path / "out"
    out.mkdir()
    (out / STAGE_MARKER).write_text('{"stage": "pl')
    assert stage_of(str(out)) is None
    with pytest.raises(OutputError, match="not a `plan` output"):
        check_output(str(out), "plan")


def test_replace_dir_first_clears_what_a_killed_swap_left(tmp_path: Path) -> None:
    _folder(str(tmp_path / "promoted.old-00000001"), "old")  # killed between its two moves
    _folder(str(tmp_path / "promoted.staged-00000002"), "half")  # killed while writing
    atomic_dir.replace_dir(str(tmp_path / "promoted"), lambda staged: _folder(staged, "new"))
    assert (tmp_path / "promoted" / "f.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["promoted"]


def test_an_out_whose_parent_is_not_writable_is_refused_before_any_work(tmp_path: Path, monkeypatch) -> None:
    parent = tmp_path / "read-only"
    monkeypatch.setattr(os, "access", lambda path, mode: not (str(path) == str(parent) and mode == os.W_OK))
    with pytest.raises(OutputError, match="read-only is not writable"):  # the check runs as root here too
        check_output(str(parent / "out"), "plan")
