"""What the flow-run page shows: plan, live training figures, stability report and the run's summary.

Pictures are inline (data: URIs in markdown), so the page stays whole in any browser after the worker is gone;
files are named by storage URIs a user can open (cloud console pages for s3:// and gs://, plain paths otherwise).
"""

from __future__ import annotations

import base64
import io
import math
import re
import signal
import threading
import time
from typing import Any, cast
from uuid import UUID

import fsspec
import numpy as np
import polars as pl
from matplotlib.figure import Figure
from PIL import Image
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from dflash_core.monitor.curves import curves_figure
from dflash_core.monitor.validation_plot import VALIDATION_PNG
from dflash_core.plan.plots import plan_figure
from flows import storage
from flows.metrics_tail import LIVE_KEYS, SUMMARY_KEYS, MetricsTail, is_step, is_val, read_records

# Size budget of one inline picture: 64 KB of PNG (~87 KB as base64). A page holds at most three pictures,
# so an artifact stays well under 300 KB and the run page opens quickly; the full-resolution files stay linked.
IMAGE_BUDGET = 64 * 1024
MIN_WIDTH = 320  # narrower than this a plot is unreadable: over budget there is an error, not a smaller picture
# Plain words, no emoji: a headless or minimal browser without an emoji font draws empty boxes.
STATUS_MARK = {"fail": "**FAIL**", "warn": "*warn*", "pass": "pass", "info": "info"}


class ImageBudgetError(ValueError):
    """A picture that does not fit its inline size budget even at the narrowest readable width."""


# --- helpers shared by every artifact (other stages' artifacts use them too) -----------------------------------

def inline_png(image: Figure | bytes | str, alt: str, max_bytes: int = IMAGE_BUDGET) -> str:
    """A markdown image holding the picture inline (data: URI); a figure, PNG bytes or a PNG's URI, fit to budget."""
    png = compact_png(_png_bytes(image), max_bytes, alt)
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


def compact_png(png: bytes, max_bytes: int = IMAGE_BUDGET, name: str = "picture") -> bytes:
    """The PNG as is when it fits; else as a palette PNG (plots have few colours), narrower until it fits."""
    if len(png) <= max_bytes:
        return png
    with Image.open(io.BytesIO(png)) as img:
        rgb = img.convert("RGB")
    width = rgb.width
    floor = min(MIN_WIDTH, width)  # narrow it, never widen it
    while True:
        scaled = rgb.resize((width, round(rgb.height * width / rgb.width)), Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        scaled.quantize(64, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(
            buf, format="PNG", optimize=True)
        if buf.tell() <= max_bytes:
            return buf.getvalue()
        if width == floor:
            raise ImageBudgetError(f"{name}: {buf.tell()} bytes at {floor} px wide, over the budget of "
                                   f"{max_bytes} bytes; raise max_bytes or draw a simpler figure")
        width = max(floor, int(width * 0.8))


def _png_bytes(image: Figure | bytes | str) -> bytes:
    if isinstance(image, Figure):
        buf = io.BytesIO()
        image.savefig(buf, format="png")
        return buf.getvalue()
    if isinstance(image, bytes):
        return image
    with fsspec.open(image, "rb") as fh:
        return fh.read()


def storage_link(uri: str, text: str | None = None, folder: bool = False) -> str:
    """Markdown naming a stored file: a console link for s3:// / gs://, else the plain path (never file://)."""
    console = storage.console_url(uri, folder)
    if console:
        return f"[{text or uri}]({console})"
    path = f"`{storage.display_path(uri)}`"
    return f"{text}: {path}" if text else path


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table with the first row's keys as columns; floats to 4 significant digits."""
    if not rows:
        return ""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def decision_table(decision: dict[str, Any]) -> str:
    """A promotion (or any) decision as a two-column table of its scalar fields, in the dict's order."""
    rows = [{"": key, "value": value} for key, value in decision.items()
            if value is None or isinstance(value, str | int | float | bool)]
    return markdown_table(rows)


def update_markdown_artifact(artifact_id: UUID, markdown: str) -> None:
    """Replace a markdown artifact's content in place (one artifact per page, not one version per update)."""
    with get_client(sync_client=True) as client:
        client.update_artifact(artifact_id, ArtifactUpdate(data=markdown))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.4g}" if isinstance(value, float) else md_text(str(value))


def md_text(text: str) -> str:
    """Free text (an error, a path, a reason) as one markdown line that renders as written: a `|` would split a
    table cell, `<root>` vanish as an HTML tag, a newline start a stray row."""
    return " ".join(text.split("\n")).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def stop_reason(exc: BaseException) -> tuple[str, bool]:
    """Why a stage stopped, one line, and whether a signal stopped it (a cancel from the UI or CLI, a pod's
    eviction: SIGTERM, or an interrupt) rather than a failure of its own. A training failure gives its brief
    message (TrainingFailed.brief: without the log's path, which the task's error in the flow log names)."""
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, TerminationSignal | KeyboardInterrupt):
        number = getattr(exc, "signal", signal.SIGINT)
        cause = "Ctrl-C" if number == signal.SIGINT else "a cancel from the UI or CLI, or the machine's eviction"
        return (f"stopped by {signal.Signals(number).name} ({cause}); the run folder keeps its checkpoints: run it "
                f"again to resume", True)
    return (str(getattr(exc, "brief", "") or exc).strip().splitlines() or [""])[0] or type(exc).__name__, False


# --- data ------------------------------------------------------------------------------------------------------

def samples_markdown(samples: list[dict[str, Any]], tokenized: str) -> str:
    """The first samples as training reads them: each one's rendered text, the supervised spans in « »."""
    from dflash_core.data.tokenize import shown

    parts = ["## Training samples",
             f"The first {len(samples)} samples of {storage_link(tokenized, 'the tokenized data', folder=True)}, "
             "decoded: the drafter learns to write the text between « and » (the loss mask); the rest is "
             "context.", ""]
    for sample in samples:
        header, text = shown(sample)
        longest = max((len(run) for run in re.findall("`+", text)), default=0)
        fence = "`" * max(3, longest + 1)  # longer than any run of backticks in the text
        parts += [f"**{header}**", "", f"{fence}text", text, fence, ""]
    return "\n".join(parts)


def publish_samples(samples: list[dict[str, Any]], tokenized: str) -> str:
    """The `tokenized-samples` artifact (samples_markdown)."""
    text = samples_markdown(samples, tokenized)
    create_markdown_artifact(text, key="tokenized-samples", description="The first samples as training reads them")
    return text


# --- plan ------------------------------------------------------------------------------------------------------

def publish_plan(summary: dict[str, Any], plan_dir: str) -> str:
    """The bucket table, and a page with the plan's picture, what the interleaving bought and the files."""
    rows = [
        {
            "bucket": b["bucket"],
            "edges": f"{b['lo']}-{b['hi']}",
            "share of samples": round(b["sample_share"], 4),
            "share of batches": round(b["batch_share"], 4),
            "samples per batch": round(b["samples_per_batch"], 2),
            "padding efficiency": round(b["padding_efficiency"], 4),
        }
        for b in summary["buckets"]
    ]
    create_table_artifact(rows, key="batch-plan", description="Length buckets of the batch plan")
    text = plan_markdown(summary, plan_dir)
    create_markdown_artifact(text, key="batch-interleaving", description="Bucket shares and same-bucket runs")
    return text


def plan_markdown(summary: dict[str, Any], plan_dir: str) -> str:
    """The plan page: the picture, longest runs against a shuffle, step and rank balance, links to the files."""
    order = summary["order"]
    runs = [{"bucket": b, "longest same-bucket run (plan)": run,
             "longest run (random shuffle)": order["random_shuffle_longest_run"].get(b, "-")}
            for b, run in order["longest_run"].items()]
    picture = plan_figure(summary, _plan_buckets(plan_dir), summary.get("seed") or 0)
    return "\n".join([
        "## Batch plan",
        f"{summary['num_micro_batches']} micro-batches in {summary['num_steps']} optimizer steps "
        f"(world size {summary['world_size']}, grad accum {summary['grad_accum']}).", "",
        inline_png(picture, "batch plan: bucket shares and same-bucket runs"), "",
        markdown_table(runs), "",
        f"Per-step token CV: {summary['step_tokens_cv']:.4f}; "
        f"rank imbalance (slowest rank / mean - 1, mean over steps): {summary['rank_imbalance']:.2%} "
        f"(round-robin assignment: {summary['round_robin_rank_imbalance']['mean']:.2%})", "",
        f"Files: {storage_link(storage.join(plan_dir, 'plan.parquet'), 'plan.parquet')} · "
        f"{storage_link(storage.join(plan_dir, 'plan.json'), 'plan.json')}",
    ])


def _plan_buckets(plan_dir: str) -> np.ndarray:
    """The bucket of every planned micro-batch in the plan's interleaved sequence (its `seq` column), the order
    plan.json's longest runs are measured in, so the strip and the bars tell the same story."""
    with fsspec.open(storage.join(plan_dir, "plan.parquet"), "rb") as fh:
        plan = pl.read_parquet(fh, columns=["seq", "bucket"])
    return plan.sort("seq")["bucket"].to_numpy()


# --- training --------------------------------------------------------------------------------------------------

class TrainingProgress:
    """The progress bar and a live page (figures, curves, validation) that follow a growing metrics.jsonl."""

    def __init__(self, num_steps: int, metrics_uri: str, plot_every_s: float = 60.0, gpus: int | None = None,
                 earlier_gpu_hours: float = 0.0, started: float | None = None) -> None:
        """`gpus`: what this launch holds (the page then shows the run's GPU-hours so far and projected to the
        finish); `earlier_gpu_hours`: the run's earlier launches' (launches.jsonl); `started`: this launch's
        start (epoch seconds; now by default)."""
        self.num_steps, self.plot_every_s = max(1, num_steps), plot_every_s
        self.gpus, self.earlier_gpu_hours = gpus, earlier_gpu_hours
        self.started = time.time() if started is None else started
        self.tail = MetricsTail(metrics_uri)
        self.train: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []
        self.picture, self.plotted_at, self.finished = "", -math.inf, False
        self.stopped: tuple[str, bool] | None = None  # why the launch stopped, once it has (stop_reason)
        self.lock = threading.Lock()  # the follower's poll and the task's final one never interleave
        # Called from a synchronous task, so these return the ids themselves, not coroutines.
        self.bar_id = cast(UUID, create_progress_artifact(0.0, key="training-progress",
                                                          description=f"0 / {self.num_steps} optimizer steps"))
        self.page_id = cast(UUID, create_markdown_artifact(self.page(), key="training-live",
                                                           description="Live training figures and curves"))

    def poll(self, final: bool = False, stopped: tuple[str, bool] | None = None) -> None:
        """Read the records appended since the last poll; update the bar, the page, and (throttled) the curves.
        `final`: the launch ended (the curves are drawn whatever the throttle); `stopped`: it failed or was
        cancelled, and why (stop_reason: the page says so in place of an ETA)."""
        with self.lock:
            self._poll(final, stopped)

    def _poll(self, final: bool, stopped: tuple[str, bool] | None) -> None:
        self.stopped = stopped
        new = self.tail.read_new()
        if self.tail.restarted:  # metrics.jsonl rewritten (a resume logs the steps after its checkpoint again)
            self.train, self.val = [], []
        elif not new and not final:
            return
        self.val += [r for r in new if is_val(r)]
        # Only what the page shows: a full record has ~30 keys, and a long run logs tens of thousands of them.
        self.train += [{k: r.get(k) for k in LIVE_KEYS} for r in new if is_step(r)]
        self.finished = final
        if final or time.monotonic() - self.plotted_at >= self.plot_every_s:
            # Rendering costs ~1 s of CPU that training wants: the figures update every poll, the curves less.
            self.picture = inline_png(curves_figure(self.train, self.val), "training curves") if self.train else ""
            self.plotted_at = time.monotonic()
        done = int(self.train[-1]["step"]) + 1 if self.train else 0
        update_progress_artifact(self.bar_id, min(100.0, 100.0 * done / self.num_steps), description=self.line())
        update_markdown_artifact(self.page_id, self.page())

    def figures(self) -> dict[str, Any]:
        """The live figures: step, loss, pre-clip grad norm and clip, tokens/s, model TFLOP/s (all ranks) and MFU
        (MFU "-" where the GPU's peak is unknown, and on CPU), ETA (from the records' times)."""
        last = self.train[-1] if self.train else {}
        done = int(last["step"]) + 1 if last else 0
        eta = None if self.finished else self._eta_s(done)
        figures = {"step": f"{done} / {self.num_steps}", "loss": last.get("loss"),
                   "grad norm (pre-clip)": last.get("grad_norm"), "clip": last.get("clip"),
                   "tokens/s": _rate(last.get("tokens_per_s")), "TFLOP/s": _tflops(last.get("tflops")),
                   "MFU": _percent(last.get("mfu")),
                   "ETA": self._stopped_eta() or ("finished" if self.finished else duration(eta))}
        if self.gpus:  # the run's cost (all its launches) by the newest record, and at this pace to the finish
            elapsed = max(0.0, float(last.get("time") or self.started) - self.started)
            now = self.earlier_gpu_hours + self.gpus * elapsed / 3600
            finish = "" if eta is None else f" (at finish ~{now + self.gpus * eta / 3600:,.1f})"
            figures["GPU-hours"] = f"{now:,.1f}{finish}"
        return figures

    def _stopped_eta(self) -> str | None:
        if self.stopped is None:
            return None
        return "stopped (cancelled)" if self.stopped[1] else "stopped (failed)"

    def line(self) -> str:
        """The figures in one line, for the progress bar."""
        f = self.figures()
        return (f"step {f['step']} · loss {_fmt(f['loss'])} · grad norm {_fmt(f['grad norm (pre-clip)'])} "
                f"(clip {_fmt(f['clip'])}) · {f['tokens/s']} tokens/s · {f['TFLOP/s']} TFLOP/s (MFU {f['MFU']}) "
                f"· ETA {f['ETA']}" + (f" · GPU-hours {f['GPU-hours']}" if "GPU-hours" in f else ""))

    def page(self) -> str:
        """The live page: the figures table, the latest validation, the curves."""
        lines = ["## Training", markdown_table([self.figures()]), ""]
        if self.stopped:
            lines[1:1] = [f"**{'Cancelled' if self.stopped[1] else 'Stopped'}**: {md_text(self.stopped[0])}", ""]
        if self.val:
            lines += ["### Validation", markdown_table([_val_row(r) for r in self.val[-5:]]), ""]
        if self.picture:
            lines += [self.picture, ""]
        return "\n".join(lines)

    def _eta_s(self, done: int) -> float | None:
        """Remaining steps at the pace of the last (up to) 50 logged steps, by the records' wall-clock times."""
        timed = [r for r in self.train[-50:] if isinstance(r.get("time"), int | float)]
        if len(timed) < 2 or timed[-1]["time"] <= timed[0]["time"]:
            return None
        pace = (timed[-1]["step"] - timed[0]["step"]) / (timed[-1]["time"] - timed[0]["time"])
        return (self.num_steps - done) / pace if pace > 0 else None


def _val_row(record: dict[str, Any]) -> dict[str, Any]:
    return {"step": record.get("step"), "validation loss": record.get("val_loss"),
            "accept length": record.get("val_accept_len")}


def _rate(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, int | float) else "-"


def _tflops(value: Any) -> str:
    return f"{value:,.1f}" if isinstance(value, int | float) else "-"


def _percent(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "-"


def duration(seconds: float | None) -> str:
    """A wall-clock span as the pages show it ("1 h 05 min", "3 min 20 s"; "-" when unknown)."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


# --- stability report ------------------------------------------------------------------------------------------

def publish_report(report: dict[str, Any], report_dir: str, drafter_dir: str) -> str:
    """The stability verdict, failing figures first and marked, the plot inline, links to the files."""
    text = report_markdown(report, report_dir, drafter_dir)
    create_markdown_artifact(text, key="stability-report", description="Post-run stability check")
    return text


def report_markdown(report: dict[str, Any], report_dir: str, drafter_dir: str) -> str:
    """The report page (see publish_report)."""
    figures = report.get("figures", {})
    rank = {"fail": 0, "warn": 1}
    names = sorted(figures, key=lambda n: rank.get(figures[n].get("status"), 2))
    rows = [{"figure": f"**{n}**" if figures[n].get("status") == "fail" else n,
             "value": figures[n].get("value"),
             "threshold": f"{figures[n].get('op', '')} {_fmt(figures[n].get('threshold'))}".strip(),
             "status": STATUS_MARK.get(figures[n].get("status"), str(figures[n].get("status"))),
             "what it means": figures[n].get("summary", "")} for n in names]
    failed = report.get("failed") or []
    lines = [f"# Stability check: **{report['verdict'].upper()}**", ""]
    if failed:
        lines += ["Failed: " + ", ".join(f"**{n}**" for n in failed), ""]
    png = storage.join(report_dir, "stability.png")
    lines += [markdown_table(rows), "", inline_png(png, "stability plot: loss, grad norm, bucket mix"), ""]
    links = [storage_link(png, "stability.png")]
    if (report.get("files") or {}).get("validation"):  # the run logged validation records
        validation = storage.join(report_dir, VALIDATION_PNG)
        lines += [inline_png(validation, "validation curves, then accuracy and loss weight by drafted slot"), ""]
        links.append(storage_link(validation, VALIDATION_PNG))
    links += [storage_link(storage.join(report_dir, "report.md"), "report.md"),
              storage_link(drafter_dir, "drafter", folder=True)]
    lines.append("Full resolution: " + " · ".join(links))
    return "\n".join(lines)


# --- the run in five lines -------------------------------------------------------------------------------------

def publish_summary(*, data: dict[str, Any] | None, plan: dict[str, Any] | None, train: dict[str, Any] | None,
                    report: dict[str, Any] | None, run_dir: str | None, promotion: dict[str, Any] | None = None,
                    failure: tuple[str, str, bool] | None = None) -> str:
    """The flow run's summary artifact: data, plan, training, stability, drafter/promotion, and the pictures.
    A run that failed or was cancelled (`failure`: the stage, why (stop_reason) and whether a signal stopped it)
    gets one too: what it did, what it cost (the launch ledger), and why it stopped. Before planning there is no
    run folder (`run_dir` None) and data or plan may be None: the page says the stage it stopped in, so that the
    latest `run-summary` is never an earlier night's."""
    text = summary_markdown(data=data, plan=plan, train=train, report=report, run_dir=run_dir, promotion=promotion,
                            failure=failure)
    create_markdown_artifact(text, key="run-summary", description="The run in five lines")
    return text


def summary_markdown(*, data: dict[str, Any] | None, plan: dict[str, Any] | None, train: dict[str, Any] | None,
                     report: dict[str, Any] | None, run_dir: str | None, promotion: dict[str, Any] | None = None,
                     failure: tuple[str, str, bool] | None = None) -> str:
    """The summary page (see publish_summary); validation curves appear when metrics.jsonl has val records."""
    steps, val = ([], []) if run_dir is None else \
        read_records(storage.join(run_dir, "metrics.jsonl"), SUMMARY_KEYS)  # not whole: 200k steps are GBs
    before = "not reached (the run stopped before)"
    lines = ["# Run summary", ""]
    if failure:
        lines += [f"**{'CANCELLED' if failure[2] else 'FAILED'}** in `{failure[0]}`: {md_text(failure[1])}", ""]
    training = _train_line(train, val) if train else _stopped_train_line(steps, run_dir) if run_dir else before
    drafter = storage_link(storage.join(run_dir, "drafter"), folder=True) if run_dir else "none trained"
    lines += [f"1. **Data**: {_data_line(data) if data else before}",
              f"2. **Plan**: {_plan_line(plan) if plan else before}",
              f"3. **Training**: {training}",
              f"4. **Stability**: {_verdict_line(report) if report else 'not checked (the run stopped before)'}",
              f"5. **Drafter**: {drafter}; {_promotion_line(promotion)}", ""]
    if promotion:
        lines += ["## Promotion decision", decision_table(promotion), ""]
    if report and run_dir:
        lines += [inline_png(storage.join(run_dir, "report", "stability.png"), "stability plot"), ""]
    if val:
        lines += [inline_png(curves_figure(steps, val), "training and validation curves"), ""]
    return "\n".join(lines)


def _data_line(data: dict[str, Any]) -> str:
    reasons = data.get("dropped") or {}
    dropped = sum(reasons.values())
    top = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    why = ": " + ", ".join(f"{r} {n}" for r, n in top) + (", ..." if len(reasons) > 3 else "") if top else ""
    return (f"{data.get('kept')} of {data.get('read')} records kept ({dropped} dropped{why}), "
            f"{_rate(data.get('tokens'))} tokens, {_rate(data.get('supervised_tokens'))} supervised")


def _plan_line(plan: dict[str, Any]) -> str:
    last = str(len(plan["buckets"]) - 1)
    order = plan["order"]
    return (f"{plan['num_steps']} steps, {plan['num_micro_batches']} micro-batches in {len(plan['buckets'])} "
            f"buckets; longest run of bucket {last} (the longest sequences): {order['longest_run'].get(last, 0)} "
            f"micro-batches (random shuffle: {order['random_shuffle_longest_run'].get(last, 0)}); "
            f"padding efficiency {plan['padding_efficiency']:.1%}")


def _train_line(train: dict[str, Any], val: list[dict[str, Any]]) -> str:
    line = (f"{train.get('steps')} steps in {duration(train.get('elapsed_s'))}, final loss "
            f"{_fmt(train.get('final_loss'))}, {_rate(train.get('tokens_per_s'))} tokens/s")
    if train.get("steady_tflops") is not None:  # per rank, warm-up and compiling steps left out
        line += (f" ({_tflops(train['steady_tflops'])} TFLOP/s per rank in steady state"
                 + (f", MFU {_percent(train['steady_mfu'])}" if train.get("steady_mfu") is not None else "") + ")")
    if val:
        line += (f"; validation at step {val[-1].get('step')}: loss {_fmt(val[-1].get('val_loss'))}, "
                 f"accept length {_fmt(val[-1].get('val_accept_len'))}")
    if train.get("cost"):
        line += "; " + cost_phrase(train["cost"])
    return line


def _stopped_train_line(steps: list[dict[str, Any]], run_dir: str) -> str:
    """Training of a run that failed in or after it: the steps metrics.jsonl holds and the launches' cost."""
    from dflash_core.runtime.ledger import read_launches, run_cost

    line = f"stopped after {len(steps)} logged steps" if steps else "no step logged"
    if steps:
        line += f", last loss {_fmt(steps[-1].get('loss'))}"
    launches = read_launches(run_dir)
    return line + ("; " + cost_phrase(run_cost(launches)) if launches else "")


def cost_phrase(cost: dict[str, Any]) -> str:
    """The run's training cost over all its launches (runtime/ledger.py run_cost), as the summary page says it."""
    n, failed = cost["launches"], cost.get("failed_launches") or 0
    launches = f"{n} launch{'es' if n != 1 else ''}" + (f", {failed} failed" if failed else "")
    if cost.get("gpus") == 0:
        text = f"no GPU time (CPU): {duration(cost.get('wall_s'))} over {launches}"
    elif cost.get("gpu_hours") is None:
        text = f"{duration(cost.get('wall_s'))} over {launches} (GPU count unknown)"
    else:
        text = f"cost **{cost['gpu_hours']:,.2f} GPU-hours** on {cost['gpus']} GPUs over {launches}"
        if failed and cost.get("failed_gpu_hours") is not None:
            text += f" ({cost['failed_gpu_hours']:,.2f} GPU-hours in {'it' if failed == 1 else 'them'})"
    if cost.get("steps_redone"):
        text += f"; {cost['steps_redone']} steps trained again after resumes"
    return text


def _verdict_line(report: dict[str, Any]) -> str:
    failed = report.get("failed") or []
    warned = report.get("warned") or []
    return (f"**{report['verdict'].upper()}**" + (f"; failed: {', '.join(failed)}" if failed else "")
            + (f"; warnings: {', '.join(warned)}" if warned else ""))


def _promotion_line(promotion: dict[str, Any] | None) -> str:
    if not promotion:
        return "no promotion decision in this run"
    verb = "**promoted**" if promotion.get("promoted") else "**not promoted**"
    reason = promotion.get("reason")
    return verb + (f" ({reason})" if reason else "")
