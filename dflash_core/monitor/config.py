"""Config of the stability check and of the W&B sink."""

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from dflash_core.schema import StrictModel


class CheckConfig(StrictModel):
    """Stability thresholds: a run whose logs break them fails."""

    max_nonfinite: NonNegativeInt = 0
    spike_k: PositiveFloat = 7.0
    spike_window: PositiveInt = 1000
    max_spike_score: NonNegativeFloat = 0.001
    robust_k: PositiveFloat = 6.0
    max_robust_spike_rate: NonNegativeFloat = 0.01
    max_clip_rate: float = Field(0.5, ge=0.0, le=1.0)
    max_clip_run: PositiveInt = 50
    max_loss_cliffs: NonNegativeInt = 0
    baseline: str | None = Field(None, description="report.json of an earlier healthy run")
    baseline_tolerance: NonNegativeFloat = 0.5


class WandbConfig(StrictModel):
    """Weights & Biases sink: offline by default, online only when a key is configured."""

    enabled: bool = True
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "dflash"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = Field(default_factory=list)
