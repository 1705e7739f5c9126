"""Config of the target and the DFlash drafter."""

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from dflash_core.schema import StrictModel

DEFAULT_DPACE_ALPHA = 0.5  # the D-PACE paper's and speculators' default
# the drafter config's layout keys and the model.* settings that choose them (None: the target's)
DRAFT_SETTINGS = {"num_attention_heads": "draft_heads", "num_key_value_heads": "draft_kv_heads",
                  "head_dim": "draft_head_dim", "intermediate_size": "draft_intermediate_size"}


class ModelConfig(StrictModel):
    """The target to condition on and the drafter's shape (docs/DFLASH_SPEC.md)."""

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
        None, description="0-based target layers whose outputs, concatenated, condition the drafter: increasing, each "
        "once, below the last layer (what vLLM and SGLang capture); None = one per drafter layer, evenly spaced from "
        "1 to L-3 of the target's L layers (L // 2 for a single one)")
    mask_token_id: int | None = Field(None, description="None = the tokenizer's mask token")
    num_anchors: PositiveInt = Field(
        512, description="most anchors (blocks) sampled per sequence in training, uniformly from the supervised "
        "positions that start a full block of real tokens")
    gamma: PositiveFloat | None = Field(
        None, description="loss decay of loss_weighting decay; None = 7 for B=16, 5 for 10, 4 for 8, else B/2")
    loss_weighting: Literal["decay", "dpace"] = Field(
        "decay", description="weight of each drafted slot's cross-entropy: decay = the published recipe's fixed "
        "exp(-(j-1)/gamma); dpace = D-PACE (arXiv 2605.18810): each slot by how much the block's expected accepted "
        "run depends on it, from the drafter's own confidences every step (the weight moves to later slots as "
        "earlier ones become reliable)")
    dpace_alpha: float = Field(
        DEFAULT_DPACE_ALPHA, gt=0, le=1, description="D-PACE's confidence smoothing (1 = every slot's confidence counts as 1, "
        "weights fall linearly with the slot; smaller = the drafter's confidences count more)")
    gradient_checkpointing: bool = Field(
        False,
        description="recompute drafter layers in backward: activations scale with num_anchors * block_size",
    )
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = Field(
        None, description="one per drafter layer: full_attention (the whole context before the anchor, the whole "
        "block) or sliding_attention (the last sliding_window positions, block slots causal: the published Qwen3.6 "
        "drafters' layers); None = all full_attention. A warm start must match its drafter's")
    sliding_window: PositiveInt = Field(
        2048, description="tokens a sliding_attention layer's query sees back to (the query included)")
    draft_heads: PositiveInt | None = Field(
        None, description="the drafter's attention heads; None = the target's (a warm start from a drafter of "
        "another layout, e.g. z-lab's Gemma 4 ones, sets its four draft_* values)")
    draft_kv_heads: PositiveInt | None = Field(
        None, description="the drafter's key/value heads (draft_heads a multiple of them); None = the target's")
    draft_head_dim: PositiveInt | None = Field(
        None, description="the drafter's head width; None = the target's (its global one where it varies by layer)")
    draft_intermediate_size: PositiveInt | None = Field(
        None, description="the drafter's MLP width; None = the target's intermediate_size")
    attention: Literal["auto", "flex", "sdpa"] = Field(
        "auto",
        description="drafter training attention: flex = block-sparse FlexAttention (CUDA), sdpa = dense SDPA with a "
        "boolean mask (the reference); auto = flex on CUDA, sdpa elsewhere",
    )

    def draft_layout(self) -> dict[str, int | None]:
        """The draft_* settings under the drafter config's own names (None: the target's)."""
        return {key: getattr(self, setting) for key, setting in DRAFT_SETTINGS.items()}

    @model_validator(mode="after")
    def _one_weighting(self) -> "ModelConfig":
        # by value, not by what was written: a full dump of the config (a deployment's parameters) names every key
        if self.loss_weighting == "dpace" and self.gamma is not None:
            raise ValueError("model.gamma is the decay of loss_weighting decay; loss_weighting is dpace: remove gamma")
        if self.loss_weighting == "decay" and self.dpace_alpha != DEFAULT_DPACE_ALPHA:
            raise ValueError("model.dpace_alpha applies to loss_weighting dpace only; loss_weighting is decay: set "
                             "loss_weighting: dpace or remove dpace_alpha")
        return self

    @model_validator(mode="after")
    def _one_type_per_layer(self) -> "ModelConfig":
        if self.layer_types is not None and len(self.layer_types) != self.num_draft_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, num_draft_layers is "
                             f"{self.num_draft_layers}: give one type per drafter layer")
        return self
