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

    @field_validator("buckets")
    @classmethod
    def _ascending(cls, v):
        if isinstance(v, list) and (not v or any(b <= a for a, b in zip(v, v[1:], strict=False))):
            raise ValueError("buckets must be a non-empty strictly ascending list of upper edges")
        return v
