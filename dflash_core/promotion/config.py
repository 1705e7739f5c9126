"""Config of the evaluation that gates promotion (the `eval:` section)."""

from pydantic import Field, NonNegativeFloat, PositiveInt

from dflash_core.schema import StrictModel


class EvalConfig(StrictModel):
    """Fixed evaluation prompts on which the new and the promoted drafter are both decoded, and the margin."""

    data: str | None = Field(None, description="chat prompts (any fsspec URI); None = data.source")
    limit: PositiveInt = Field(16, description="the first N prompts of `data`: the same set for both drafters")
    max_new_tokens: PositiveInt = Field(
        64, description="most tokens decoded per response (it also ends at end-of-turn) when measuring tau")
    min_gain: NonNegativeFloat = Field(
        0.0, description="promote only when tau > the promoted drafter's tau + min_gain"
    )
    confidence: float | None = Field(
        None, gt=0.5, lt=1.0,
        description="also require the paired gain over the same responses to exceed min_gain at this one-sided "
                    "confidence (e.g. 0.95: a t-test's p < 0.05), so evaluation noise never swaps drafters; "
                    "None = compare the two tau only")
    allow_block_size_change: bool = Field(
        False, description="promote a drafter whose block size differs from the promoted one's; the serving "
                           "setting must change with it (vLLM num_speculative_tokens = block size - 1), so by "
                           "default such a drafter is not promoted and the reason says so")
