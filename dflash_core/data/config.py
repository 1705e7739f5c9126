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
    format: Literal["auto", "sharegpt", "openai"] = Field(
        "auto", description="how turns are written: sharegpt (from/value), openai (role/content); auto = detected per "
        "record (a file's first records decide only for turns that are plain strings)")
    messages_key: str | None = Field(None, description="the key holding the turns; None = auto-detect")
    role_map: dict[str, str] = Field(
        default_factory=dict, description="extra role names -> system|user|assistant|tool"
    )
    max_length: PositiveInt = Field(3072, description="longest sample in tokens; a longer rendered conversation is "
                                    "cut or dropped (overlong)")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="a sample over max_length: truncate = cut at the last turn end that fits (mid-turn "
        "when that leaves too little supervised), drop = drop it as too_long")
    max_bad_fraction: float = Field(
        0.01, ge=0.0, le=1.0, description="the stage fails when records dropped as broken input exceed this share "
        "of the records read (length and data-quality drops never count)")
    thinking: Literal["keep", "strip"] = Field(
        "strip", description="reasoning in assistant turns: strip (render with thinking off, as the public "
        "Qwen3 drafters are trained and evaluated) or keep (rendered and supervised as the template does)")
    system_turn: Literal["auto", "keep", "merge"] = Field(
        "auto", description="a leading system turn: keep it as a turn of its own; merge it into the first user "
        "turn (system text, a blank line, the user text; as Gemma's templates do); auto = merge only when the "
        "chat template cannot render a system turn (Gemma 2, early Mistral), keep otherwise")
    same_role_turns: Literal["auto", "keep", "merge"] = Field(
        "auto", description="two or more user turns in a row (or assistant turns), or a conversation opening with "
        "an assistant turn: keep them as they are; merge = make the turns alternate (each run merged into one "
        "turn, texts joined by a blank line, assistant turns only when all or none are trained on; the turns before "
        "the first user turn left out); auto = merge only when the chat template refuses them (Gemma, Mistral, "
        "Llama 2: roles must alternate)")
    batch_size: PositiveInt = Field(256, description="records per chunk handed to a tokenizer worker")
    num_proc: PositiveInt = Field(
        2, description="processes that tokenize in parallel (spawned workers); 1, or an input of at most that many "
        "chunks, runs in the stage's own process")
    rows_per_part: PositiveInt = Field(50_000, description="samples per part-*.parquet file of the output")
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
