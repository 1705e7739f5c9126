"""Config of the stability check and of the W&B sink."""

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from dflash_core.schema import StrictModel


class CheckConfig(StrictModel):
    """Stability thresholds. Breaking a hard figure fails the run; breaking a soft one warns.

    Hard (fail): non-finite steps, gradient-norm spike score, loss cliffs: what harms training.
    Soft (warn): clip rate and longest clipped run (constant clipping is a configuration smell: the report
    advises a threshold), robust spike rate, loss spikes, spike coincidence, long-bucket runs and their spikes,
    trends.
    Windows are in optimizer steps; for runs shorter than 5 windows they shrink to a fifth of the run, but
    never below `min_window`.
    """

    # A hard figure that cannot be computed (too few steps, a required field never logged) fails the run: the gate
    # never passes what it cannot judge. Only smoke runs of a few steps should set this to false.
    fail_unjudged: bool = True
    # Non-finite loss or gradient norm.
    max_nonfinite: NonNegativeInt = 0
    # Gradient-norm spikes: the OLMo 2 spike score (mean/std of the trailing window) ...
    spike_k: PositiveFloat = 7.0
    spike_window: PositiveInt = 1000
    max_spike_score: NonNegativeFloat = 0.001
    # ... and its robust variant (median/MAD of log grad norm over the same window).
    robust_k: PositiveFloat = 6.0
    max_robust_spike_rate: NonNegativeFloat = 0.01
    min_window: PositiveInt = Field(20, description="smallest trailing window after scaling down for short runs")
    # Clipping: share of steps whose pre-clip norm exceeded the threshold, and the longest run of them.
    max_clip_rate: float = Field(0.5, ge=0.0, le=1.0)
    max_clip_run: PositiveInt = 50
    # Loss spikes (transient) and cliffs (a jump that stays up for at least cliff_min_steps, then decays).
    loss_window: PositiveInt = 100
    loss_k: PositiveFloat = 6.0
    loss_min_jump: PositiveFloat = Field(0.1, description="a loss spike is at least this much above the median")
    cliff_min_steps: PositiveInt = 5
    max_loss_spike_rate: NonNegativeFloat = 0.005
    max_loss_cliffs: NonNegativeInt = 0
    # Do loss spikes follow gradient-norm spikes (same step or up to `coincidence_lag` steps before)?
    coincidence_lag: NonNegativeInt = 5
    coincidence_alpha: float = Field(0.05, gt=0.0, lt=1.0)
    # Batch composition: a long-bucket step has at least `long_share` of its micro-batches in the longest bucket.
    long_share: float = Field(0.75, gt=0.0, le=1.0)
    long_run_min: PositiveInt = 3
    max_long_bucket_run: PositiveInt = 10
    max_long_run_spike_lift: PositiveFloat = 3.0
    # Trends: loss at the end over loss at the start; fitted growth of the grad norm over the run.
    max_loss_end_ratio: PositiveFloat = 1.0
    max_grad_norm_growth: PositiveFloat = 2.0
    # Baseline: report.json of an earlier healthy run; a figure worse by more than the tolerance regresses.
    baseline: str | None = Field(None, description="report.json of an earlier healthy run")
    baseline_tolerance: NonNegativeFloat = 0.5
    baseline_severity: Literal["warn", "fail"] = "warn"

    @model_validator(mode="after")
    def _windows(self) -> "CheckConfig":
        if self.min_window > min(self.spike_window, self.loss_window):
            raise ValueError(
                f"check.min_window ({self.min_window}) must not exceed spike_window ({self.spike_window}) "
                f"or loss_window ({self.loss_window})"
            )
        return self


class WandbConfig(StrictModel):
    """Weights & Biases sink: offline by default, online only when a key is configured."""

    enabled: bool = True
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "dflash"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = Field(default_factory=list)
