"""Config of the target and the DFlash drafter."""

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from dflash_core.schema import StrictModel


class ModelConfig(StrictModel):
    """The target to condition on and the drafter's shape (DFLASH_SPEC.md)."""

    target: str = Field(description="target model path or hub id (example://target for the demo)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype the target is loaded in for training and the promotion gate; auto = the dtype its "
        "checkpoint stores")
    trust_remote_code: bool = Field(
        False, description="let transformers run the model code shipped with the target and tokenizer (training, the "
        "promotion gate)")
    num_draft_layers: PositiveInt = Field(1, description="transformer layers of the drafter")
    block_size: int = Field(16, ge=2, description="B: the anchor token plus B-1 drafted slots")
    target_layer_ids: list[int] | None = Field(
        None, description="0-based target layers whose outputs, concatenated, condition the drafter; None = one per "
        "drafter layer, evenly spaced from 1 to L-3 of the target's L layers (L // 2 for a single one)")
    mask_token_id: int | None = Field(None, description="None = the tokenizer's mask token")
    num_anchors: PositiveInt = Field(
        512, description="most anchors (blocks) sampled per sequence in training, uniformly from the supervised "
        "positions that start a full block of real tokens")
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
