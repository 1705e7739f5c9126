"""The flow's tasks one by one through `.fn()` (no flow run, no Prefect server), and the progress helpers."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
from common.chat import conversations, to_sharegpt, tokenizer_dir, write_jsonl
from common.clock import ModuleWith
from common.logs import make_log
from common.logs import write_jsonl as write_metrics
from prefect.logging import disable_run_logger

from dflash_core.config import PipelineConfig, parse_config
from dflash_core.data.fingerprint import input_fingerprint
from dflash_core.plan import read_plan
from flows import progress, tasks
from flows.progress import LogThrottle, follow_metrics


def _config(tmp_path: Path, n: int = 40, **sections) -> PipelineConfig:
    data = write_jsonl(tmp_path / "chats.jsonl", [to_sharegpt(c, i) for i, c in enumerate(conversations(n))])
    raw = {"data": {"source": str(data), "tokenizer": tokenizer_dir("chatml"), "num_proc": 1},
           "model": {"target": "unused", "block_size": 4},
           "plan": {"max_tokens": 1024, "num_buckets": 2, "grad_accum": 1}, **sections}
    return parse_config(raw, "test")


def test_fingerprint_follows_content_and_parameters(tmp_path):
    cfg = _config(tmp_path)
    first = tasks.fingerprint_inputs.fn(cfg)
    assert first == tasks.fingerprint_inputs.fn(cfg)
    assert first == input_fingerprint(cfg.data.source, cfg.data.tokenizer, cfg.data, cfg.model.block_size)
    longer = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 64})})
    assert tasks.fingerprint_inputs.fn(longer) != first
    Path(cfg.data.source).write_text(Path(cfg.data.source).read_text().replace("a", "b", 1))
    assert tasks.fingerprint_inputs.fn(cfg) != first


def test_plan_fingerprint_depends_on_tokens_and_plan_section_only(tmp_path):
    cfg = _config(tmp_path)
    key = tasks.plan_fingerprint("tok-1", cfg)
    assert key == tasks.plan_fingerprint("tok-1", cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"lr": 0.5})}))
    assert key != tasks.plan_fingerprint("tok-2", cfg)
    assert key != tasks.plan_fingerprint("tok-1", cfg.model_copy(update={"plan": cfg.plan.model_copy(
        update={"seed": 9})}))


def test_tokenize_then_plan_write_their_folders(tmp_path):
    cfg = _config(tmp_path)
    fp = tasks.fingerprint_inputs.fn(cfg)
    tokenized = str(tmp_path / "tok")
    with disable_run_logger():
        summary = tasks.tokenize.fn(cfg, fp, tokenized)
    assert summary["read"] == 40 and summary["kept"] > 0
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    assert manifest["fingerprint"] == fp  # the cache key is the fingerprint the stage itself writes

    plan_dir = str(tmp_path / "plan")
    plan_summary = tasks.plan.fn(cfg, tokenized, "unused", plan_dir)
    assert plan_summary == read_plan(plan_dir)[1] and plan_summary["num_steps"] >= 1


def test_a_cache_miss_over_finished_outputs_reuses_them(tmp_path):
    """Where Prefect keeps no task results (a fresh Kubernetes pod each night) every run misses the cache while the
    content-addressed folders are finished: tokenize and plan return what the folders hold instead of doing the
    work again (with the GPUs reserved); another fingerprint, or a damaged plan, is made again."""
    cfg = _config(tmp_path)
    fp = tasks.fingerprint_inputs.fn(cfg)
    tokenized, plan_dir = str(tmp_path / "tok"), str(tmp_path / "plan")
    with disable_run_logger():
        first = tasks.tokenize.fn(cfg, fp, tokenized)
        plan_summary = tasks.plan.fn(cfg, tokenized, "unused", plan_dir)
        stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "tok").iterdir()}
        plan_stamp = (tmp_path / "plan" / "plan.parquet").stat().st_mtime_ns
        again = tasks.tokenize.fn(cfg, fp, tokenized)
        assert again["reused"] and {k: again[k] for k in ("read", "kept", "dropped", "tokens")} == {
            k: first[k] for k in ("read", "kept", "dropped", "tokens")}
        assert {p: p.stat().st_mtime_ns for p in (tmp_path / "tok").iterdir()} == stamps
        assert tasks.plan.fn(cfg, tokenized, "unused", plan_dir) == plan_summary
        assert (tmp_path / "plan" / "plan.parquet").stat().st_mtime_ns == plan_stamp
        assert "reused" not in tasks.tokenize.fn(cfg, "another-fingerprint", tokenized)
        (tmp_path / "plan" / "plan.parquet").write_bytes(b"torn")
        assert tasks.plan.fn(cfg, tokenized, "unused", plan_dir) == plan_summary  # planned again
    assert read_plan(plan_dir)[1] == plan_summary


def test_a_run_waits_for_another_making_the_same_output_and_takes_it(tmp_path, monkeypatch):
    """Two flow runs on the same data (a manual run beside the nightly one): the second one's tokenize finds the
    first one's lock, waits for it and takes its output. Before, it failed on the lock, and with it the run."""
    import dflash_core.data.tokenize as tokenize_module
    from dflash_core import publish

    cfg = _config(tmp_path)
    fp = tasks.fingerprint_inputs.fn(cfg)
    out = str(tmp_path / "tok")
    publish_now, tokenize_now, made = publish._publish, tokenize_module.tokenize_dataset, []

    def slow_publish(*args):  # the first run is still writing when the second one starts
        time.sleep(2.0 if threading.current_thread().name == "first" else 0.0)
        publish_now(*args)

    def counted(*args, **kwargs):
        made.append(threading.current_thread().name)
        return tokenize_now(*args, **kwargs)

    monkeypatch.setattr(publish, "_publish", slow_publish)
    monkeypatch.setattr(tokenize_module, "tokenize_dataset", counted)
    monkeypatch.setattr(tasks, "WAIT_POLL_S", 0.1)
    results = {}
    with disable_run_logger():
        first = threading.Thread(target=lambda: results.update(first=tasks.tokenize.fn(cfg, fp, out)), name="first")
        first.start()
        deadline = time.monotonic() + 60
        while not (tmp_path / "tok.lock").exists() and first.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        second = tasks.tokenize.fn(cfg, fp, out)
        first.join()
    assert made == ["first", "MainThread"]  # the second started, was refused by the lock at once, and waited
    assert second["reused"] and second["kept"] == results["first"]["kept"] > 0


def test_a_plan_without_the_validation_batches_it_lists_is_made_again(tmp_path):
    cfg = _config(tmp_path, 200, plan={"max_tokens": 1024, "num_buckets": 2, "grad_accum": 1, "val_fraction": 0.05})
    tokenized, plan_dir = str(tmp_path / "tok"), str(tmp_path / "plan")
    with disable_run_logger():
        tasks.tokenize.fn(cfg, tasks.fingerprint_inputs.fn(cfg), tokenized)
        summary = tasks.plan.fn(cfg, tokenized, "unused", plan_dir)
        assert summary["val"]["samples"] > 0
        (tmp_path / "plan" / summary["val"]["file"]).unlink()  # training would fail on it after the GPUs start
        with pytest.raises(Exception, match="missing but plan.json lists it"):
            tasks.plan_reads_back(plan_dir)
        assert tasks.plan.fn(cfg, tokenized, "unused", plan_dir) == summary
    assert (tmp_path / "plan" / summary["val"]["file"]).exists()


def test_cached_refreshes_when_the_output_is_gone(tmp_path):
    out = tmp_path / "out"
    assert tasks.cached(tasks.plan, str(out), "plan.json") is not tasks.plan  # nothing there: refresh_cache
    assert tasks.cached(tasks.plan, str(out), "plan.json").refresh_cache is True
    out.mkdir()
    (out / "plan.json").write_text("{}")
    assert tasks.cached(tasks.plan, str(out), "plan.json") is tasks.plan


def test_check_writes_the_report_and_publishes_it(tmp_path, monkeypatch):
    published = []
    monkeypatch.setattr(tasks, "publish_report", lambda report, out, drafter: published.append((report, out)))
    metrics = write_metrics(make_log(300, 0), tmp_path / "metrics.jsonl")
    cfg = _config(tmp_path, check={"spike_window": 50})
    report = tasks.check.fn(cfg, metrics, str(tmp_path / "report"), str(tmp_path / "drafter"))
    assert report["verdict"] in ("pass", "warn")
    assert json.loads((tmp_path / "report" / "report.json").read_text())["verdict"] == report["verdict"]
    assert published == [(report, str(tmp_path / "report"))]


def test_log_throttle_forwards_at_the_rate_and_counts_the_rest(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress, "time", ModuleWith(time, monotonic=lambda: now[0]))
    lines: list[str] = []
    throttle = LogThrottle(lines.append, rate=2.0)  # one line per 0.5 s
    for i in range(5):
        throttle(f"line {i}")
    now[0] += 0.6
    throttle("line 5")
    assert lines == ["line 0", "... 4 log lines not forwarded", "line 5"]


class _Recorder:
    def __init__(self) -> None:
        self.polls = 0
        self.seen = threading.Event()

    def poll(self, final: bool = False) -> None:
        self.polls += 1
        if self.polls >= 3:
            self.seen.set()


@pytest.mark.timeout(30)
def test_follow_metrics_polls_until_stopped():
    recorder, stop = _Recorder(), threading.Event()
    follower = threading.Thread(target=follow_metrics, args=(recorder, stop, 0.01))
    follower.start()
    try:
        assert recorder.seen.wait(10)
    finally:
        stop.set()
        follower.join(10)
    polls = recorder.polls
    time.sleep(0.1)
    assert not follower.is_alive() and recorder.polls == polls  # no poll after stop


class _Outage(_Recorder):
    """A page whose updates fail while the Prefect API is down (polls 2 to 4), as httpx's refused connection."""

    def poll(self, final: bool = False) -> None:
        super().poll(final)
        if 2 <= self.polls <= 4:
            raise ConnectionRefusedError("[Errno 111] Connection refused")


@pytest.mark.timeout(30)
def test_follow_metrics_goes_on_after_failed_updates_and_says_so_once():
    """An API blip used to end the follower thread: the bar and page froze for the rest of a run that trained on."""
    outage, stop, said = _Outage(), threading.Event(), []
    follower = threading.Thread(target=follow_metrics, args=(outage, stop, 0.01, said.append))
    follower.start()
    try:
        deadline = time.monotonic() + 10
        while outage.polls < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        follower.join(10)
    assert outage.polls >= 8 and not follower.is_alive()
    assert len(said) == 2 and "an update failed (ConnectionRefusedError" in said[0]
    assert said[1] == "training progress: updated again after 3 failed attempts"


def test_the_dataset_event_cli_fails_when_the_event_cannot_reach_a_server(capsys):
    """prefect's emit_event only queues an event: a cron job announcing new data to a server that is down (or to
    no server at all) was told it succeeded, and nothing retrained. Now it exits 1 saying why."""
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.events import main

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    for url, said in ((f"http://127.0.0.1:{closed}/api", f"the event was not sent to http://127.0.0.1:{closed}/api"),
                      (None, "PREFECT_API_URL is not set")):
        with temporary_settings({PREFECT_API_URL: url}), pytest.raises(SystemExit) as stopped:
            main(["--data-uri", "s3://bucket/chat/"])
        assert stopped.value.code == 1
        assert said in capsys.readouterr().err


def test_the_training_key_changes_with_the_plan_a_setting_or_the_promoted_drafter(tmp_path):
    """flows.unchanged: a run is skipped only when it would repeat one (same plan, settings and incumbent)."""
    from common.flows import fast_config

    from flows import unchanged

    cfg = fast_config(tmp_path / "store")
    key = unchanged.training_key(cfg, "plan-a")
    assert unchanged.training_key(fast_config(tmp_path / "store"), "plan-a") == key
    assert unchanged.training_key(cfg, "plan-b") != key  # new data, or new tokenize/plan settings
    assert unchanged.training_key(fast_config(tmp_path / "store", **{"train.lr": 1e-3}), "plan-a") != key
    assert unchanged.training_key(fast_config(tmp_path / "store", **{"eval.min_gain": 0.1}), "plan-a") != key
    assert unchanged.trained_before(cfg.storage.root, key) is None
    outcome = {"run": "runs/x", "verdict": "pass", "promoted": False, "tau": 1.5}
    assert unchanged.record_trained(cfg, "plan-a", outcome, measured=None)
    assert unchanged.trained_before(cfg.storage.root, key)["run"] == "runs/x"
    promoted = tmp_path / "store" / "promoted"
    promoted.mkdir()
    (promoted / "promoted.json").write_text(json.dumps({"run": "runs/y", "time": "2026-12-04T02:00:00+00:00"}))
    assert unchanged.training_key(cfg, "plan-a") != key  # a new promoted drafter: another warm start, another bar
    # another run promoted while this one was measured against none (a PromotionConflict): nothing to record, the
    # promoted drafter was never compared on this run's data
    assert not unchanged.record_trained(cfg, "plan-a", outcome, measured=None)
    assert unchanged.trained_before(cfg.storage.root, unchanged.training_key(cfg, "plan-a")) is None
    (tmp_path / "store" / "trained" / f"{key[:32]}.json").write_text("{cut sho")
    assert unchanged.trained_before(cfg.storage.root, key) is None  # a record that does not read: train

    # a drafter placed by hand (no promoted.json), or replaced by hand, is a new incumbent too
    hand = fast_config(tmp_path / "hand")
    before = unchanged.training_key(hand, "plan-a")
    drafter = tmp_path / "hand" / "promoted" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"x" * 10)
    placed = unchanged.training_key(hand, "plan-a")
    assert placed != before
    (drafter / "model.safetensors").write_bytes(b"y" * 11)
    assert unchanged.training_key(hand, "plan-a") != placed
    # a train.init_from folder counts by its files, not its path (a release location rewritten in place)
    start = tmp_path / "release"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"x" * 10)
    warm = fast_config(tmp_path / "hand", **{"train.init_from": str(start)})
    first = unchanged.training_key(warm, "plan-a")
    (start / "model.safetensors").write_bytes(b"z" * 12)
    assert unchanged.training_key(warm, "plan-a") != first


def test_the_training_key_counts_the_eval_prompts_by_content(tmp_path):
    """eval.data rewritten in place at the same URI is another gate: the key follows the prompts the gate reads
    (the first eval.limit), not the URI."""
    from common.flows import fast_config

    from dflash_core.model.instances import read_instances
    from flows import unchanged

    prompts = tmp_path / "eval.jsonl"
    cfg = fast_config(tmp_path / "store", **{"eval.data": str(prompts), "eval.limit": 2})

    def key(*questions: str) -> str:
        prompts.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in questions))
        return unchanged.training_key(cfg, "plan-a", unchanged.prompts_digest(read_instances(str(prompts), 2)))

    first = key("What is 2+2?", "Name a prime.")
    assert key("What is 2+2?", "Name a prime.", "never read: past eval.limit") == first
    assert key("What is 3+3?", "Name a prime.") != first
    assert first != unchanged.training_key(cfg, "plan-a")


def test_only_input_errors_that_may_pass_next_time_are_retried(tmp_path):
    """Bad input fails its task at once; an error that may pass is retried: any other error, a failed endpoint,
    an InputError a network failure caused (a shard read whose connection was reset). A corrupt file is bad input
    (gzip's and pyarrow's errors are OSErrors: they must not read as passing)."""
    import gzip

    from prefect.states import Failed

    from dflash_core.data.errors import BadInputError
    from dflash_core.data.shards import ShardError
    from dflash_core.data.sources import FileRecords, list_files
    from dflash_core.errors import TransientError
    from dflash_core.plan.errors import PlanError
    from dflash_core.regenerate.errors import EndpointError, RegenerateError
    from flows.tasks import _worth_retrying

    def caused(error: Exception, cause: BaseException) -> Exception:
        try:
            raise error from cause
        except Exception as exc:  # noqa: BLE001 - the exception with its cause, as the stages raise it
            return exc

    def retried(exc: BaseException) -> bool:
        return _worth_retrying(None, None, Failed(data=exc))

    assert not retried(BadInputError("3 of 20 records are bad input"))
    assert not retried(PlanError("a sample longer than plan.max_tokens"))
    assert not retried(RegenerateError("the server refused every one of the first 8 requests"))
    assert not retried(caused(ShardError("x/index.parquet: missing"), FileNotFoundError(2, "no such file")))
    assert not retried(caused(ShardError("x/part.parquet: corrupt"), gzip.BadGzipFile("Not a gzipped file")))
    assert retried(caused(ShardError("x/index.parquet: unreadable"), ConnectionResetError(104, "reset by peer")))
    assert retried(EndpointError("every endpoint failed"))
    assert retried(TransientError("reading it failed"))
    assert retried(OSError("connection reset by peer"))

    # a source file whose read is cut by the network is no bad record: the stage stops, to be run again
    class Reset(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            raise ConnectionResetError(104, "Connection reset by peer")

    (tmp_path / "chats.jsonl").write_text("{}\n")
    [source] = list_files(str(tmp_path / "chats.jsonl"))
    records = FileRecords(source)
    records._records = lambda raw: (_ for _ in [Reset().read()])  # type: ignore[method-assign]
    with pytest.raises(TransientError, match="reading it failed after 0 records .ConnectionResetError"):
        list(records)


def test_the_flow_fails_at_regenerate_when_it_kept_no_record(tmp_path, monkeypatch):
    """A target whose every reply is cut at max_tokens keeps nothing: the flow's regenerate step fails there,
    naming the drops and the settings, not tokenize on an empty folder."""
    from flows import retrain

    summary = {"read": 3, "kept": 0, "dropped": {"truncated": 3}, "out": str(tmp_path / "regen")}
    monkeypatch.setattr(retrain.tasks, "fingerprint_regenerate", lambda config: "f" * 64)
    monkeypatch.setattr(retrain.tasks, "cached", lambda task, out, name: lambda *args: summary)
    config = _config(tmp_path)
    regen = config.data.regenerate.model_copy(update={"task_per_shard": False})
    config = config.model_copy(update={"data": config.data.model_copy(update={"regenerate": regen})})
    with pytest.raises(Exception, match=r"regenerate kept none of the 3 records it read, dropped \{'truncated': 3\} "
                                        r"\(replies cut at max_tokens: raise data.regenerate.max_tokens"):
        retrain._regenerated(config, str(tmp_path))
    summary["kept"] = 1
    assert retrain._regenerated(config, str(tmp_path))[1]["kept"] == 1
