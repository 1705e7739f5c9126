"""Config of the stability check and of the W&B sink."""

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from dflash_core.schema import StrictModel


class CheckConfig(StrictModel):
    """Stability thresholds. Breaking a hard figure fails the run; breaking a soft one warns.

    Hard (fail): non-finite steps, gradient-norm spike score, loss cliffs, a loss that climbed back up or a
    gradient norm that grew by a multiple by the end of the run: what harms training.
    Soft (warn): steps missing from the log, clip rate and longest clipped run (constant clipping is a
    configuration smell: the report advises a threshold), robust spike rate, loss spikes, spike coincidence,
    long-bucket runs and their spikes, trends.
    Windows are in optimizer steps; for runs shorter than 5 windows they shrink to a fifth of the run, but
    never below `min_window`.
    """

    # A hard figure that cannot be computed (too few steps, a required field never logged) fails the run: the gate
    # never passes what it cannot judge. Only smoke runs of a few steps should set this to false.
    fail_unjudged: bool = Field(
        True, description="a hard figure that cannot be computed (too few steps, loss or grad_norm not logged) fails "
        "the run; false only for smoke runs")
    # Non-finite loss or gradient norm.
    max_nonfinite: NonNegativeInt = Field(
        0, description="hard: steps allowed with a non-finite loss or gradient norm (or logged as skipped)")
    # Steps the log does not show: a gap in the step sequence, or a record without its loss or grad norm.
    max_unlogged_steps: NonNegativeInt = Field(
        0, description="soft: steps allowed without a record, or whose record lacks loss or grad_norm (the check "
        "cannot see what happened in them)")
    # Gradient-norm spikes: the OLMo 2 spike score (mean/std of the trailing window) ...
    spike_k: PositiveFloat = Field(
        7.0, description="a gradient-norm spike is a pre-clip norm above the trailing mean + spike_k std")
    spike_window: PositiveInt = Field(
        1000, description="trailing window of both gradient-norm spike figures, in optimizer steps")
    max_spike_score: NonNegativeFloat = Field(
        0.001, description="hard: largest share of scored steps allowed to be gradient-norm spikes (the OLMo 2 "
        "spike score)")
    # ... and its robust variant (median/MAD of log grad norm over the same window).
    robust_k: PositiveFloat = Field(
        6.0, description="a robust spike is a log grad norm above the trailing median + robust_k MAD (scaled to std)")
    max_robust_spike_rate: NonNegativeFloat = Field(
        0.01, description="soft: largest share of scored steps allowed to be robust gradient-norm spikes")
    min_window: PositiveInt = Field(20, description="smallest trailing window after scaling down for short runs")
    # Clipping: share of steps whose pre-clip norm exceeded the threshold, and the longest run of them.
    max_clip_rate: float = Field(
        0.5, ge=0.0, le=1.0, description="soft: largest share of steps allowed a pre-clip norm above train.clip_grad")
    max_clip_run: PositiveInt = Field(50, description="soft: longest run of consecutive clipped steps allowed")
    # Loss spikes (transient) and cliffs (a jump that stays up for at least cliff_min_steps, or until the log ends).
    loss_window: PositiveInt = Field(
        100, description="trailing window (steps) of the loss median and MAD that spikes and cliffs are measured "
        "against")
    loss_k: PositiveFloat = Field(
        6.0, description="a loss spike is a log loss above the trailing median + loss_k MAD (scaled to std); cliffs: "
        "a lower level, as their median over cliff_min_steps is less noisy")
    loss_min_jump: PositiveFloat = Field(0.1, description="a loss spike is at least this much above the median")
    cliff_min_steps: PositiveInt = Field(
        5, description="a jump is a cliff when the median of it and the next steps, this many in all, stays up")
    max_loss_spike_rate: NonNegativeFloat = Field(
        0.005, description="soft: largest share of scored steps allowed to start a transient loss spike")
    max_loss_cliffs: NonNegativeInt = Field(0, description="hard: loss cliffs allowed")
    # Do loss spikes follow gradient-norm spikes (same step or up to `coincidence_lag` steps before)?
    coincidence_lag: NonNegativeInt = Field(
        5, description="steps a grad-norm spike may precede a loss spike or cliff and still coincide with it; also "
        "the steps after a long-bucket run that count as on it")
    coincidence_alpha: float = Field(
        0.05, gt=0.0, lt=1.0, description="significance level of the spike-coincidence test (circular shifts) and "
        "of the long-run spike lift (Fisher)")
    # Batch composition: a long-bucket step has at least `long_share` of its micro-batches in the longest bucket.
    long_share: float = Field(
        0.75, gt=0.0, le=1.0, description="a step is a long-bucket step when at least this share of its "
        "micro-batches is from the longest bucket")
    long_run_min: PositiveInt = Field(
        3, description="long-bucket runs of at least this many steps count for the spike lift")
    max_long_bucket_run: PositiveInt = Field(
        10, description="soft: longest run of consecutive long-bucket steps allowed")
    max_long_run_spike_lift: PositiveFloat = Field(
        3.0, description="soft: spike rate on long-bucket runs over the rate elsewhere (warns only when also "
        "significant at coincidence_alpha)")
    # Trends: loss at the end over loss at the start; fitted growth of the grad norm over the run.
    max_loss_end_ratio: PositiveFloat = Field(
        1.0, description="soft: median loss of the last tenth of the steps over that of the first tenth")
    max_grad_norm_growth: PositiveFloat = Field(
        2.0, description="soft: fitted growth factor of the grad norm after the run settled (its first tenth and "
        "lr warmup left out; Theil-Sen; warns only when significant)")
    # Levels at the end: the median of the last level_window steps over the lowest such median after the run
    # settled (its first tenth and the lr warmup left out).
    level_window: PositiveInt = Field(
        100, description="steps whose median is a level of the loss or grad norm (a twentieth of a shorter run, "
        "at least 5)")
    max_loss_rebound: PositiveFloat = Field(
        1.5, description="hard: loss level at the end over the lowest loss level of the run (bucket-adjusted): a "
        "loss that fell and climbed back up diverged")
    max_grad_norm_rise: PositiveFloat = Field(
        4.0, description="hard: grad-norm level at the end over its lowest level after the run settled")
    # Baseline: report.json of an earlier healthy run; a figure worse by more than the tolerance regresses.
    baseline: str | None = Field(None, description="report.json of an earlier healthy run")
    baseline_tolerance: NonNegativeFloat = Field(
        0.5, description="a figure regresses when worse than the baseline's by more than this times "
        "max(|baseline value|, threshold / 10)")
    baseline_severity: Literal["warn", "fail"] = Field(
        "warn", description="what regressions against the baseline do to the verdict: warn or fail the run")

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

    enabled: bool = Field(True, description="false = no W&B at all, whatever the mode")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline writes the runs locally; online only when WANDB_API_KEY is set (offline "
        "otherwise); disabled = no W&B")
    project: str = Field("dflash", description="W&B project of the training runs and the promoted-drafter artifact")
    entity: str | None = Field(None, description="W&B team or user; None = the API key's default entity")
    name: str | None = Field(None, description="display name of the training run; None = a name W&B generates")
    tags: list[str] = Field(default_factory=list, description="tags of the training run")
