"""Two drafters compared response by response on the same prompts (the promotion gate, `dflash eval --against`).

Greedy speculative decoding writes the target's own output whichever drafter drafts, so two evaluations of the
same prompts decode the same responses: their acceptance lengths pair, and the noise of the prompts' difficulty
cancels out of the difference. Responses to the same prompt (a suite that `--sample-shuffle server` wraps round,
a prompt listed twice) are not independent pairs: their gains are averaged into one before the test.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from scipy import stats

DEFAULT_CONFIDENCE = 0.95  # of the reported lower bound, when no gate confidence is configured


def paired_gain(new: Sequence[float | None], old: Sequence[float | None], min_gain: float = 0.0,
                confidence: float = DEFAULT_CONFIDENCE, prompts: Sequence[Hashable] | None = None,
                old_prompts: Sequence[Hashable] | None = None) -> dict[str, Any]:
    """The gain of `new` over `old` (each response's mean acceptance length, in the same order; None for a
    response with no step, left out): the mean gain per prompt, its one-sided lower confidence bound, and the
    p-value of a one-sided paired t-test against a gain of min_gain or less.

    `prompts` names each response's prompt (`old_prompts` the other evaluation's, which must be the same list):
    the responses to one prompt count as one pair, their mean gain, so a repeated prompt neither weighs more nor
    narrows the bound. "pairs" is the number of pairs tested, "repeats" the responses merged into them."""
    if len(new) != len(old):
        return _untested(confidence, f"the drafters decoded different numbers of responses ({len(new)} vs "
                                     f"{len(old)})")
    if old_prompts is not None and prompts is not None and list(prompts) != list(old_prompts):
        return _untested(confidence, "the drafters decoded different prompts: nothing pairs")
    keys = prompts if prompts is not None else range(len(new))
    by_prompt: dict[Hashable, list[float]] = {}
    for key, a, b in zip(keys, new, old, strict=True):  # strict: a key for every response
        if a is not None and b is not None:
            by_prompt.setdefault(key, []).append(a - b)
    diffs = np.array([float(np.mean(gains)) for gains in by_prompt.values()])
    repeats = sum(len(gains) - 1 for gains in by_prompt.values())
    out: dict[str, Any] = {"pairs": len(diffs), "mean": float(diffs.mean()) if len(diffs) else None,
                           "lower": None, "p_value": None, "confidence": confidence}
    if repeats:
        out["repeats"] = repeats
    if len(diffs) < 2:
        return out | {"note": "fewer than 2 paired prompts: no test"}
    sem = float(diffs.std(ddof=1)) / math.sqrt(len(diffs))
    if sem == 0.0:  # every prompt gained exactly the same: no spread to test against
        return out | {"lower": out["mean"], "p_value": 0.0 if out["mean"] > min_gain else 1.0}
    t = (out["mean"] - min_gain) / sem
    out["p_value"] = float(stats.t.sf(t, df=len(diffs) - 1))
    out["lower"] = out["mean"] - float(stats.t.ppf(confidence, df=len(diffs) - 1)) * sem
    return out


def _untested(confidence: float, note: str) -> dict[str, Any]:
    """The gain of two evaluations that do not pair: nothing to test, and why."""
    return {"pairs": 0, "mean": None, "lower": None, "p_value": None, "confidence": confidence, "note": note}
