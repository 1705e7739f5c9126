"""Config of the plan stage."""

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, field_validator

from dflash_core.schema import StrictModel


class PlanConfig(StrictModel):
    """Length buckets, token budget, interleaving and the shape of an optimizer step."""

    max_tokens: PositiveInt = 16384
    buckets: Literal["auto"] | list[PositiveInt] = "auto"
    num_buckets: PositiveInt = 6
    attention_cost: NonNegativeFloat = Field(0.0, description="quadratic cost term per token pair")
    world_size: PositiveInt = 1
    grad_accum: PositiveInt = 1
    epochs: PositiveInt = 1
    seed: NonNegativeInt = 0
    last_step: Literal["drop", "pad"] = "drop"
    sort_chunk: PositiveInt = Field(
        64, description="most batches per length-sorted chunk of a bucket (larger: less padding, less mixing)"
    )
    edge_granularity: PositiveInt = Field(
        8, description="auto edges are multiples of this many tokens (coarsened to at most 2048 candidates)"
    )
    val_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="share of samples held out for validation (val.parquet); 0 disables"
    )
    val_min_samples: NonNegativeInt = Field(8, description="hold out at least this many (data permitting)")
    val_max_samples: PositiveInt = Field(1000, description="hold out at most this many (validation cost)")

    @field_validator("buckets")
    @classmethod
    def _ascending(cls, v):
        if isinstance(v, list) and (not v or any(b <= a for a, b in zip(v, v[1:], strict=False))):
            raise ValueError("buckets must be a non-empty strictly ascending list of upper edges")
        return v
