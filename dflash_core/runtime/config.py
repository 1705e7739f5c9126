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

    lr: PositiveFloat = Field(6e-4, description="peak AdamW learning rate, reached at the end of warmup")
    min_lr_ratio: NonNegativeFloat = Field(
        0.0, description="the cosine schedule decays to this fraction of lr by the end of the run (constant: unused)")
    warmup_ratio: float = Field(
        0.04, ge=0.0, le=1.0, description="share of the run's optimizer steps over which lr rises linearly; 0 = none")
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="lr after warmup: cosine decay to min_lr_ratio * lr over the other steps, or constant")
    weight_decay: NonNegativeFloat = Field(0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2)")
    clip_grad: PositiveFloat = Field(
        1.0, description="max global gradient norm: a step whose pre-clip norm exceeds it has its gradients "
        "scaled down to it")
    max_steps: PositiveInt | None = Field(
        None, description="train at most this many optimizer steps of the plan (the lr schedule spans them); "
        "None = the whole plan")
    prefetch_threads: PositiveInt = Field(
        4, description="threads per rank that read and collate micro-batches from the token shards")
    queue_size: PositiveInt = Field(
        8, description="micro-batches each bounded channel holds (prefetch -> target forward -> drafter), per rank")
    target_devices: list[str] | None = Field(
        None,
        description="target replicas per node, split evenly over the node's ranks in order (e.g. 2 ranks with "
        "[cuda:0, cuda:1, cuda:2, cuda:3]: rank 0 gets cuda:0,1); None = one replica on the rank's own device",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="the drafter's device: cuda = cuda:<local rank> (an error without CUDA), cpu; auto = "
        "cuda when available, else cpu")
    checkpoint_every: PositiveInt = Field(
        100, description="write a checkpoint every N optimizer steps and after the last")
    eval_every: PositiveInt = Field(100, description="validation on the plan's val slice every N steps and at the end")
    init_from: str | None = Field(
        None,
        description="warm start: an exported drafter folder/URI, or 'promoted' (<storage root>/promoted/drafter, "
        "from scratch while none is promoted); optimizer state starts fresh; a resumed checkpoint wins",
    )
    keep_checkpoints: PositiveInt = Field(3, description="newest complete checkpoints kept; older ones are deleted")
    max_nonfinite: NonNegativeInt = Field(
        0, description="steps with a non-finite loss or gradient norm are skipped; the run stops once more than this "
        "many were. 0 stops at the first: the stability gate fails a run with more than check.max_nonfinite (0) of "
        "them, so training on would pay for a run that fails; raise both to tolerate a few")
    nproc_per_node: PositiveInt = Field(
        1, description="training processes (ranks) torchrun starts on each node; --nproc-per-node overrides it")
    seed: NonNegativeInt = Field(
        0, description="seeds the drafter's initial weights and the anchor sampling (per step, micro-batch and rank)")
    timeout_s: PositiveFloat | None = Field(
        None, description="wall-clock limit of the training launch in seconds: past it every rank is killed and the "
        "stage fails; None = no limit")
    stall_timeout_s: PositiveFloat | None = Field(
        1800.0, description="a rank whose drafter gets no micro-batch for this long stops the run (StallError: the "
        "queue depths, every thread's stack in the log) instead of holding its GPUs idle all night behind a hung "
        "shard read or target forward; None = wait forever")
    stop_grace_s: PositiveFloat = Field(
        120.0, description="on timeout or cancellation the launcher sends the ranks SIGTERM, waits this long for them "
        "to checkpoint the step they reached and stop, then kills them; keep it below the pod's "
        "terminationGracePeriodSeconds")
    collective_timeout_s: PositiveFloat = Field(
        1800.0, description="how long a rank waits in a collective (all-reduce, broadcast, barrier) before the run "
        "fails: a rank that died on another node ends the others after this; raise it when loading the target "
        "can take longer on one node than on another (the first collective follows the load)")
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
