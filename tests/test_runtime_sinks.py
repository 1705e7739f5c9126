"""Metric sinks: metrics.jsonl append/resume semantics, W&B offline with grad_norm summarised by max."""

import json
import math
import os
import struct
import time
import uuid

import fsspec
import pytest
from fsspec.implementations.local import LocalFileOpener

from dflash_core.monitor.config import WandbConfig
from dflash_core.monitor.sinks import (
    JsonlSink,
    MultiSink,
    NullSink,
    WandbSink,
    check_metrics_file,
    scrub_secrets,
    wandb_mode,
)

MAX_READ = 1 << 20  # what one read of a metrics.jsonl reader may ask for, however long the file


def _rec(step: int, **extra) -> dict:
    return {"step": step, "loss": 1.0 / (step + 1), "grad_norm": 0.5, "clipped": False, "clip": 1.0,
            "nonfinite": False, **extra}


def _write_metrics(folder, steps: int, val_every: int | None = None) -> None:
    """<folder>/metrics.jsonl of `steps` steps, a validation record after every `val_every`-th."""
    jsonl = JsonlSink(str(folder / "metrics.jsonl"))
    for step in range(steps):
        jsonl.log(_rec(step))
        if val_every and step % val_every == val_every - 1:
            jsonl.log({"kind": "val", "step": step, "val_loss": 2.0})
    jsonl.close()


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in open(path)]


def long_metrics(steps: int) -> list[bytes]:
    """The lines of a run's metrics.jsonl: `steps` records of ~1 KB (a real one is ~1.5 KB) and a validation record
    after every 100th step."""
    lines = []
    for s in range(steps):
        lines.append(_rec(s, acc_by_slot=[0.7 - s / 1e5] * 15, weight_by_slot=[1 / 15 + s / 1e7] * 15,
                          tokens_per_s=20_000.5, tflops=210.25, mfu=0.21, time=1_700_000_000.0 + s))
        if s % 100 == 99:
            lines.append({"kind": "val", "step": s, "val_loss": 1.5, "val_acc_by_slot": [0.6] * 15,
                          "val_accept_len": 3.0 + s / 1e4, "time": 1_700_000_000.5 + s})
    return [json.dumps(line).encode() + b"\n" for line in lines]


def refuse_big_reads(monkeypatch) -> None:
    """fsspec's local files refuse a read of more than MAX_READ bytes, and read() of all that is left."""
    read = LocalFileOpener.read

    def bounded(self, size=-1):
        assert size is not None and 0 <= size <= MAX_READ, f"read({size}) of {self.path}: the whole file at once"
        return read(self, size)

    monkeypatch.setattr(LocalFileOpener, "read", bounded)


def test_jsonl_flushes_each_step_and_writes_nan_as_null(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(str(path))
    sink.log(_rec(0, loss=math.nan, grad_norm=math.inf, loss_by_bucket={"1": math.nan}))
    line = json.loads(path.read_text())  # visible before close: flushed per step
    assert line["loss"] is None and line["grad_norm"] is None and line["loss_by_bucket"] == {"1": None}
    sink.close()


def test_jsonl_resume_replaces_the_records_of_the_steps_it_runs_again(tmp_path):
    """Resumed at step 3 (its checkpoint), a run re-executes steps 3 and 4: the interrupted run's records of them
    are dropped and the new ones written, once each; W&B is told the steps it already has. Opened without a
    resume step (a reader, the same run), nothing is dropped or written twice."""
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(str(path))
    for s in range(5):
        first.log(_rec(s))
    first.close()
    before = path.read_text().splitlines(keepends=True)
    resumed = JsonlSink(str(path), resumed_at=3)
    assert resumed.steps_written == {0, 1, 2} and resumed.last_steps() == {"train": 4}
    assert path.read_text() == "".join(before[:3])  # rewritten before the first new step
    for s in range(3, 8):
        resumed.log(_rec(s, loss=99.0))
    resumed.close()
    assert path.read_text().startswith("".join(before[:3]))
    assert _steps(path) == list(range(8))
    assert [json.loads(line)["loss"] for line in open(path)][3] == 99.0  # the step the final weights went through
    again = JsonlSink(str(path))
    again.log(_rec(7, loss=1.0))
    again.close()
    assert _steps(path) == list(range(8))


def test_jsonl_cuts_a_partial_last_line_from_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_rec(0)) + "\n" + json.dumps(_rec(1)) + "\n" + '{"step": 2, "lo')
    sink = JsonlSink(str(path))
    sink.log(_rec(2))
    sink.close()
    assert _steps(path) == [0, 1, 2]


def test_jsonl_names_the_file_and_line_of_a_corrupt_record_and_keeps_the_file(tmp_path):
    """A bad line in the middle (not a crash's incomplete last line) is refused, naming the file and the line,
    before anything is dropped; check_metrics_file (the launcher's check before torchrun) says the same."""
    from dflash_core.monitor.sinks import check_metrics_file
    from dflash_core.monitor.sources import MetricsError

    path = tmp_path / "metrics.jsonl"
    text = json.dumps(_rec(0)) + "\n" + '{"step": 1, "loss": \x01}' + "\n" + json.dumps(_rec(2)) + "\n"
    path.write_text(text)
    for opened in (lambda: JsonlSink(str(path), resumed_at=1), lambda: check_metrics_file(str(path))):
        with pytest.raises(MetricsError, match=rf"^{path}, line 2: not valid JSON \(.*\); fix or delete that line"):
            opened()
    assert path.read_text() == text
    path.write_text(json.dumps(_rec(0)) + "\n" + '{"loss": 1.0}' + "\n")
    with pytest.raises(MetricsError, match=r"line 2: not a metrics record \(no integer 'step'\)"):
        check_metrics_file(str(path))
    path.write_text(json.dumps(_rec(0)) + "\n" + '{"step": 1, "lo')  # a crash mid-write: fine, as the sink
    check_metrics_file(str(path))
    check_metrics_file(str(tmp_path / "none.jsonl"))


def test_jsonl_resume_reads_a_long_file_a_chunk_at_a_time(tmp_path, monkeypatch):
    """Rank 0 resumes a long run with the models loaded, after the launcher's check: both read metrics.jsonl a
    bounded chunk at a time, never whole (at 200,000 steps, 306 MB, they held 2.4 and 1.9 GB of records), and the
    sink cuts the file in place where the steps after the checkpoint start (the kept bytes are not copied)."""
    lines = long_metrics(4000)  # ~3 MB
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(lines) + b'{"step": 4000, "lo')  # killed in the middle of a write
    assert path.stat().st_size > 2 * MAX_READ
    refuse_big_reads(monkeypatch)
    check_metrics_file(str(path))
    inode = path.stat().st_ino
    sink = JsonlSink(str(path), resumed_at=3000)
    first_dropped = next(i for i, line in enumerate(lines) if json.loads(line)["step"] >= 3000)
    assert path.read_bytes() == b"".join(lines[:first_dropped]) and path.stat().st_ino == inode
    assert sink.steps_written == set(range(3000)) and sink.last_steps() == {"train": 3999, "val": 3999}
    assert sink.kept_record("train") == json.loads(lines[first_dropped - 2])  # then step 2999's validation
    assert sink.kept_record("val") == json.loads(lines[first_dropped - 1])
    sink.log(_rec(3000))
    sink.log(_rec(2999))  # already there
    sink.close()
    assert _steps(path)[-3:] == [2999, 2999, 3000]


@pytest.mark.parametrize("store", ["local", "memory"])
@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (0, 1, 5, None, 2)], ids=["in-order", "out-of-order"])
def test_jsonl_resume_keeps_each_earlier_step_wherever_it_is(tmp_path, store, order):
    """Dropped records are not always the file's end (a blank line, a record after a dropped one): the kept ones
    are copied in their order beside it; an object store, which can neither truncate nor rename, gets the kept
    records uploaded over the file in either case."""
    uri = str(tmp_path / "metrics.jsonl") if store == "local" else f"memory://sink-{uuid.uuid4().hex[:8]}/m.jsonl"
    lines = {s: json.dumps(_rec(s)) + "\n" for s in range(6)}
    with fsspec.open(uri, "w") as fh:
        fh.write("".join(lines[s] if s is not None else "\n" for s in order))
    try:
        sink, new = JsonlSink(uri, resumed_at=3), _rec(3, loss=9.0)
        sink.log(new)
        sink.close()
        with fsspec.open(uri, "r") as fh:
            assert fh.read() == lines[0] + lines[1] + lines[2] + json.dumps(new, separators=(",", ":")) + "\n"
        assert sink.last_steps() == {"train": max(s for s in order if s is not None)}
    finally:
        if store == "memory":
            fsspec.filesystem("memory").rm(uri.rsplit("/", 1)[0], recursive=True)


def test_jsonl_on_memory_filesystem():
    sink = JsonlSink("memory://runs/x/metrics.jsonl")
    sink.log(_rec(0))
    sink.close()
    again = JsonlSink("memory://runs/x/metrics.jsonl")
    assert again.steps_written == {0}
    again.close()


def test_wandb_mode_is_offline_without_key(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(WandbConfig(mode="online")) == "offline"
    assert wandb_mode(WandbConfig(enabled=False)) == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode(WandbConfig(mode="online")) == "online"
    assert wandb_mode(WandbConfig(mode="offline")) == "offline"


def test_scrub_secrets_drops_keys_and_values(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-value-123")
    cfg = {"wandb": {"api_key": "x", "project": "p"}, "note": "uses secret-value-123", "lr": 1e-3}
    assert scrub_secrets(cfg) == {"wandb": {"project": "p"}, "note": "<redacted>", "lr": 1e-3}


@pytest.mark.slow
def test_wandb_offline_run_keeps_grad_norm_max_and_config(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    # a resumed run: step 0 is already in metrics.jsonl (and W&B), so it is not logged again
    sink = WandbSink(WandbConfig(mode="offline", project="t"), {"train": {"lr": 0.1}}, str(tmp_path), 0)
    for s, g in enumerate([9.0, 7.0, 2.0]):
        sink.log(_rec(s, grad_norm=g, queue_depth={"prefetch": 2, "target": 1}, acc_by_slot=[0.5, 0.25]))
    run = sink.run
    assert run.config["train"]["lr"] == 0.1
    assert dict(run.summary["grad_norm"]) == {"max": 7.0}  # max, not the last value
    sink.close()
    assert (tmp_path / "wandb_run_id").exists()
    assert any(p.name.startswith("offline-run") for p in (tmp_path / "wandb").iterdir())


def test_multisink_closes_all_even_if_one_fails():
    closed = []

    class Boom(NullSink):
        def close(self):
            raise OSError("disk full")

    class Track(NullSink):
        def close(self):
            closed.append(True)

    with pytest.raises(OSError):
        MultiSink([Boom(), Track()]).close()
    assert closed == [True]
    assert os.environ.get("WANDB_MODE") == "offline"  # conftest keeps tests offline


class _FakeRun:
    """What WandbSink uses of a wandb run; `fail_log` makes run.log raise (W&B's service gone mid-run)."""

    resumed = False
    summary: dict = {}

    def __init__(self, fail_log: bool = False):
        self.logged, self.finished, self.fail_log = [], False, fail_log

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, row):
        if self.fail_log:
            raise BrokenPipeError("wandb service process is gone")
        self.logged.append(row)

    def finish(self):
        self.finished = True


def _warnings(caplog) -> list[str]:
    """The sink's own warnings (W&B logs its own too)."""
    return [r.getMessage() for r in caplog.records if r.name == "dflash_core.monitor.sinks"]


def _fake_init(monkeypatch, fail_modes: tuple[str, ...], run: _FakeRun | None = None) -> list[dict]:
    """wandb.init raising CommError in `fail_modes` (a server out of reach), else returning `run`; the calls."""
    import wandb

    calls: list[dict] = []

    def init(**kwargs):
        calls.append(kwargs)
        if kwargs["mode"] in fail_modes:
            raise wandb.errors.CommError("Failed to get resume status for run x: context deadline exceeded")
        return run or _FakeRun()

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "teardown", lambda *a, **k: None)
    return calls


def test_wandb_online_out_of_reach_falls_back_to_offline_with_one_warning(tmp_path, monkeypatch, caplog):
    """W&B online but unreachable failed `dflash train` before step 0 (CommError out of WandbSink.__init__, after
    W&B's 90 s init timeout). Now: a bounded wait, one warning naming the cause, the run logged offline."""
    from dflash_core.monitor.sinks import WANDB_INIT_TIMEOUT_S

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    run = _FakeRun()
    calls = _fake_init(monkeypatch, ("online",), run)
    with caplog.at_level("WARNING", logger="dflash_core.monitor.sinks"):
        sink = WandbSink(WandbConfig(mode="online"), {}, str(tmp_path))
    assert [c["mode"] for c in calls] == ["online", "offline"] and sink.mode == "offline"
    assert calls[0]["id"] == calls[1]["id"] == (tmp_path / "wandb_run_id").read_text()  # one run, synced later
    assert calls[0]["settings"].init_timeout == WANDB_INIT_TIMEOUT_S < 90
    [warning] = _warnings(caplog)
    assert "W&B unavailable (online: CommError: Failed to get resume status" in warning
    assert f"logging offline instead: `wandb sync {tmp_path}/wandb/offline-run-*`" in warning
    sink.log(_rec(0))
    sink.close()
    assert run.logged[0]["step"] == 0 and run.finished


def test_wandb_that_cannot_start_at_all_leaves_training_to_metrics_jsonl(tmp_path, monkeypatch, caplog):
    """Online and offline both refused: the sink logs nothing, says so once, and metrics.jsonl gets every step."""
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    _fake_init(monkeypatch, ("online", "offline"))
    with caplog.at_level("WARNING", logger="dflash_core.monitor.sinks"):
        wb = WandbSink(WandbConfig(mode="online"), {}, str(tmp_path))
        sink = MultiSink([JsonlSink(str(tmp_path / "metrics.jsonl")), wb])
        for s in range(3):
            sink.log(_rec(s))
        sink.close()
    assert wb.mode is None and _steps(tmp_path / "metrics.jsonl") == [0, 1, 2]
    [warning] = _warnings(caplog)
    assert "(online: CommError" in warning and "; offline: CommError" in warning
    assert "metrics go to metrics.jsonl only; this launch has no W&B run to `wandb sync`" in warning


def test_blank_wandb_mode_in_the_environment_is_a_warning_naming_it(tmp_path, monkeypatch, caplog):
    """`WANDB_MODE=` (set, empty) makes every wandb.init raise a pydantic ValidationError, whatever the config
    says; it stopped training. The real wandb here, no fake."""
    import wandb

    wandb.teardown()  # W&B reads the environment once per process (an earlier test's run set it up)
    monkeypatch.setenv("WANDB_MODE", "")
    with caplog.at_level("WARNING", logger="dflash_core.monitor.sinks"):
        sink = WandbSink(WandbConfig(mode="offline"), {}, str(tmp_path))
        sink.log(_rec(0))
        sink.close()
    assert sink.mode is None
    [warning] = _warnings(caplog)
    assert warning.startswith("W&B unavailable (WANDB_MODE set but empty in the environment: unset it or give it a "
                              "value; offline: ValidationError: 1 validation error for Settings mode Input should be")
    assert warning.endswith("input_value='', input_type=str]): metrics go to metrics.jsonl only; this launch has no "
                            "W&B run to `wandb sync`")


def test_wandb_failing_mid_run_is_warned_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = _FakeRun(fail_log=True)
    _fake_init(monkeypatch, (), run)
    sink = MultiSink([JsonlSink(str(tmp_path / "metrics.jsonl")),
                      WandbSink(WandbConfig(mode="offline"), {}, str(tmp_path))])
    with caplog.at_level("WARNING", logger="dflash_core.monitor.sinks"):
        for s in range(4):
            sink.log(_rec(s))
        run.finish = lambda: (_ for _ in ()).throw(BrokenPipeError("wandb service process is gone"))
        sink.close()
    assert _steps(tmp_path / "metrics.jsonl") == [0, 1, 2, 3]
    first, last = _warnings(caplog)
    assert first.startswith("W&B logging failed at step 0 (BrokenPipeError: wandb service process is "
                                         "gone): no more records go to W&B in this launch; metrics.jsonl has every")
    assert last.startswith("W&B could not finish its run (BrokenPipeError")


_KILLED_LAUNCH = """
import os, signal, sys
from dflash_core.monitor.config import WandbConfig
from dflash_core.monitor.sinks import JsonlSink, WandbSink
out, steps = sys.argv[1], int(sys.argv[2])
jsonl = JsonlSink(out + "/metrics.jsonl")
wandb = WandbSink(WandbConfig(mode="offline", project="t"), {}, out)
for s in range(steps):
    record = {"step": s, "loss": 1.0 / (s + 1), "grad_norm": 0.5, "acc_by_slot": [0.5] * 15, "nonfinite": False}
    jsonl.log(record)
    wandb.log(record)
    if s % 50 == 49:
        val = {"kind": "val", "step": s, "val_loss": 2.0, "val_accept_len": 1.5}
        jsonl.log(val)
        wandb.log(val)
os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill: no finish, no flush
"""


def _wandb_history(out) -> list[tuple[str, int]]:
    """(kind, step) of every history record in the run's W&B files, every launch's (not the latest-run link)."""
    from dflash_core.monitor.sinks import _run_files, wandb_file_steps

    return [seen for path in _run_files(out / "wandb", (out / "wandb_run_id").read_text())
            for seen in wandb_file_steps(path)]


def _killed_launch(out, steps: int) -> None:
    import subprocess
    import sys

    from dflash_core.runtime.launch import worker_env

    # the environment the launcher gives its ranks: a W&B service of its own, not this process's (which wandb
    # names in WANDB_SERVICE once a test here has started one: the killed run would stay open in it)
    env = worker_env(os.environ)
    done = subprocess.run([sys.executable, "-c", _KILLED_LAUNCH, str(out), str(steps)], capture_output=True,
                          text=True, timeout=300, env={**env, "PYTHONPATH": os.getcwd()})
    assert done.returncode == -9, done.stderr[-2000:]


def _resume(out, at: int, steps: int) -> None:
    """A resume from the checkpoint of step `at`, as Trainer._sink opens its sinks, re-running at..steps-1."""
    from dflash_core.monitor.sinks import open_wandb

    jsonl = JsonlSink(str(out / "metrics.jsonl"), resumed_at=at)
    wandb = open_wandb(WandbConfig(mode="offline", project="t"), {}, str(out), jsonl)
    for s in range(at, steps):
        wandb.log(_rec(s))
    wandb.close()
    import wandb as wandb_module

    wandb_module.teardown()  # its service gone, as a launch's ends with its process: every file written


@pytest.mark.slow
def test_a_launch_killed_outright_leaves_no_step_out_of_wandb_after_its_resume(tmp_path, caplog):
    """W&B writes its run file in 32 KiB blocks: a launch killed outright (an OOM kill) loses the records of the
    block it was filling, whatever metrics.jsonl has. The resume reads what the files hold and logs the kept steps
    they lack (before, it took metrics.jsonl's steps for W&B's and left a gap the W&B-based gate warned about)."""
    from dflash_core.monitor.sinks import WANDB_LOG_BLOCK, _run_files, wandb_steps

    _killed_launch(tmp_path, 400)
    # what the kill leaves: the whole blocks only. W&B's own service, a process of its own, sometimes writes the
    # tail before it notices its client is gone (seen in CI under load): cut there, as the kill usually does
    for path in _run_files(tmp_path / "wandb", (tmp_path / "wandb_run_id").read_text()):
        os.truncate(path, os.path.getsize(path) // WANDB_LOG_BLOCK * WANDB_LOG_BLOCK)
    held = wandb_steps(str(tmp_path))
    assert held is not None and 0 < held["train"] < 399  # the tail is lost
    _resume(tmp_path, 300, 400)
    seen = _wandb_history(tmp_path)
    assert {s for k, s in seen if k == "train"} == set(range(400))  # no gap
    assert set(range(49, 300, 50)) <= {s for k, s in seen if k == "val"}  # the kept ones (not re-run here)
    assert len(set(seen)) == len(seen)  # nothing W&B had is logged again
    assert wandb_steps(str(tmp_path))["train"] == 399


@pytest.mark.slow
def test_a_launch_killed_before_wandb_wrote_a_record_leaves_no_empty_folder_to_stop_wandb_sync(tmp_path, caplog):
    """A run file of its header alone makes `wandb sync <run>/wandb/offline-run-*` stop there ("error getting next
    record: EOF") and upload none of the others: the resume removes its folder and logs the kept steps again."""
    _killed_launch(tmp_path, 3)
    (killed,) = (tmp_path / "wandb").glob("offline-run-*")
    assert (killed / f"run-{(tmp_path / 'wandb_run_id').read_text()}.wandb").stat().st_size <= 7
    time.sleep(1.1)  # W&B names a launch's folder by the second it starts: a relaunch's is another
    with caplog.at_level("WARNING"):
        _resume(tmp_path, 2, 3)
    assert not killed.exists() and "killed before W&B wrote a record" in caplog.text
    assert sorted(s for k, s in _wandb_history(tmp_path) if k == "train") == [0, 1, 2]


def test_an_online_resume_backfills_only_what_the_server_lacks_and_never_fails_the_run(tmp_path, monkeypatch,
                                                                                        caplog):
    """Online, W&B streams records to its server while it writes its local file in 32 KiB blocks: the file of a
    killed launch can end before what the server has (summary step 395 here, the file 340 and val 299). The
    backfill logs what neither has, not the validation record of step 349 the server already holds. A
    metrics.jsonl that cannot be read for it costs a warning, not the run."""
    _write_metrics(tmp_path, 400, val_every=50)
    jsonl = JsonlSink(str(tmp_path / "metrics.jsonl"), resumed_at=390)
    run = _FakeRun()
    run.resumed, run.summary = True, {"step": 395}
    _fake_init(monkeypatch, (), run)
    sink = WandbSink(WandbConfig(mode="offline", project="t"), {}, str(tmp_path), {"train": 340, "val": 299})
    sink.backfill(jsonl)
    assert run.logged == []  # the server has every kept step (0-389) and validation (to 349)
    run.resumed, run.summary = False, {}  # offline: the files alone say what W&B has
    sink = WandbSink(WandbConfig(mode="offline", project="t"), {}, str(tmp_path), {"train": 340, "val": 299})
    sink.backfill(jsonl)
    assert [(r.get("val_loss") is not None, r["step"]) for r in run.logged] == [
        *((False, s) for s in range(341, 350)), (True, 349), *((False, s) for s in range(350, 390))]

    def unreadable():
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(jsonl, "open_read", unreadable)
    sink = WandbSink(WandbConfig(mode="offline", project="t"), {}, str(tmp_path), {"train": 10})
    with caplog.at_level("WARNING"):
        sink.backfill(jsonl)
    assert "metrics.jsonl could not be read for the steps W&B lacks (OSError" in caplog.text


def test_wandb_files_of_a_launch_killed_before_its_header_hold_no_step(tmp_path):
    """A 0-byte run file (killed before W&B wrote its header) says nothing: it does not make the other files
    unreadable (which would take metrics.jsonl's steps for W&B's again)."""
    from dflash_core.monitor.sinks import wandb_steps

    (tmp_path / "wandb_run_id").write_text("abc123")
    empty = tmp_path / "wandb" / "offline-run-20261205_000000-abc123" / "run-abc123.wandb"
    empty.parent.mkdir(parents=True)
    empty.write_bytes(b"")
    assert wandb_steps(str(tmp_path)) == {}
    other = tmp_path / "wandb" / "offline-run-20261205_000000-xabc123" / "run-xabc123.wandb"
    other.parent.mkdir()
    other.write_bytes(b"not a W&B file")  # another run's, whose id ends the same way: not read
    assert wandb_steps(str(tmp_path)) == {}
    # W&B names a second launch started in the same second `...-<id>-1`: its file is read too
    again = tmp_path / "wandb" / "offline-run-20261205_000000-abc123-1" / "run-abc123.wandb"
    again.parent.mkdir()
    again.write_bytes(b"not a W&B file")
    assert wandb_steps(str(tmp_path)) is None  # read, and found in no format this reads


# --- W&B's transaction log, written here as W&B writes it -------------------------------------------------------

def _history_record(step: int, val: bool = False, pad: int = 0) -> bytes:
    """One W&B history record (a Record protobuf): `step`, a val_loss when `val`, `pad` bytes of padding."""
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    items = [("step", str(step)), *([("val_loss", "1.0")] if val else []), *([("pad", f'"{"x" * pad}"')] if pad else [])]
    for key, value in items:
        item = record.history.item.add()
        item.key, item.value_json = key, value
    return record.SerializeToString()


def _wandb_log(path, records: list[bytes], cut: int | None = None) -> None:
    """A W&B transaction log (LevelDB's log format): the 7-byte header, then each record in fragments (1 whole,
    2 first, 3 middle, 4 last) behind 7-byte headers, in 32 KiB blocks; fewer than 7 bytes left in a block are
    zeros, exactly 7 take an empty first fragment. `cut`: the file's first bytes only (a torn tail)."""
    from dflash_core.monitor.sinks import WANDB_LOG_BLOCK, WANDB_LOG_HEADER

    out = bytearray(b":W&B\x00\x01\x00")
    for data in records:
        first = True
        while True:
            left = WANDB_LOG_BLOCK - len(out) % WANDB_LOG_BLOCK
            if left < WANDB_LOG_HEADER:
                out += b"\0" * left
                left = WANDB_LOG_BLOCK
            n = min(len(data), left - WANDB_LOG_HEADER)
            last = n == len(data)
            kind = (1 if last else 2) if first else (4 if last else 3)
            out += struct.pack("<IHB", 0, n, kind) + data[:n]
            data, first = data[n:], False
            if last:
                break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out[:cut]))


def test_wandb_steps_are_the_newest_of_every_launch_not_of_the_last_file_read(tmp_path):
    """Files are read in name order (offline-run-* before run-*): an online launch that logged less than the
    offline one before it must not lower what W&B holds (those steps would be logged twice)."""
    from dflash_core.monitor.sinks import wandb_steps

    (tmp_path / "wandb_run_id").write_text("abc")
    _wandb_log(tmp_path / "wandb" / "offline-run-20260102_000000-abc" / "run-abc.wandb",
               [_history_record(s) for s in range(10)])
    _wandb_log(tmp_path / "wandb" / "run-20260101_000000-abc" / "run-abc.wandb", [_history_record(s) for s in range(5)])
    assert wandb_steps(str(tmp_path)) == {"train": 9}


def test_a_torn_tail_keeps_the_whole_records_before_it(tmp_path):
    """A launch killed mid-write loses its last record, not the file: the steps before it still count as W&B's."""
    from dflash_core.monitor.sinks import wandb_steps

    (tmp_path / "wandb_run_id").write_text("abc")
    path = tmp_path / "wandb" / "offline-run-1-abc" / "run-abc.wandb"
    _wandb_log(path, [_history_record(s) for s in range(5)])
    _wandb_log(path, [_history_record(s) for s in range(5)], cut=path.stat().st_size - 3)
    assert wandb_steps(str(tmp_path)) == {"train": 3}


def test_a_record_that_starts_with_an_empty_fragment_at_a_block_end_is_read_whole(tmp_path):
    """W&B (as LevelDB) starts a record with an empty first fragment when exactly 7 bytes are left in a block:
    it is not glued to the record before it."""
    from dflash_core.monitor.sinks import WANDB_LOG_BLOCK, wandb_file_steps

    first = _history_record(0)
    size = WANDB_LOG_BLOCK - 7 - (7 + len(first)) - 7 - 7  # a val record that leaves exactly 7 bytes in block 0
    filler = next(r for n in range(size, 0, -1) if len(r := _history_record(1, val=True, pad=n)) == size)
    path = tmp_path / "run-abc.wandb"
    _wandb_log(path, [first, filler, _history_record(2, pad=100), _history_record(3)])
    assert path.read_bytes()[WANDB_LOG_BLOCK - 7: WANDB_LOG_BLOCK] == struct.pack("<IHB", 0, 0, 2)
    assert list(wandb_file_steps(path)) == [("train", 0), ("val", 1), ("train", 2), ("train", 3)]


def test_a_record_spanning_blocks_after_a_val_record_keeps_its_own_kind(tmp_path):
    from dflash_core.monitor.sinks import WANDB_LOG_BLOCK, wandb_file_steps

    path = tmp_path / "run-abc.wandb"
    _wandb_log(path, [_history_record(0, val=True), _history_record(1, pad=WANDB_LOG_BLOCK)])
    assert list(wandb_file_steps(path)) == [("val", 0), ("train", 1)]


def test_no_run_id_or_no_run_file_is_unknown_not_empty(tmp_path):
    """None (unknown: metrics.jsonl's steps are taken for W&B's), not {} (W&B holds nothing: every kept step
    would be logged again)."""
    from dflash_core.monitor.sinks import wandb_steps

    assert wandb_steps(str(tmp_path)) is None
    (tmp_path / "wandb_run_id").write_text("abc")
    assert wandb_steps(str(tmp_path)) is None


@pytest.mark.parametrize("files", ["unreadable", "absent"])
def test_without_readable_wandb_files_the_resume_takes_metrics_steps_for_wandbs(tmp_path, monkeypatch, files):
    """A run file in another W&B version's format, or none: W&B is taken to hold what metrics.jsonl held, so the
    kept steps are not logged a second time."""
    from dflash_core.monitor.sinks import open_wandb

    (tmp_path / "wandb_run_id").write_text("abc")
    if files == "unreadable":
        path = tmp_path / "wandb" / "offline-run-1-abc" / "run-abc.wandb"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"another format")
    _write_metrics(tmp_path, 10)
    run = _FakeRun()
    _fake_init(monkeypatch, (), run)
    open_wandb(WandbConfig(mode="offline", project="t"), {}, str(tmp_path),
               JsonlSink(str(tmp_path / "metrics.jsonl"), resumed_at=5))
    assert run.logged == []


def test_only_offline_folders_with_no_record_are_removed(tmp_path, monkeypatch):
    """An offline folder holding a record is kept (however small: it is unsynced data); an online folder is
    never removed (its records are on the server)."""
    (tmp_path / "wandb_run_id").write_text("abc")
    small = tmp_path / "wandb" / "offline-run-1-abc" / "run-abc.wandb"
    _wandb_log(small, [_history_record(0)])
    online = tmp_path / "wandb" / "run-2-abc" / "run-abc.wandb"
    _wandb_log(online, [])
    _fake_init(monkeypatch, ())
    WandbSink(WandbConfig(mode="offline", project="t"), {}, str(tmp_path))
    assert small.exists() and online.exists()


def test_backfill_logs_the_validation_records_wandb_lacks_and_says_so(tmp_path, monkeypatch, caplog):
    _write_metrics(tmp_path, 20, val_every=5)
    run = _FakeRun()
    _fake_init(monkeypatch, (), run)
    sink = WandbSink(WandbConfig(mode="offline", project="t"), {}, str(tmp_path), {"train": 19, "val": 9})
    with caplog.at_level("INFO", logger="dflash_core.monitor.sinks"):
        sink.backfill(JsonlSink(str(tmp_path / "metrics.jsonl"), resumed_at=20))
    assert [r["step"] for r in run.logged] == [14, 19]
    assert "logged now: val 10-19" in caplog.text


def test_a_launch_folder_is_named_by_the_run_id_and_nothing_else():
    from dflash_core.monitor.sinks import is_launch_folder

    assert is_launch_folder("offline-run-20260101_000000-abc", "abc")
    assert is_launch_folder("run-20260101_000000-abc-12", "abc")  # a second launch in the same second
    for name in ("offline-run-1-abcd", "offline-run-1-xabc", "offline-run-1-abc-old", "abc", "latest-run"):
        assert not is_launch_folder(name, "abc"), name
