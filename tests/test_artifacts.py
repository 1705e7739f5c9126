"""The flow-run page's artifacts from synthetic inputs: inline pictures within budget, storage links, the plan,
the stability report, the live training page (with validation records) and the run summary (with promotion)."""

from __future__ import annotations

import base64
import io
import json
import re
import uuid

import fsspec
import numpy as np
import pytest
from common.logs import incident_log, write_jsonl
from matplotlib.figure import Figure
from PIL import Image
from test_plan_io import write_tokenized
from test_runtime_sinks import MAX_READ, long_metrics, refuse_big_reads

from dflash_core.monitor.check import run_check
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.sinks import JsonlSink
from dflash_core.plan import run_plan
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.interleave import longest_runs
from dflash_core.runtime.launch import TrainingFailed
from flows import artifacts
from flows.metrics_tail import PAGE_KEYS, MetricsTail, read_records

IMAGE = re.compile(r"!\[([^\]]*)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)")


def images(markdown: str) -> list[tuple[str, Image.Image, int]]:
    """(alt text, decoded picture, PNG bytes) of every inline image of a markdown page."""
    out = []
    for alt, b64 in IMAGE.findall(markdown):
        png = base64.b64decode(b64)
        out.append((alt, Image.open(io.BytesIO(png)), len(png)))
    return out


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    """A run folder of the incident (long-bucket runs -> grad spikes -> loss cliffs), checked: verdict fail."""
    run = tmp_path_factory.mktemp("run")
    records, _ = incident_log(1200)
    metrics = write_jsonl(records, run / "metrics.jsonl")
    report = run_check(metrics, str(run / "report"), CheckConfig())
    assert report["verdict"] == "fail"
    return run, records, report


def test_inline_png_fits_the_budget_and_keeps_the_picture(failed_run):
    run, _, _ = failed_run
    full = (run / "report" / "stability.png").read_bytes()
    assert len(full) > artifacts.IMAGE_BUDGET  # the point of compacting: the file itself is too heavy
    [(alt, img, size)] = images(artifacts.inline_png(str(run / "report" / "stability.png"), "stability"))
    original = Image.open(io.BytesIO(full))
    assert alt == "stability" and size <= artifacts.IMAGE_BUDGET
    # A 64-colour palette (fewer colours lose the pale highlight bands) and at most a few 20% narrowing steps.
    assert img.width >= 0.6 * original.width
    assert img.width / img.height == pytest.approx(original.width / original.height, rel=0.01)

    fig = Figure(figsize=(10, 6), dpi=100)
    fig.subplots().plot(np.random.default_rng(0).normal(size=5000))
    [(_, small, size)] = images(artifacts.inline_png(fig, "noise", max_bytes=8000))
    assert size <= 8000 and artifacts.MIN_WIDTH <= small.width < 1000

    with pytest.raises(artifacts.ImageBudgetError, match=r"stability: .* over the budget of 2000 bytes"):
        artifacts.inline_png(full, "stability", max_bytes=2000)


def test_storage_links_open_from_any_browser(tmp_path):
    assert artifacts.storage_link("s3://bkt/runs/a/stability.png", "plot") == \
        "[plot](https://s3.console.aws.amazon.com/s3/object/bkt?prefix=runs/a/stability.png)"
    assert artifacts.storage_link("gs://bkt/runs/a/drafter", folder=True) == \
        "[gs://bkt/runs/a/drafter](https://console.cloud.google.com/storage/browser/bkt/runs/a/drafter)"
    assert artifacts.storage_link(f"file://{tmp_path}/x.png", "plot") == f"plot: `{tmp_path}/x.png`"
    assert artifacts.storage_link(str(tmp_path / "x.png")) == f"`{tmp_path}/x.png`"
    assert artifacts.storage_link("memory://store/x") == "`memory://store/x`"


def test_report_page_puts_failures_first_with_the_plot_inline(failed_run):
    run, _, report = failed_run
    page = artifacts.report_markdown(report, str(run / "report"), str(run / "drafter"))
    assert page.startswith("# Stability check: **FAIL**")
    table = [line for line in page.splitlines() if line.startswith("| ")][1:]
    failing = [line for line in table if "| **FAIL** |" in line]
    assert len(failing) == len(report["failed"]) and table[:len(failing)] == failing
    assert all(f"**{name}**" in page for name in report["failed"])
    [(_, img, size)] = images(page)
    assert size <= artifacts.IMAGE_BUDGET and img.width >= 1000
    assert "file://" not in page and f"`{run}/report/stability.png`" in page


def test_report_page_shows_the_validation_picture_when_the_run_validated(tmp_path):
    train = [{"step": i, "loss": 3.0 - 0.01 * i, "grad_norm": 1.0, "clipped": False, "clip": 4.0,
              "nonfinite": False, "lr": 1e-3, "weight_by_slot": [0.6, 0.3, 0.1]} for i in range(60)]
    val = [{"kind": "val", "step": i, "val_loss": 2.5, "val_accept_len": 1.1 + 0.01 * i,
            "val_acc_by_slot": [0.5, 0.3, 0.1]} for i in (19, 39, 59)]
    metrics = write_jsonl(train[:20] + val[:1] + train[20:40] + val[1:2] + train[40:] + val[2:],
                          tmp_path / "metrics.jsonl")
    report = run_check(metrics, str(tmp_path / "report"), CheckConfig(spike_window=20, loss_window=20))
    page = artifacts.report_markdown(report, str(tmp_path / "report"), str(tmp_path / "drafter"))
    (_, stability, _), (alt, picture, size) = images(page)
    assert "by drafted slot" in alt and size <= artifacts.IMAGE_BUDGET and picture.height > stability.height / 2
    assert f"`{tmp_path}/report/validation.png`" in page


def test_plan_page_shows_shares_and_runs(tmp_path):
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in np.concatenate([rng.integers(20, 400, 1500), rng.integers(2000, 8000, 400)])]
    write_tokenized(str(tmp_path / "tok"), lengths)
    summary = run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"),
                       PlanConfig(max_tokens=16384, num_buckets=4, epochs=2))["plan"]
    page = artifacts.plan_markdown(summary, str(tmp_path / "plan"))
    [(alt, img, size)] = images(page)
    assert "bucket shares" in alt and size <= artifacts.IMAGE_BUDGET and img.width >= 800
    order = summary["order"]
    for bucket, run in order["longest_run"].items():
        assert f"| {bucket} | {run} | {order['random_shuffle_longest_run'][bucket]} |" in page
    assert f"plan.parquet: `{tmp_path}/plan/plan.parquet`" in page


def test_the_plan_strip_is_drawn_in_the_order_its_runs_are_measured(tmp_path):
    """The strip under the run bars follows plan.parquet's seq, as plan.json's longest runs do (it followed
    step, micro, rank: with grad_accum > 1 it showed runs of 3-6 beside bars saying 1)."""
    rng = np.random.default_rng(0)
    write_tokenized(str(tmp_path / "tok"), [int(x) for x in rng.integers(20, 2000, 1200)])
    summary = run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"),
                       PlanConfig(max_tokens=4096, num_buckets=4, world_size=2, grad_accum=3))["plan"]
    runs = longest_runs(artifacts._plan_buckets(str(tmp_path / "plan")), len(summary["buckets"]))
    assert {str(b): int(r) for b, r in enumerate(runs) if r} == summary["order"]["longest_run"]


def test_metrics_tail_reads_only_complete_new_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(str(path))
    assert tail.read_new() == []
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')
    assert [r["step"] for r in tail.read_new()] == [0, 1]
    with path.open("a") as fh:
        fh.write('ss": 1.5}\nnot json\n{"kind": "val", "step": 2, "val_loss": 1.2}\n')
    assert tail.read_new() == [{"step": 2, "loss": 1.5}, {"kind": "val", "step": 2, "val_loss": 1.2}]
    assert tail.unreadable == 1 and tail.read_new() == []
    path.write_text('{"step": 0}\n')  # a new run in the same folder: read from the start again
    assert tail.read_new() == [{"step": 0}]


def _log(uri: str, steps: range, resumed_at: int | None = None, loss: float = 2.0) -> None:
    """What a launch logs: steps `steps`, validated every 10th, resuming (rewriting the file) at `resumed_at`."""
    sink = JsonlSink(uri, resumed_at=resumed_at)
    for step in steps:
        sink.log({"step": step, "loss": loss, "time": 1_700_000_000.0 + step})
        if step % 10 == 9:
            sink.log({"kind": "val", "step": step, "val_loss": loss})
    sink.close()


@pytest.mark.parametrize("redone", [range(20, 30), range(0)], ids=["steps-logged-again", "nothing-logged-yet"])
def test_metrics_tail_starts_over_when_a_resume_rewrites_the_file(tmp_path, redone):
    # The tail kept its offset across the rewrite: it showed nothing of the redone steps (a file no shorter), or
    # sent steps 0-19 again (a shorter one), which the live page appended as duplicates.
    uri = str(tmp_path / "metrics.jsonl")
    _log(uri, range(30), loss=2.0)
    tail = MetricsTail(uri)
    assert len(tail.read_new()) == 33
    _log(uri, redone, resumed_at=20, loss=1.0)  # resumed from checkpoint step-20, redone at another lr
    records = tail.read_new()  # the whole file again, each step once with its latest values
    assert [(r.get("kind", "train"), r["step"], r.get("loss", r.get("val_loss"))) for r in records] == [
        (kind, step, 2.0 if step < 20 else 1.0) for step in range(20 + len(redone))
        for kind in ("train", "val")[:1 + (step % 10 == 9)]]
    assert tail.restarted  # for the live page: these records replace those it shows
    _log(uri, range(20 + len(redone), 32), resumed_at=20 + len(redone), loss=1.0)  # the launch goes on
    assert [r["step"] for r in tail.read_new() if "kind" not in r] == list(range(20 + len(redone), 32))
    assert not tail.restarted


def test_metrics_tail_tells_a_rewrite_of_the_same_size_on_an_object_store():
    # An object store has no inode, and each push replaces the object whole: the bytes before the offset tell.
    fs = fsspec.filesystem("memory")
    uri = f"memory://tail-{uuid.uuid4().hex[:8]}/metrics.jsonl"
    try:
        fs.pipe(uri, b'{"step": 0, "loss": 2.0}\n{"step": 1, "loss": 2.0}\n')
        tail = MetricsTail(uri)
        assert [r["step"] for r in tail.read_new()] == [0, 1]
        fs.pipe(uri, b'{"step": 0, "loss": 2.0}\n{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 2.0}\n')  # a push
        assert [r["step"] for r in tail.read_new()] == [2]
        fs.pipe(uri, b'{"step": 0, "loss": 2.0}\n{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 1.0}\n')  # a resume
        assert [r["loss"] for r in tail.read_new()] == [2.0, 1.0, 1.0]
        assert tail.restarted
    finally:
        fs.rm(uri.rsplit("/", 1)[0], recursive=True)


@pytest.mark.usefixtures("prefect_harness")  # TrainingProgress makes its artifact: else an ephemeral server, 20 s to start
def test_live_page_reads_a_long_file_a_chunk_at_a_time_and_keeps_only_what_it_shows(tmp_path, monkeypatch):
    """The live page's first poll after a resume reads the whole metrics.jsonl: in bounded reads, each record cut
    down to what the page shows as it is parsed (200,000 steps held 2 GB as whole records), and the page is the one
    whole records draw. `read_records` keeps every field unless given keys (the run summary gives SUMMARY_KEYS)."""
    lines = long_metrics(3000)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(lines))
    assert path.stat().st_size > 2 * MAX_READ
    refuse_big_reads(monkeypatch)
    records = MetricsTail(str(path)).read_new()
    assert records == [{k: v for k, v in json.loads(line).items() if k in PAGE_KEYS} for line in lines]
    assert set().union(*records) == set(PAGE_KEYS) and set(artifacts.LIVE_KEYS) < set(PAGE_KEYS)
    pages = []
    for keys in (PAGE_KEYS, None):
        progress = artifacts.TrainingProgress(3000, str(path), plot_every_s=0.0)
        progress.tail.keys = keys
        progress.poll()
        pages.append(progress.page())
    assert pages[0] == pages[1] and "### Validation" in pages[0]
    steps, val = read_records(str(path))
    assert steps + val == sorted(map(json.loads, lines), key=lambda r: "kind" in r)


def _synthetic_inputs(run, records, promotion=None):
    data = {"read": 1000, "kept": 990, "dropped": {"too_long": 7, "no_assistant": 3}, "tokens": 512_000,
            "supervised_tokens": 210_000}
    plan = {"num_steps": 1200, "num_micro_batches": 4800, "padding_efficiency": 0.93,
            "buckets": [{"bucket": b} for b in range(4)],
            "order": {"longest_run": {"3": 1}, "random_shuffle_longest_run": {"3": 7}}}
    train = {"steps": 1200, "elapsed_s": 3725.0, "final_loss": 0.61, "tokens_per_s": 5321.7}
    return dict(data=data, plan=plan, train=train, run_dir=str(run), promotion=promotion)


def test_summary_is_the_run_in_five_lines(failed_run, tmp_path):
    run, records, report = failed_run
    page = artifacts.summary_markdown(report=report, **_synthetic_inputs(run, records))
    lines = [line for line in page.splitlines() if re.match(r"\d\. \*\*", line)]
    assert [line.split("**")[1] for line in lines] == ["Data", "Plan", "Training", "Stability", "Drafter"]
    assert "990 of 1000 records kept (10 dropped: too_long 7, no_assistant 3), 512,000 tokens" in lines[0]
    assert "longest run of bucket 3 (the longest sequences): 1 micro-batches (random shuffle: 7)" in lines[1]
    assert "1200 steps in 1 h 02 min, final loss 0.61, 5,322 tokens/s" in lines[2]
    assert lines[3].startswith("4. **Stability**: **FAIL**; failed: " + ", ".join(report["failed"]))
    assert "no promotion decision" in lines[4] and "Promotion decision" not in page
    assert [alt for alt, _, _ in images(page)] == ["stability plot"]  # no val records: no validation curve


def test_summary_training_line_gives_the_steady_model_flops_rate(failed_run):
    run, records, report = failed_run
    inputs = _synthetic_inputs(run, records)
    inputs["train"] |= {"steady_tflops": 398.26, "steady_mfu": 0.40251}
    page = artifacts.summary_markdown(report=report, **inputs)
    assert "5,322 tokens/s (398.3 TFLOP/s per rank in steady state, MFU 40.3%)" in page
    inputs["train"] |= {"steady_mfu": None}  # CPU, or a GPU the peak table does not know
    page = artifacts.summary_markdown(report=report, **inputs)
    assert "5,322 tokens/s (398.3 TFLOP/s per rank in steady state)" in page


def test_summary_training_line_says_what_the_run_cost_over_its_launches(failed_run):
    run, records, report = failed_run
    inputs = _synthetic_inputs(run, records)
    cost = {"gpus": 8, "launch_gpu_hours": 8.0, "launches": 3, "failed_launches": 1, "wall_s": 6300.0,
            "gpu_hours": 14.0, "failed_gpu_hours": 4.0, "steps_redone": 41}
    inputs["train"] |= {"cost": cost}
    [line] = [x for x in artifacts.summary_markdown(report=report, **inputs).splitlines() if "**Training**" in x]
    assert line.endswith("; cost **14.00 GPU-hours** on 8 GPUs over 3 launches, 1 failed (4.00 GPU-hours in it); "
                         "41 steps trained again after resumes")
    assert artifacts.cost_phrase({**cost, "failed_launches": 0, "steps_redone": 0, "launches": 1}) == (
        "cost **14.00 GPU-hours** on 8 GPUs over 1 launch")
    assert artifacts.cost_phrase({**cost, "gpus": 0, "gpu_hours": 0.0, "failed_launches": 0, "steps_redone": 0}) == (
        "no GPU time (CPU): 1 h 45 min over 3 launches")
    assert artifacts.cost_phrase({**cost, "gpus": None, "gpu_hours": None, "steps_redone": 0}) == (
        "1 h 45 min over 3 launches, 1 failed (GPU count unknown)")


def test_summary_shows_validation_and_promotion_when_they_exist(failed_run, tmp_path):
    run, records, report = failed_run
    val = [{"kind": "val", "step": s, "val_loss": 2.0 - s / 1000, "val_accept_len": 1 + s / 800}
           for s in range(0, 1200, 200)]
    write_jsonl(records[:600] + val + records[600:], tmp_path / "metrics.jsonl")
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "stability.png").write_bytes((run / "report" / "stability.png").read_bytes())
    promotion = {"promoted": False, "reason": "tau 1.83 <= incumbent 1.91", "tau": 1.83, "incumbent_tau": 1.91,
                 "eval_set": "example://data", "details": {"nested": "left out"}}
    page = artifacts.summary_markdown(report=report, **_synthetic_inputs(tmp_path, records, promotion))
    assert "5. **Drafter**: " in page and "**not promoted** (tau 1.83 <= incumbent 1.91)" in page
    assert "validation at step 1000: loss 1, accept length 2.25" in page
    assert "| promoted | no |" in page and "| incumbent_tau | 1.91 |" in page and "nested" not in page
    pictures = images(page)
    assert [alt for alt, _, _ in pictures] == ["stability plot", "training and validation curves"]
    assert all(size <= artifacts.IMAGE_BUDGET for _, _, size in pictures)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.filterwarnings("ignore:Artifact creation outside of a flow or task run:FutureWarning")
def test_live_page_follows_metrics_and_validation(failed_run, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    _, records, _ = failed_run
    start = 1_700_000_000.0
    timed = [{**r, "time": start + 0.5 * r["step"], "tokens_per_s": 4200.0, "tflops": 412.345, "mfu": 0.41677}
             for r in records]
    path = tmp_path / "metrics.jsonl"
    progress = artifacts.TrainingProgress(len(records), str(path), plot_every_s=0.0)
    write_jsonl(timed[:400], path)
    progress.poll()
    with path.open("a") as fh:  # a validation record, and a record of a kind the page does not know
        fh.write(json.dumps({"kind": "val", "step": 399, "val_loss": 1.4, "val_accept_len": 1.7}) + "\n")
        fh.write(json.dumps({"kind": "eval-suite", "tau": 1.8}) + "\n")
    progress.poll()
    assert progress.figures() == {"step": f"400 / {len(records)}", "loss": timed[399]["loss"],
                                  "grad norm (pre-clip)": timed[399]["grad_norm"], "clip": 1.0,
                                  "tokens/s": "4,200", "TFLOP/s": "412.3", "MFU": "41.7%",
                                  "ETA": "6 min 40 s"}  # 800 steps left at 2 steps/s
    with get_client(sync_client=True) as client:
        page = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(
            any_=[progress.page_id, progress.bar_id])))
    live = next(a for a in page if a.id == progress.page_id)
    bar = next(a for a in page if a.id == progress.bar_id)
    assert "| 399 | 1.4 | 1.7 |" in live.data and "ETA" in live.data
    assert [alt for alt, _, _ in images(live.data)] == ["training curves"]
    assert bar.data == pytest.approx(100 * 400 / len(records))
    assert bar.description.startswith(f"step 400 / {len(records)} · loss ")
    assert "4,200 tokens/s · 412.3 TFLOP/s (MFU 41.7%) · ETA" in bar.description
    assert "GPU-hours" not in bar.description  # a CPU launch (gpus 0 or unknown): no GPU time to show

    # On 8 GPUs, resumed after launches that cost 2.0 GPU-hours, started 100 s before the first record: by step
    # 400 (record time start + 199.5 s) the run has cost 2 + 8 x 299.5 s; 800 steps at 2 steps/s are left.
    gpu = artifacts.TrainingProgress(len(records), str(path), plot_every_s=3600.0, gpus=8, earlier_gpu_hours=2.0,
                                     started=start - 100)
    gpu.poll()
    assert gpu.figures()["GPU-hours"] == f"{2 + 8 * 299.5 / 3600:,.1f} (at finish ~{2 + 8 * 699.5 / 3600:,.1f})"
    assert gpu.line().endswith(" · GPU-hours 2.7 (at finish ~3.6)")


@pytest.mark.parametrize("k", [4, 6, 12])
def test_the_plan_picture_keeps_bucket_labels_apart(k):
    """The production preset's six buckets with 5-digit edges ran their tick labels together."""
    from dflash_core.plan.plots import plan_figure

    edges = [0, 1024, 2048, 4617, 9983, 16384, 24576, 32768, 49152, 65536, 98304, 131072, 196608][:k + 1]
    buckets = [{"bucket": i, "lo": edges[i] + (i > 0), "hi": edges[i + 1], "sample_share": 1 / k,
                "batch_share": 1 / k, "samples_per_batch": 100 / (i + 1)} for i in range(k)]
    order = {"longest_run": {str(i): 2 for i in range(k)}, "random_shuffle_longest_run": {str(i): 6 for i in range(k)}}
    fig = plan_figure({"buckets": buckets, "order": order, "num_micro_batches": 400, "num_steps": 50},
                      np.arange(400) % k, 0)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[:2]:
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
        assert len(boxes) == k and all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:], strict=False))
    notes = [t.get_window_extent(renderer) for t in fig.axes[0].texts]
    assert all(a.x1 < b.x0 for a, b in zip(notes, notes[1:], strict=False))


def test_curves_of_one_step_have_whole_step_ticks():
    from dflash_core.monitor.curves import curves_figure

    fig = curves_figure([{"step": 0, "loss": 2.0, "grad_norm": 1.0}], [])
    fig.canvas.draw()
    ticks = [t.get_position()[0] for t in fig.axes[0].get_xticklabels()]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_curves_of_a_long_run_keep_a_one_step_spike():
    """200,000 steps are thinned for the page, but by each stretch's lowest and highest values: a one-step
    grad-norm spike and the lowest loss are drawn, the steps stay in order, and the point count stays bounded."""
    from dflash_core.monitor.curves import MAX_POINTS, curves_figure

    rng = np.random.default_rng(0)
    train = [{"step": i, "loss": 3.0 - i / 1e5 + rng.normal(0, 0.01), "grad_norm": 1.5, "clip": 1.0}
             for i in range(200_000)]
    train[123_457]["grad_norm"] = 500.0
    train[150_001]["loss"] = 0.1
    fig = curves_figure(train, [])
    loss, grad = (next(line for line in ax.lines if line.get_label() == label)
                  for ax, label in zip(fig.axes, ("train loss", "grad norm (pre-clip)"), strict=True))
    steps = grad.get_xdata()
    assert max(grad.get_ydata()) == 500.0 and 123_457 in steps and 0 in steps and 199_999 in steps
    assert min(loss.get_ydata()) == 0.1 and list(steps) == sorted(steps) and len(steps) <= 3 * MAX_POINTS


def test_free_text_renders_as_written_in_tables_and_pages(failed_run):
    """Errors and reasons carry `|`, `<path>` and newlines: each stays one cell, one line, shown as written."""
    text = "x | y\nz (dflash eval --against <root>/promoted/drafter)"
    table = artifacts.markdown_table([{"reason": text, "n": 1}])
    assert table.splitlines()[2] == ("| x \\| y z (dflash eval --against &lt;root&gt;/promoted/drafter) | 1 |")
    run, records, _ = failed_run
    inputs = _synthetic_inputs(run, records)
    page = artifacts.summary_markdown(**{**inputs, "train": None}, report=None, failure=("promote", text, False))
    assert "**FAILED** in `promote`: x \\| y z (dflash eval --against &lt;root&gt;/promoted/drafter)" in page


@pytest.mark.usefixtures("prefect_harness")
def test_a_cancelled_run_says_so_on_its_pages(failed_run, tmp_path):
    """A cancel from the UI (Prefect's TerminationSignal, SIGTERM) or an interrupt is no failure of the run: the
    pages say it was stopped by the signal and that a rerun resumes, not 'failed (TerminationSignal)'."""
    from prefect.exceptions import TerminationSignal

    why, cancelled = artifacts.stop_reason(TerminationSignal(signal=15))
    assert cancelled and why.startswith("stopped by SIGTERM (a cancel from the UI or CLI") and "resume" in why
    assert artifacts.stop_reason(KeyboardInterrupt())[0].startswith("stopped by SIGINT")
    failed = TrainingFailed("training failed on rank 0: OOM; full log: /x/train.log")
    failed.brief = "training failed on rank 0: OOM"
    assert artifacts.stop_reason(failed) == ("training failed on rank 0: OOM", False)
    assert artifacts.stop_reason(RuntimeError("first line\nsecond")) == ("first line", False)
    _log(str(tmp_path / "metrics.jsonl"), range(5), loss=2.0)
    progress = artifacts.TrainingProgress(40, str(tmp_path / "metrics.jsonl"))
    progress.poll(final=True, stopped=(why, cancelled))
    assert progress.figures()["ETA"] == "stopped (cancelled)" and f"**Cancelled**: {why}" in progress.page()
    run, records, _ = failed_run
    inputs = _synthetic_inputs(run, records)
    page = artifacts.summary_markdown(**{**inputs, "train": None}, report=None, failure=("train", why, cancelled))
    assert page.startswith(f"# Run summary\n\n**CANCELLED** in `train`: {why}")


def test_live_page_shows_each_step_once_after_a_resume_rewrites_the_metrics(tmp_path):
    uri = str(tmp_path / "metrics.jsonl")
    _log(uri, range(30), loss=2.0)
    progress = artifacts.TrainingProgress(40, uri, plot_every_s=3600.0)
    progress.poll()
    _log(uri, range(20, 25), resumed_at=20, loss=1.0)  # resumed from checkpoint step-20: steps 20-24 redone
    progress.poll()
    assert [(r["step"], r["loss"]) for r in progress.train] == [(s, 2.0 if s < 20 else 1.0) for s in range(25)]
    assert [r["step"] for r in progress.val] == [9, 19]
    assert progress.figures()["step"] == "25 / 40"


def test_the_samples_page_shows_the_first_samples_as_training_reads_them(tmp_path):
    """tokenized-samples: the first samples decoded from the written shards, where each came from, and the
    supervised text between « and »; a fence longer than any backtick run in the text."""
    from common.chat import data_config, tokenizer_dir
    from common.chat import write_jsonl as write_chat

    from dflash_core.data.tokenize import tokenize_dataset, written_samples

    chatml = tokenizer_dir("chatml")
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Sort the list {i} please."},
                                            {"role": "assistant", "content": "the model can sort the list ````"}]}
               for i in range(5)]
    write_chat(tmp_path / "d.jsonl", records)
    out = tmp_path / "tok"
    tokenize_dataset(str(tmp_path / "d.jsonl"), chatml, str(out), data_config(), block_size=2)
    samples = written_samples(str(out), chatml, 3)
    assert [(s["file"], s["record"], s["line"], s["id"]) for s in samples] == [
        ("d.jsonl", i, i + 1, f"r{i}") for i in range(3)]
    page = artifacts.samples_markdown(samples, str(out))
    assert page.startswith("## Training samples") and page.count("**d.jsonl record") == 3
    assert "<|im_start|>user\nSort the list 0 please.<|im_end|>\n<|im_start|>assistant\n" \
           "«the model can sort the list ````<|im_end|>»" in page
    assert "\n`````text\n" in page  # the text holds a run of four backticks
    assert written_samples(str(tmp_path / "empty"), chatml, 3) == []


@pytest.mark.usefixtures("prefect_harness")
def test_the_regenerate_bar_counts_resumed_records_and_tells_the_time_left():
    """The regenerate-progress artifact: records with an outcome (an earlier run's journaled ones included) of
    those the run works on, tokens/s and the time left; 100% with the counts at the end."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    from flows.regenerate_artifacts import RegenerateProgress

    def shown(progress: RegenerateProgress) -> tuple[float, str | None]:
        with get_client(sync_client=True) as client:
            (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(
                id=ArtifactFilterId(any_=[progress.artifact_id])))
        return float(artifact.data), artifact.description

    @flow
    def regenerating() -> list[tuple[float, str | None]]:
        progress = RegenerateProgress()
        progress.update({"records_done": 200, "records_resumed": 600, "records_total": 2000, "records_read": 800,
                         "tokens": 51200, "tokens_per_s": 853.3, "elapsed_s": 60.0, "eta_s": 3600})
        middle = shown(progress)
        progress.finish({"read": 2000, "kept": 1990, "tokens_generated": 512000})
        return [middle, shown(progress)]

    assert regenerating() == [
        (40.0, "800 / 2000 records regenerated (600 from an earlier run); 51200 tokens, 853.3 tokens/s, about "
               "1 h 00 min left"),
        (100.0, "2000 records, 1990 kept, 512000 tokens")]
