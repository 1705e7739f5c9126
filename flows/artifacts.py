"""What the flow-run page shows: plan table, interleaving, training progress, stability report."""

from __future__ import annotations

from typing import Any, cast
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from flows.storage import as_link, join


def publish_plan(summary: dict[str, Any], plan_dir: str) -> None:
    """The bucket table, what the interleaving bought, and a link to plan.parquet."""
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
    order = summary["order"]
    lines = ["| bucket | longest same-bucket run (plan) | longest run (random shuffle) |", "|---|---|---|"]
    for bucket, run in order["longest_run"].items():
        lines.append(f"| {bucket} | {run} | {order['random_shuffle_longest_run'].get(bucket, '-')} |")
    text = (
        f"## Interleaving\n{summary['num_micro_batches']} micro-batches in {summary['num_steps']} optimizer steps "
        f"(world size {summary['world_size']}, grad accum {summary['grad_accum']}).\n\n" + "\n".join(lines)
        + f"\n\nPer-step token CV: {summary['step_tokens_cv']:.4f}; "
        f"rank imbalance (slowest rank / mean - 1, mean over steps): {summary['rank_imbalance']:.2%} "
        f"(round-robin assignment: {summary['round_robin_rank_imbalance']['mean']:.2%})\n"
    )
    create_markdown_artifact(text, key="batch-interleaving", description="Longest same-bucket runs vs a shuffle")
    create_link_artifact(as_link(join(plan_dir, "plan.parquet")), link_text="plan.parquet",
                         key="batch-plan-file", description="One row per micro-batch, in training order")


class TrainingProgress:
    """A progress artifact that follows metrics.jsonl while training runs."""

    def __init__(self, num_steps: int) -> None:
        self.num_steps = max(1, num_steps)
        # create_progress_artifact is sync/async-compatible; called from sync code it returns the UUID
        self.artifact_id = cast(UUID, create_progress_artifact(0.0, key="training-progress",
                                                               description=f"0 / {self.num_steps} optimizer steps"))

    def update(self, record: dict[str, Any]) -> None:
        """Move the bar to the step of a metrics record."""
        done = int(record["step"]) + 1
        loss = record.get("loss")
        text = f"{done} / {self.num_steps} optimizer steps; loss {loss}, grad norm {record.get('grad_norm')}"
        update_progress_artifact(self.artifact_id, min(100.0, 100.0 * done / self.num_steps), description=text)


def publish_report(report: dict[str, Any], report_dir: str, drafter_dir: str) -> None:
    """The stability verdict, every figure against its threshold, links to the picture and the drafter."""
    lines = [f"# Stability check: **{report['verdict'].upper()}**", ""]
    lines += ["| figure | value | threshold | pass |", "|---|---|---|---|"]
    for name, fig in report.get("figures", {}).items():
        mark = {True: "yes", False: "**NO**"}.get(fig.get("pass"), "n/a")
        lines.append(f"| {name} | {_fmt(fig.get('value'))} | {_fmt(fig.get('threshold'))} | {mark} |")
    png = as_link(join(report_dir, "stability.png"))
    lines += ["", f"[stability.png]({png}) · [drafter]({as_link(drafter_dir)})"]
    create_markdown_artifact("\n".join(lines), key="stability-report", description="Post-run stability check")
    create_link_artifact(png, link_text="stability.png", key="stability-plot")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
