"""Stage threads: daemon threads that use the intra-op thread count of the thread that created them."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def stage_thread(target: Callable[..., None], name: str, args: tuple = ()) -> threading.Thread:
    """A daemon thread for a pipeline stage (not started).

    torch.set_num_threads sets OpenMP's count for the calling thread only: a new thread would fall back to
    one OpenMP thread per core and oversubscribe the CPU (matrix products measured 4x slower on 2 cores).
    """
    n = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(n)
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)
