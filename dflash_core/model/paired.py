"""Two drafters compared response by response on the same prompts (the promotion gate, `dflash eval --against`).

Greedy speculative decoding writes the target's own output whichever drafter drafts, so two evaluations of the
same prompts decode the same responses: their acceptance lengths pair, and the noise of the prompts' difficulty
cancels out of the difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

DEFAULT_CONFIDENCE = 0.95  # of the reported lower bound, when no gate confidence is configured


def paired_gain(new: Sequence[float | None], old: Sequence[float | None], min_gain: float = 0.0,
                confidence: float = DEFAULT_CONFIDENCE) -> dict[str, Any]:
    """The gain of `new` over `old` (each response's mean acceptance length, in the same order; None for a
    response with no step, left out): the mean gain per response, its one-sided lower confidence bound, and the
    p-value of a one-sided paired t-test against a gain of min_gain or less."""
    if len(new) != len(old):
        return {"pairs": 0, "mean": None, "lower": None, "p_value": None, "confidence": confidence,
                "note": f"the drafters decoded different numbers of responses ({len(new)} vs {len(old)})"}
    diffs = np.array([a - b for a, b in zip(new, old, strict=True) if a is not None and b is not None])
    out: dict[str, Any] = {"pairs": len(diffs), "mean": float(diffs.mean()) if len(diffs) else None,
                           "lower": None, "p_value": None, "confidence": confidence}
    if len(diffs) < 2:
        return out | {"note": "fewer than 2 paired responses: no test"}
    sem = float(diffs.std(ddof=1)) / math.sqrt(len(diffs))
    if sem == 0.0:  # every response gained exactly the same: no spread to test against
        return out | {"lower": out["mean"], "p_value": 0.0 if out["mean"] > min_gain else 1.0}
    t = (out["mean"] - min_gain) / sem
    out["p_value"] = float(stats.t.sf(t, df=len(diffs) - 1))
    out["lower"] = out["mean"] - float(stats.t.ppf(confidence, df=len(diffs) - 1)) * sem
    return out
