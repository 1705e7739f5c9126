"""The promotion gate's artifact: the new drafter vs the promoted one, and the decision."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact

from flows.artifacts import md_text, storage_link


def promotion_markdown(decision: dict[str, Any]) -> str:
    """The decision as a markdown table: tau of both drafters on the same prompts, and why."""
    outcome = "PROMOTED" if decision["promoted"] else "NOT PROMOTED"
    prompts = decision["eval_set"]
    incumbent = md_text(decision.get("incumbent_run") or "none (nothing promoted yet)")
    lines = [
        f"# Promotion: **{outcome}**", "", md_text(decision["reason"]), "",
        "| drafter | run | tau | block size |", "|---|---|---|---|",
        f"| new | {md_text(decision['run'])} | {_fmt(decision['tau'])} | {_fmt(decision.get('block_size'))} |",
        f"| promoted (incumbent) | {incumbent} | {_fmt(decision['incumbent_tau'])} | "
        f"{_fmt(decision.get('incumbent_block_size'))} |", "",
        f"Stability verdict: {decision['verdict']}. Evaluation prompts: the first {prompts['limit']} of "
        f"`{prompts['data']}`, {prompts['max_new_tokens']} new tokens each.",
    ]
    gain = decision.get("gain")
    if gain and gain.get("mean") is not None:
        bound = (f", {gain['confidence']:.0%} lower bound {gain['lower']:+.4f}, one-sided p = {gain['p_value']:.3g}"
                 if gain.get("p_value") is not None else f" ({gain.get('note', 'no test')})")
        merged = f"; {gain['repeats']} repeated responses averaged in" if gain.get("repeats") else ""
        lines.append(f"\nPaired over {gain['pairs']} prompts (the same prompts and outputs{merged}): mean gain "
                     f"{gain['mean']:+.4f} per prompt{bound}.")
    if decision.get("promoted_drafter"):
        lines.append("\n" + storage_link(decision["promoted_drafter"], "promoted drafter", folder=True))
    if decision.get("wandb_artifact"):
        lines.append(f"W&B model artifact: `{decision['wandb_artifact']}`")
    return "\n".join(lines)


def publish_promotion(decision: dict[str, Any]) -> None:
    """Publish the promotion decision on the flow-run page."""
    create_markdown_artifact(promotion_markdown(decision), key="promotion",
                             description="New drafter vs the promoted one, and the decision")


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-" if value is None else md_text(str(value))
