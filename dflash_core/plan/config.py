"""Config of the plan stage."""

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, field_validator

from dflash_core.schema import StrictModel


class PlanConfig(StrictModel):
    """Length buckets, token budget, interleaving and the shape of an optimizer step."""

    max_tokens: PositiveInt = Field(
        16384, description="token budget of a micro-batch: as many samples padded to their bucket's edge (plus the "
        "attention_cost term) as fit; also caps validation batches")
    buckets: Literal["auto"] | list[PositiveInt] = Field(
        "auto", description="length-bucket upper edges in tokens, ascending, the last covering the longest sample; "
        "auto = the edges that waste the least budget on padding (exact dynamic programming over the lengths)")
    num_buckets: PositiveInt = Field(
        6, description="most buckets the auto edges use (fewer when fewer already reach the same cost)")
    attention_cost: NonNegativeFloat = Field(0.0, description="quadratic cost term per token pair")
    world_size: PositiveInt = Field(
        1, description="training processes the plan is made for (nodes x nproc_per_node); training refuses a plan "
        "made for another count")
    grad_accum: PositiveInt = Field(1, description="micro-batches per rank per optimizer step")
    epochs: PositiveInt = Field(1, description="passes over the training samples, each reshuffled with its own seed")
    seed: NonNegativeInt = Field(
        0, description="seeds the batch shuffles, the bucket interleaving and which samples are held out")
    last_step: Literal["drop", "pad"] = Field(
        "drop", description="micro-batches left over that do not fill a last optimizer step: drop them, or pad the "
        "step with the last epoch's first micro-batches again (refused when the padding is longer than an epoch)")
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
