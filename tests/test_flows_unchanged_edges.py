"""What a mutation audit of flows.unchanged, the pure helpers of flows.tasks and retrain's run names found unpinned:
the stamps other stores keep, two records under one root and what a record keeps, network errors further down an
exception chain, the task cache keys, cached()'s read-back check, made_once's wait, and which run names are one
folder. Plain function calls: no flow run, no Prefect server."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from common.clock import ModuleWith
from common.flows import fast_config
from prefect.runtime import flow_run

from dflash_core.data.shards import ShardError
from dflash_core.errors import UsageError
from dflash_core.plan.errors import PlanError
from dflash_core.publish import OutputLockedError
from flows import retrain, tasks, unchanged

OUTCOME = {"run": "runs/x", "verdict": "pass", "promoted": False, "tau": 1.5}


def _said(kind: str) -> tuple[list[str], SimpleNamespace]:
    """A run logger that keeps its `kind` ("info", "warning") lines, formatted, for tasks.get_run_logger."""
    lines: list[str] = []
    return lines, SimpleNamespace(**{kind: lambda msg, *args: lines.append(msg % args)})


def test_a_file_without_a_checksum_is_stamped_by_its_time_or_blob_id():
    """A local mtime, an object store's LastModified, a bucket's updated time or a hub file's blob id, the first of
    them a file has, stamps it; a file with none of them has no stamp."""
    assert unchanged._stamp({"mtime": 1_000_000_000.5, "LastModified": "2026-12-04T02:00:00"}) == 1_000_000_000.5
    assert unchanged._stamp({"LastModified": "2026-12-04T02:00:00", "blob_id": "b1"}) == "2026-12-04T02:00:00"
    assert unchanged._stamp({"updated": "2026-12-05T02:00:00Z", "blob_id": "b1"}) == "2026-12-05T02:00:00Z"
    assert unchanged._stamp({"blob_id": "3f2a9c"}) == "3f2a9c"
    assert unchanged._stamp({"size": 10}) is None


def test_a_run_from_scratch_has_a_key_that_follows_the_promoted_drafter(tmp_path):
    """Without train.init_from (the presets warm-start from the promoted drafter) there is no warm-start folder to
    count, but the promoted drafter is still the bar the run must beat: a new one is another run."""
    cfg = fast_config(tmp_path / "store", **{"train.init_from": None})
    assert cfg.train.init_from is None
    key = unchanged.training_key(cfg, "plan-a")
    assert key != unchanged.training_key(fast_config(tmp_path / "store"), "plan-a")
    promoted = tmp_path / "store" / "promoted"
    promoted.mkdir(parents=True)
    (promoted / "promoted.json").write_text('{"run": "runs/y", "time": "2026-12-04T02:00:00+00:00"}')
    assert unchanged.training_key(cfg, "plan-a") != key


def test_runs_on_two_plans_under_one_root_are_both_recorded_with_their_outcome_and_time(tmp_path):
    """The second night's record goes beside the first (trained/ already there); each keeps the run's outcome and
    the time it was recorded (UTC), which the skip message shows."""
    cfg = fast_config(tmp_path / "store")
    assert unchanged.record_trained(cfg, "plan-a", OUTCOME, measured=None)
    assert unchanged.record_trained(cfg, "plan-b", {**OUTCOME, "run": "runs/y"}, measured=None)
    first = unchanged.trained_before(cfg.storage.root, unchanged.training_key(cfg, "plan-a"))
    second = unchanged.trained_before(cfg.storage.root, unchanged.training_key(cfg, "plan-b"))
    assert first == {**OUTCOME, "time": first["time"]} and second["run"] == "runs/y"
    assert datetime.fromisoformat(first["time"]).utcoffset() == timedelta(0)
    assert f"({first['time']})" in unchanged.skip_message(first)


def _from(error: Exception, cause: BaseException) -> Exception:
    """`error` raised `from cause`, as the stages chain what they caught."""
    try:
        raise error from cause
    except Exception as exc:  # noqa: BLE001 - the exception with its chain
        return exc


def _while_handling(error: Exception, handled: BaseException) -> Exception:
    """`error` raised without `from` while `handled` was being handled (Python sets its __context__)."""
    try:
        try:
            raise handled
        except BaseException:
            raise error  # noqa: B904 - the implicit chain is the case under test
    except Exception as exc:  # noqa: BLE001 - the exception with its chain
        return exc


@pytest.mark.timeout(30)
def test_a_network_failure_anywhere_down_the_chain_is_worth_retrying():
    """A connection reset or a timeout two links down (an OSError wrapping it), or one that was being handled when
    the InputError was raised (no `from`), is a network failure; a chain with none ends in False."""
    reset = ConnectionResetError(104, "Connection reset by peer")
    assert tasks._caused_by_network(_while_handling(ShardError("x/part.parquet: unreadable"), reset))
    assert tasks._caused_by_network(_from(ShardError("x: unreadable"), _from(OSError("read failed"), reset)))
    timed_out = _while_handling(OSError("read failed"), TimeoutError("timed out"))
    assert tasks._caused_by_network(_from(ShardError("x: unreadable"), timed_out))
    corrupt = _from(OSError("read failed"), ValueError("bad magic bytes"))
    assert not tasks._caused_by_network(_from(ShardError("x: unreadable"), corrupt))


def test_the_cache_keys_follow_the_task_and_content_not_the_output_path():
    """Tokenize and plan runs are cached by their task and fingerprint (a folder moved is the same content);
    regenerate runs by fingerprint and shards (each shard's run is its own; no shards given is all of them)."""
    tokenize, plan = SimpleNamespace(task=tasks.tokenize), SimpleNamespace(task=tasks.plan)
    key = tasks._content_key(tokenize, {"fingerprint": "fp-1", "out": "/store/a"})
    assert key == tasks._content_key(tokenize, {"fingerprint": "fp-1", "out": "/store/b"})
    assert key != tasks._content_key(tokenize, {"fingerprint": "fp-2", "out": "/store/a"})
    assert key != tasks._content_key(plan, {"fingerprint": "fp-1", "out": "/store/a"})
    regenerate = SimpleNamespace(task=tasks.regenerate)
    shard0 = tasks._regenerate_key(regenerate, {"fingerprint": "fp-1", "out": "/a", "shards": [0]})
    assert shard0 == tasks._regenerate_key(regenerate, {"fingerprint": "fp-1", "out": "/b", "shards": [0]})
    assert shard0 != tasks._regenerate_key(regenerate, {"fingerprint": "fp-1", "shards": [1]})
    assert shard0 != tasks._regenerate_key(regenerate, {"fingerprint": "fp-2", "shards": [0]})
    assert tasks._regenerate_key(regenerate, {"fingerprint": "fp-1"}) != shard0


def test_cached_reads_a_finished_output_back_and_makes_a_damaged_one_again(tmp_path, monkeypatch):
    """An output whose marker is there is read back: the task as is when it reads, refresh_cache (and a warning
    naming the task, the folder and why) when it raises an InputError; a missing output is not read at all."""
    out = tmp_path / "plan"
    out.mkdir()
    (out / "plan.json").write_text("{}")
    warned, logger = _said("warning")
    monkeypatch.setattr(tasks, "get_run_logger", lambda: logger)
    checked: list[str] = []

    def damaged(path: str) -> None:
        checked.append(path)
        raise PlanError("plan.parquet: torn")

    assert tasks.cached(tasks.plan, str(out), "plan.json", checked.append) is tasks.plan and checked == [str(out)]
    again = tasks.cached(tasks.plan, str(out), "plan.json", damaged)
    assert again is not tasks.plan and again.refresh_cache is True
    assert warned == [f"plan: {out} does not read back (plan.parquet: torn): made again"]
    assert tasks.cached(tasks.plan, str(tmp_path / "gone"), "plan.json", damaged).refresh_cache is True
    assert checked == [str(out), str(out)] and len(warned) == 1


def test_made_once_waits_for_the_other_writer_and_takes_its_output_or_makes_it(tmp_path, monkeypatch):
    """A make() refused by another run's lock waits (said in the log) and takes what that run left; when it left
    nothing, this run makes it; an output already there is reused without making anything."""
    out = str(tmp_path / "tok")  # no lock file: the other writer is already done when this run looks
    said, logger = _said("info")
    monkeypatch.setattr(tasks, "get_run_logger", lambda: logger)
    made: list[str] = []

    def refused_then(result: dict | None):
        def make() -> dict:
            made.append("make")
            if len(made) == 1:
                raise OutputLockedError(f"{out} is being written by pid 7")
            return result
        return make

    left = iter([None, {"kept": 3}])
    assert tasks.made_once(out, "tokenize", lambda: next(left), refused_then({"kept": 9})) == {"kept": 3}
    assert made == ["make"]
    assert said == [f"tokenize: {out} is being written by pid 7; waiting for that run, to take its output"]
    made.clear()
    assert tasks.made_once(out, "tokenize", lambda: None, refused_then({"kept": 9})) == {"kept": 9}
    assert made == ["make", "make"]
    made.clear()
    assert tasks.made_once(out, "tokenize", lambda: {"kept": 1}, refused_then({"kept": 9})) == {"kept": 1}
    assert made == []


@pytest.mark.parametrize("name", ["../promoted", "a/b", "a\\b", "a\0b", ".", "..", " ", "\t"])
def test_a_run_name_that_is_not_one_folder_is_refused(name):
    """Parent, nested, Windows-separated, NUL, dot and blank names would not be one folder under runs/."""
    with pytest.raises(UsageError, match="give one folder name"):
        retrain.check_run_name(name)


@pytest.mark.parametrize("name", [None, "", "nightly-2026-12-04", "Exp-X2", "v1.2", "..x", "a..b", "my run"])
def test_one_folder_name_or_none_is_a_run_name(name):
    """Any single folder name is taken, dots inside it included; None or "" means the default name."""
    retrain.check_run_name(name)


def test_the_run_folder_is_named_by_the_scheduled_start_in_utc_the_flow_run_and_the_plan(monkeypatch):
    """`<scheduled start, UTC>-<flow run name>-<plan fingerprint[:8]>`; "local" when the flow run has no name, the
    clock when it has no scheduled start; a name given is used as is."""
    start = datetime(2026, 12, 4, 3, 0, 5, tzinfo=timezone(timedelta(hours=1)))
    fingerprint = "ab12cd34" + "0" * 56

    def name(scheduled: datetime | None, run: str | None) -> str:
        monkeypatch.setattr(retrain, "flow_run", ModuleWith(flow_run, get_scheduled_start_time=lambda: scheduled,
                                                            get_name=lambda: run))
        return retrain._run_name(None, fingerprint)

    assert name(start, "brave-otter") == "20261204-020005-brave-otter-ab12cd34"
    assert name(start, None) == "20261204-020005-local-ab12cd34"
    before = datetime.now(UTC).replace(microsecond=0)
    clock = name(None, "brave-otter")
    assert re.fullmatch(r"\d{8}-\d{6}-brave-otter-ab12cd34", clock)
    assert before <= datetime.strptime(clock[:15], "%Y%m%d-%H%M%S").replace(tzinfo=UTC) <= datetime.now(UTC)
    assert retrain._run_name("nightly-1", fingerprint) == "nightly-1"
