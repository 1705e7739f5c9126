"""Model FLOPs and MFU of every training step: `tflops` and `mfu` in each metrics record.

MFU = achieved model FLOP/s (dflash_core.model.flops) / (bf16 dense peak x the devices the step runs on). Both
are the whole step's, over every rank (like tokens_per_s): `tflops` is the run's, `mfu` the mean over its devices.
The peak comes from `train.peak_tflops` when set, else from the table below by device name; on CPU, or on a GPU
the table does not know, mfu is null (tflops is always there).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from dflash_core.model.flops import FlopShape, drafter_step_flops, target_forward_flops
from dflash_core.model.loss import LossOutput
from dflash_core.runtime.batch import MicroBatch

COUNTS = 5  # FlopMeter.take(): target FLOPs and the drafter's four inputs (context tokens, blocks, pairs, rows)


@dataclass(frozen=True)
class Peak:
    """A GPU's dense bf16 tensor-core peak (the datasheets quote 2x that "with sparsity")."""

    model: str  # a token of torch.cuda.get_device_name, e.g. "H100" in "NVIDIA H100 80GB HBM3"
    variant: str | None  # a second token that must be there too (PCIE, NVL); None = any
    tflops: float
    source: str


# more specific rows first: "NVIDIA H100 PCIe" must not match the SXM row
PEAKS: tuple[Peak, ...] = (
    Peak("H100", "PCIE", 756.0, "https://www.nvidia.com/en-us/data-center/h100/ (1,513 sparse)"),
    Peak("H100", "NVL", 835.0, "https://www.nvidia.com/en-us/data-center/h100/ (1,671 sparse)"),
    Peak("H100", None, 989.4, "https://www.nvidia.com/en-us/data-center/h100/ (SXM, 1,979 sparse)"),
    Peak("H200", "NVL", 835.0, "https://www.nvidia.com/en-us/data-center/h200/ (1,671 sparse)"),
    Peak("H200", None, 989.4, "https://www.nvidia.com/en-us/data-center/h200/ (SXM, 1,979 sparse)"),
    Peak("GH200", None, 989.4, "https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/"),
    # the export versions of Hopper and Ampere: the H800 and A800 keep their originals' tensor cores (less
    # NVLink); the H20 is a cut-down Hopper
    Peak("H800", "PCIE", 756.0, "NVIDIA H800 PCIe datasheet (1,513 sparse), as H100 PCIe"),
    Peak("H800", None, 989.4, "NVIDIA H800 SXM5 datasheet (1,979 sparse), as H100 SXM"),
    Peak("H20", None, 148.0, "NVIDIA H20 datasheet (296 sparse)"),
    Peak("A800", None, 312.0, "NVIDIA A800 datasheet (624 sparse), as A100"),
    Peak("B200", None, 2250.0, "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: 36 PFLOPS sparse / 8)"),
    Peak("B300", None, 2250.0, "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B300: 36 PFLOPS sparse / 8)"),
    Peak("GB200", None, 2500.0, "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (360 PFLOPS sparse / 72)"),
    Peak("GB300", None, 2500.0, "https://www.nvidia.com/en-us/data-center/gb300-nvl72/ (360 PFLOPS sparse / 72)"),
    Peak("A100", None, 312.0, "https://www.nvidia.com/en-us/data-center/a100/ (624 sparse)"),
    Peak("A30", None, 165.0, "https://www.nvidia.com/en-us/data-center/products/a30-gpu/ (330 sparse)"),
    Peak("L40S", None, 362.05, "https://www.nvidia.com/en-us/data-center/l40s/ (733 sparse)"),
    Peak("L40", None, 181.05, "https://www.nvidia.com/en-us/data-center/l40/ (362.1 sparse)"),
    Peak("L20", None, 119.5, "NVIDIA L20 datasheet (239 sparse)"),
    Peak("L4", None, 121.0, "https://www.nvidia.com/en-us/data-center/l4/ (242 sparse)"),
    Peak("A10", None, 125.0, "https://www.nvidia.com/en-us/data-center/products/a10-gpu/ (250 sparse)"),
    Peak("MI300X", None, 1307.4, "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
    Peak("MI325X", None, 1307.4, "https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html"),
)


def peak_for_name(name: str) -> Peak | None:
    """The table row for a device name (whole-token match: "A10" is not "A100", "H200" is not "GH200")."""
    tokens = set(re.split(r"[^A-Z0-9]+", name.upper()))
    for peak in PEAKS:
        if peak.model in tokens and (peak.variant is None or peak.variant in tokens):
            return peak
    return None


def device_peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Dense bf16 peak TFLOP/s of `device`: the override, else the table (None on CPU or an unknown GPU)."""
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    peak = peak_for_name(torch.cuda.get_device_name(device))
    return peak.tflops if peak else None


def missing_peak_note(device: torch.device, peak_tflops: float | None) -> str | None:
    """What a run on a GPU the table does not know says once: its mfu will be null, and how to get one."""
    if peak_tflops is not None or device.type != "cuda":
        return None
    return (f"note: mfu is null in metrics.jsonl: {torch.cuda.get_device_name(device)!r} is not in the table of GPU "
            "peaks (dflash_core/runtime/efficiency.py); set train.peak_tflops to its dense bf16 TFLOP/s")


@dataclass
class FlopMeter:
    """Counts one rank's model FLOPs per step as five float64 sums (`take()`), which the step sums over the ranks
    with its other sums (StepStats.all_reduce: one collective); `record(counts, seconds, world_size)` -> the step's
    tflops, mfu and FLOP split.

    The counts are the target's FLOPs and the drafter's four inputs: its count is linear in them, so they can be
    summed over micro-batches and ranks first. They stay on the device and are read once per step, with the
    step's other sums (no extra sync per micro-batch, no extra collective per step).
    """

    shape: FlopShape
    peak_tflops: float | None = None  # per device
    devices: int = 1  # devices this rank's step runs on (its own plus separate target replicas)
    # target FLOPs, context tokens, blocks, visible pairs, loss rows; None = nothing counted since the last take()
    _counts: torch.Tensor | None = None

    @classmethod
    def for_model(cls, drafter: torch.nn.Module, device: torch.device, peak_override: float | None = None,
                  devices: int = 1, target_layout: dict[str, int] | None = None) -> FlopMeter:
        """A meter for this drafter on this device (peak from the table unless overridden; `target_layout`: the
        target's layers' layout, FlopShape.of)."""
        return cls(FlopShape.of(drafter, target_layout), device_peak_tflops(device, peak_override), devices)

    def add(self, batch: MicroBatch, out: LossOutput) -> None:
        """Count one micro-batch (its lengths are read from the host copy of the attention mask)."""
        if self._counts is None:
            self._counts = torch.zeros(COUNTS, dtype=torch.float64, device=out.counted.device)
        c = self._counts
        c[0] += target_forward_flops(self.shape, batch.attention_mask.sum(1).tolist())
        c[1] += batch.n_tokens
        c[2] += out.n_blocks
        if out.visible_pairs is not None:
            c[3] += out.visible_pairs
        c[4] += out.counted.sum()

    def take(self) -> torch.Tensor:
        """This rank's counts of the step so far (COUNTS float64 values, on the device of its micro-batches);
        resets them."""
        counts = self._counts if self._counts is not None else torch.zeros(COUNTS, dtype=torch.float64)
        self._counts = None
        return counts

    def record(self, counts: Sequence[float], seconds: float, world_size: int = 1) -> dict:
        """{"tflops", "mfu", "step_tflop": {"target", "drafter"}} of a step from its `take()` counts summed over
        its `world_size` ranks. Ranks' FLOPs differ with their batches' lengths, their step time does not."""
        target, context_tokens, blocks, pairs, rows = counts
        drafter = drafter_step_flops(self.shape, context_tokens, blocks, pairs, rows)
        tflops = (target + drafter) / seconds / 1e12 if seconds > 0 else None
        peak = self.peak_tflops * self.devices * world_size if self.peak_tflops else None
        mfu = tflops / peak if tflops is not None and peak else None
        return {"tflops": tflops, "mfu": mfu, "step_tflop": {"target": target / 1e12, "drafter": drafter / 1e12}}


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled so far in this process (FlexAttention's kernels among them)."""
    return int(counters["stats"]["unique_graphs"])


@dataclass
class SteadyRate:
    """Throughput of a run without its first `warmup` steps (CUDA context, kernel selection, allocator growth,
    filling the pipeline), without later steps that compiled (a new micro-batch shape: one-off, amortised over
    a real run) and without what happens after the last step (final checkpoint, export)."""

    warmup: int = 2
    tokens: int = 0
    seconds: float = 0.0
    tflop: float = 0.0
    mfu_seconds: float = 0.0  # sum of mfu x step time (mfu averaged over time)
    steps: int = 0
    compile_steps: int = 0  # steps after the warm-up that were left out because they compiled
    _seen: int = 0
    _graphs: int = -1  # compiled_graphs() at the previous record; -1 before the first

    def add(self, record: dict) -> None:
        """Count one step record (of DrafterTrainLoop.train_step) unless it is a warm-up or compiling step."""
        self._seen += 1
        graphs = compiled_graphs()
        compiled = self._graphs >= 0 and graphs != self._graphs  # it compiled since the previous record
        self._graphs = graphs
        if self._seen <= self.warmup:
            return
        if compiled:
            self.compile_steps += 1
            return
        seconds = float(record["step_time_s"])
        self.steps += 1
        self.tokens += int(record["n_tokens"])
        self.seconds += seconds
        self.tflop += sum(record.get("step_tflop", {}).values())
        if record.get("mfu") is not None:
            self.mfu_seconds += record["mfu"] * seconds

    def summary(self) -> dict:
        """steady_* figures (None when every step was a warm-up step)."""
        timed = self.seconds > 0
        return {
            "steady_steps": self.steps,
            "steady_compile_steps_skipped": self.compile_steps,
            "steady_tokens_per_s": self.tokens / self.seconds if timed else None,
            "steady_tflops": self.tflop / self.seconds if timed else None,
            "steady_mfu": self.mfu_seconds / self.seconds if timed and self.mfu_seconds > 0 else None,
        }


def intra_op_threads(
    requested: int | None, device_type: str, local_world_size: int, omp_env: str | None, cores: int
) -> int:
    """Intra-op threads of one rank: train.torch_threads, else OMP_NUM_THREADS as the user set it (`omp_env`,
    see runtime/launch.py asked_threads), else the rank's share of the cores less one for the pipeline's own
    threads (loading, target forward), at most 4 on a GPU.

    torch's default (every core) made the worker 3-20x slower than the same steps in one process on a shared
    CPU: its OpenMP teams wait for threads that the prefetch and target threads (and other processes) keep
    off the cores. torchrun sets OMP_NUM_THREADS=1 only for more than one process per node. A GPU rank's CPU
    work is launching kernels and copying batches: a few threads are plenty, and a starved launch thread
    idles the GPU.
    """
    if requested:
        return requested
    # OpenMP's nested form "4,2": the outermost level's count; a value that is no count, OpenMP ignores too
    count = (omp_env or "").split(",")[0].strip()
    if count.isdecimal():
        return max(1, int(count))
    share = max(1, cores // max(1, local_world_size) - 1)
    return min(4, share) if device_type == "cuda" else share
