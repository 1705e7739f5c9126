"""Metric sinks: metrics.jsonl append/resume semantics, W&B offline with grad_norm summarised by max."""

import json
import math
import os

import pytest

from dflash_core.monitor.config import WandbConfig
from dflash_core.monitor.sinks import JsonlSink, MultiSink, NullSink, WandbSink, scrub_secrets, wandb_mode


def _rec(step: int, **extra) -> dict:
    return {"step": step, "loss": 1.0 / (step + 1), "grad_norm": 0.5, "clipped": False, "clip": 1.0,
            "nonfinite": False, **extra}


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in open(path)]


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
