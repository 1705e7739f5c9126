"""Config of the target and the DFlash drafter."""

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from dflash_core.schema import StrictModel


class ModelConfig(StrictModel):
    """The target to condition on and the drafter's shape (DFLASH_SPEC.md)."""

    target: str = Field(description="target model path or hub id (example://target for the demo)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    num_draft_layers: PositiveInt = 1
    block_size: int = Field(16, ge=2, description="B: the anchor token plus B-1 drafted slots")
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = Field(None, description="None = the tokenizer's mask token")
    num_anchors: PositiveInt = 512
    gamma: PositiveFloat | None = Field(None, description="loss decay; None = 7 for B=16, 5 for 10, 4 for 8")
    gradient_checkpointing: bool = Field(
        False,
        description="recompute drafter layers in backward: activations scale with num_anchors * block_size",
    )
    attention: Literal["auto", "flex", "sdpa"] = Field(
        "auto",
        description="drafter training attention: flex = block-sparse FlexAttention (CUDA), sdpa = dense SDPA with a "
        "boolean mask (the reference); auto = flex on CUDA, sdpa elsewhere",
    )
