"""Config of the training runtime, and the sections of the pipeline config a training run reads."""

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

from dflash_core.data.config import DataConfig
from dflash_core.model.config import ModelConfig
from dflash_core.monitor.config import WandbConfig
from dflash_core.schema import StrictModel, read_yaml, validate_mapping


class TrainConfig(StrictModel):
    """Optimizer, schedule, the asynchronous loop's sizes, checkpoints and launch."""

    lr: PositiveFloat = 6e-4
    min_lr_ratio: NonNegativeFloat = 0.0
    warmup_ratio: float = Field(0.04, ge=0.0, le=1.0)
    schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip_grad: PositiveFloat = 1.0
    max_steps: PositiveInt | None = None
    prefetch_threads: PositiveInt = 4
    queue_size: PositiveInt = 8
    target_devices: list[str] | None = Field(
        None,
        description="target replicas per node, split evenly over the node's ranks in order (e.g. 2 ranks with "
        "[cuda:0, cuda:1, cuda:2, cuda:3]: rank 0 gets cuda:0,1); None = one replica on the rank's own device",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every: PositiveInt = 100
    eval_every: PositiveInt = Field(100, description="validation on the plan's val slice every N steps and at the end")
    init_from: str | None = Field(
        None,
        description="warm start: an exported drafter folder/URI, or 'promoted' (<storage root>/promoted/drafter, "
        "from scratch while none is promoted); optimizer state starts fresh; a resumed checkpoint wins",
    )
    keep_checkpoints: PositiveInt = 3
    max_nonfinite: NonNegativeInt = 10
    nproc_per_node: PositiveInt = 1
    seed: NonNegativeInt = 0
    timeout_s: PositiveFloat | None = None
    torch_threads: PositiveInt | None = Field(
        None,
        description="intra-op threads per rank; None = OMP_NUM_THREADS, else the rank's share of the cores less one "
        "(at most 4 on a GPU); see dflash_core/runtime/efficiency.py intra_op_threads",
    )
    peak_tflops: PositiveFloat | None = Field(
        None,
        description="dense bf16 peak TFLOP/s of one device for the mfu metric; None = a table of known GPUs by "
        "name (dflash_core/runtime/efficiency.py), null mfu on CPU or an unknown GPU",
    )


class RunConfig(BaseModel):
    """The sections of the pipeline config (dflash_core.config) that one training run reads.

    The other sections (plan, check, storage, ...) belong to the launcher, which validated the whole file
    before writing it into the run folder; they are kept as they are so the W&B run config shows them all.
    """

    model_config = ConfigDict(extra="allow")

    data: DataConfig
    model: ModelConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)


def load_run_config(path: str) -> RunConfig:
    """The run's sections of a config file written by a launcher (its URIs already resolved)."""
    return validate_mapping(RunConfig, read_yaml(path), path)
