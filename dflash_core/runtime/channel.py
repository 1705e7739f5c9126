"""Bounded channels: the only thing the runtime's stages share (CSP style).

A channel carries items, a clean end of stream (`close`) and errors (`fail`). Every blocked reader and writer
waits on one Condition, so closing or failing a channel wakes them all at once; nobody polls with sleeps.
A failure re-raises the ORIGINAL exception (with its traceback) in every stage that touches the channel
afterwards, so the log shows where the error really happened, not where it was noticed.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def remember_origin(exc: BaseException) -> None:
    """Keep the traceback of where exc was first raised (before other stages re-raise it)."""
    if getattr(exc, "_dflash_origin_tb", None) is None:
        try:
            exc._dflash_origin_tb = exc.__traceback__  # type: ignore[attr-defined]
        except AttributeError:
            pass  # an exception type without __dict__: its own traceback will do


def reraise(exc: BaseException) -> None:
    """Raise exc again with its original traceback, so each stage it crosses adds only its own frames."""
    raise exc.with_traceback(getattr(exc, "_dflash_origin_tb", None) or exc.__traceback__)


class ChannelClosed(Exception):
    """Raised by `put` on a closed channel (a writer kept writing after the end of stream)."""


class EndOfStream(Exception):
    """Raised by `get` once a closed channel is drained."""


class ChannelTimeout(Exception):
    """Raised by `get(timeout=...)` when nothing arrived in time (the stage upstream is stuck)."""


class Channel(Generic[T]):
    """A bounded FIFO between two stages, with end-of-stream and error propagation."""

    def __init__(self, capacity: int, name: str = "channel") -> None:
        if capacity < 1:
            raise ValueError(f"channel {name!r}: capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._items: collections.deque[T] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None

    def put(self, item: T) -> None:
        """Append an item; blocks while full; raises the channel's error or ChannelClosed."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._closed or len(self._items) < self.capacity)
            self._raise_if_failed()
            if self._closed:
                raise ChannelClosed(f"put on closed channel {self.name!r}")
            self._items.append(item)
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> T:
        """Take the oldest item; blocks while empty (ChannelTimeout after `timeout` seconds, if given); raises
        EndOfStream when closed and drained."""
        with self._cond:
            ready = self._cond.wait_for(lambda: self._error is not None or self._closed or bool(self._items), timeout)
            if not ready:
                raise ChannelTimeout(f"nothing came through channel {self.name!r} for {timeout:g} s")
            self._raise_if_failed()
            if not self._items:
                raise EndOfStream(self.name)
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def close(self) -> None:
        """End of stream: readers drain what is left, then get EndOfStream; writers get ChannelClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Propagate an error to every reader and writer, now and later; the first error wins."""
        with self._cond:
            if self._error is None:
                remember_origin(exc)
                self._error = exc
                self._items.clear()  # nobody may consume data produced before the failure
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """The error the channel failed with, if any."""
        return self._error

    def depth(self) -> int:
        """Items waiting right now (a health metric; racy by nature)."""
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        while True:
            try:
                yield self.get()
            except EndOfStream:
                return

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            reraise(self._error)  # the original object, with the frames where it was first raised


def fail_all(channels: list[Channel], exc: BaseException) -> None:
    """Fail every channel a stage touches, so stages upstream and downstream both stop."""
    for ch in channels:
        ch.fail(exc)


class OrderedEmitter(Generic[T]):
    """Lets several worker threads put their results into a channel in sequence order (0, 1, 2, ...).

    A worker holding item `seq` waits until every earlier item has been put; at most one item per worker is
    held, so memory stays bounded. After `finish(total)` the channel is closed once item total-1 is out.
    Any failure of the output channel (or `abort`) wakes every waiting worker.
    """

    def __init__(self, out: Channel[T]) -> None:
        self.out = out
        self._cond = threading.Condition()
        self._next = 0
        self._total: int | None = None
        self._aborted: BaseException | None = None

    def emit(self, seq: int, item: T) -> None:
        """Put `item` once items 0..seq-1 are out; raises the pipeline's error if it failed meanwhile."""
        with self._cond:
            self._cond.wait_for(lambda: self._next == seq or self._aborted is not None)
            if self._aborted is not None:
                reraise(self._aborted)
        try:
            self.out.put(item)  # only the thread whose turn it is gets here
        except BaseException as exc:
            self.abort(exc)
            raise
        with self._cond:
            self._next += 1
            self._cond.notify_all()
            self._close_if_done()

    def finish(self, total: int) -> None:
        """No item after seq total-1 will come; close the channel once they are all out."""
        with self._cond:
            self._total = total
            self._close_if_done()

    def abort(self, exc: BaseException) -> None:
        """Wake every waiting worker with `exc` (the output channel is failed too)."""
        with self._cond:
            if self._aborted is None:
                remember_origin(exc)
                self._aborted = exc
            self._cond.notify_all()
        self.out.fail(exc)

    def _close_if_done(self) -> None:
        if self._total is not None and self._next >= self._total:
            self.out.close()


class ReorderBuffer(Generic[T]):
    """Results finished out of order wait here until their turn; a window bounds how many can wait.

    Producers `reserve(seq)` before starting work on item seq (blocks while seq >= next + window), then
    `deposit(seq, item)` without blocking; one consumer `pop()`s items in sequence order. Unlike
    OrderedEmitter, a worker that finishes early is free again at once (the target replicas need that, or
    the one busy with a long batch would hold up the others' slots).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._cond = threading.Condition()
        self._items: dict[int, T] = {}
        self._next = 0
        self._total: int | None = None
        self._error: BaseException | None = None

    def reserve(self, seq: int) -> None:
        """Block until item seq may be started."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or seq < self._next + self.window)
            if self._error is not None:
                reraise(self._error)

    def deposit(self, seq: int, item: T) -> None:
        """Hand in a finished item."""
        with self._cond:
            self._items[seq] = item
            self._cond.notify_all()

    def finish(self, total: int) -> None:
        """Items 0..total-1 are all that will come."""
        with self._cond:
            self._total = total
            self._cond.notify_all()

    def abort(self, exc: BaseException) -> None:
        """Wake everyone with exc."""
        with self._cond:
            if self._error is None:
                remember_origin(exc)
                self._error = exc
            self._items.clear()
            self._cond.notify_all()

    def pop(self) -> T:
        """The next item in sequence order; EndOfStream after the last one."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._error is not None or self._next in self._items or self._total == self._next
            )
            if self._error is not None:
                reraise(self._error)
            if self._next not in self._items:
                raise EndOfStream("reorder buffer")
            self._next += 1
            self._cond.notify_all()
            return self._items.pop(self._next - 1)
