"""Config of the tokenize stage."""

from typing import Literal

from pydantic import Field, PositiveInt, field_validator

from dflash_core.regenerate.config import RegenerateConfig
from dflash_core.schema import StrictModel

CANONICAL_ROLES = ("system", "user", "assistant", "tool")


class DataConfig(StrictModel):
    """Where the chat data and tokenizer are, and how conversations become token samples."""

    source: str = Field(description="chat data: file, glob or folder, any fsspec URI (example://data for the demo)")
    tokenizer: str = Field(description="tokenizer path or hub id (example://tokenizer for the demo)")
    format: Literal["auto", "sharegpt", "openai"] = "auto"
    messages_key: str | None = Field(None, description="the key holding the turns; None = auto-detect")
    role_map: dict[str, str] = Field(
        default_factory=dict, description="extra role names -> system|user|assistant|tool"
    )
    max_length: PositiveInt = 3072
    overlong: Literal["truncate", "drop"] = "truncate"
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    thinking: Literal["keep", "strip"] = Field(
        "strip", description="reasoning in assistant turns: strip (render with thinking off, as the public "
        "Qwen3 drafters are trained and evaluated) or keep (rendered and supervised as the template does)")
    system_turn: Literal["auto", "keep", "merge"] = Field(
        "auto", description="a leading system turn: keep it as a turn of its own; merge it into the first user "
        "turn (system text, a blank line, the user text; as Gemma's templates do); auto = merge only when the "
        "chat template cannot render a system turn (Gemma 2, early Mistral), keep otherwise")
    same_role_turns: Literal["auto", "keep", "merge"] = Field(
        "auto", description="two or more user turns in a row (or assistant turns): keep them as they are; merge "
        "each run into one turn (texts joined by a blank line; assistant turns only when all or none are trained "
        "on); auto = merge only when the chat template refuses them (Gemma, Mistral: roles must alternate)")
    batch_size: PositiveInt = 256
    num_proc: PositiveInt = 2
    rows_per_part: PositiveInt = 50_000
    rows_per_group: PositiveInt = Field(
        256, description="parquet row-group size: the unit ShardReader decodes for a random read"
    )
    max_examples: PositiveInt = Field(5, description="examples kept per drop reason in manifest.json")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig,
                                         description="the optional stage before tokenize: the target re-answers")

    @field_validator("role_map")
    @classmethod
    def _known_targets(cls, value: dict[str, str]) -> dict[str, str]:
        bad = {k: v for k, v in value.items() if v not in CANONICAL_ROLES}
        if bad:
            raise ValueError(f"role_map values must be one of {', '.join(CANONICAL_ROLES)}; got {bad}")
        return value
