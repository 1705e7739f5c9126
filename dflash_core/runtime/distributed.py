"""The process group and this process's place in it (torchrun's environment variables)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dflash_core.errors import InputError


class DeviceError(InputError):
    """A device setting that this machine or this launch cannot satisfy."""


@dataclass(frozen=True)
class DistEnv:
    """Rank, world size and local placement; a single process when torchrun did not start us."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launched: bool = False  # started by torchrun (a rendezvous store exists even for one process)

    @classmethod
    def from_env(cls) -> DistEnv:
        """Read RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (torchrun sets them)."""
        get = lambda key, default: int(os.environ.get(key) or default)  # noqa: E731
        launched = "MASTER_ADDR" in os.environ and "RANK" in os.environ
        return cls(get("RANK", 0), get("WORLD_SIZE", 1), get("LOCAL_RANK", 0), get("LOCAL_WORLD_SIZE", 1), launched)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run folder's shared files."""
        return self.rank == 0


def resolve_device(setting: str, env: DistEnv) -> torch.device:
    """The drafter's device: cuda:<local_rank> on GPU machines (or when asked), else cpu."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise DeviceError("train.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    if setting == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if env.local_rank >= torch.cuda.device_count():
        raise DeviceError(
            f"local rank {env.local_rank} has no GPU ({torch.cuda.device_count()} visible); "
            "lower --nproc-per-node"
        )
    return torch.device("cuda", env.local_rank)


def replica_devices(target_devices: list[str] | None, env: DistEnv, default: torch.device) -> list[str]:
    """This rank's target replicas: train.target_devices split into equal contiguous groups per local rank.

    None = one replica on the drafter's device. Example: 2 ranks per node with
    ["cuda:0", "cuda:1", "cuda:2", "cuda:3"] gives local rank 0 cuda:0,1 and local rank 1 cuda:2,3.
    """
    if not target_devices:
        return [str(default)]
    if len(target_devices) % env.local_world_size:
        raise DeviceError(
            f"train.target_devices lists {len(target_devices)} devices, which does not split evenly over "
            f"{env.local_world_size} processes per node; list a multiple of --nproc-per-node devices"
        )
    per = len(target_devices) // env.local_world_size
    return list(target_devices[env.local_rank * per : (env.local_rank + 1) * per])


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float = 1800) -> None:
    """gloo on CPU, nccl on GPU, whenever torchrun started us (one process too: the same start-up path)."""
    if not env.launched or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def broadcast_int(value: int, env: DistEnv, device: torch.device) -> int:
    """Rank 0's value on every rank."""
    if env.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's object, in rank order (small objects only: RNG states)."""
    if env.world_size == 1:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def wait_for_all(env: DistEnv) -> None:
    """Return when every rank got here (every rank's files are written)."""
    if dist.is_initialized() and env.world_size > 1:
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group, if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()
