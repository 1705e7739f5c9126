"""Channels: ordering, end of stream, and errors that wake every blocked stage."""

import threading
import time

import pytest

from dflash_core.runtime.channel import Channel, ChannelClosed, ChannelTimeout, EndOfStream, OrderedEmitter


def _blocked(target) -> tuple[threading.Thread, list]:
    """Run target() in a thread; the list receives its result or exception."""
    result: list = []

    def run():
        try:
            result.append(target())
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.05)
    return t, result


def test_fifo_order_and_clean_end():
    ch = Channel(3)
    for i in range(3):
        ch.put(i)
    ch.close()
    assert list(ch) == [0, 1, 2]
    with pytest.raises(EndOfStream):
        ch.get()
    with pytest.raises(ChannelClosed):
        ch.put(4)


def test_a_get_with_a_timeout_gives_up_and_an_item_in_time_is_taken():
    ch = Channel(2, "features")
    with pytest.raises(ChannelTimeout, match="nothing came through channel 'features' for 0.1 s"):
        ch.get(timeout=0.1)
    threading.Timer(0.05, ch.put, (7,)).start()
    assert ch.get(timeout=5.0) == 7


def test_producer_consumer_keeps_order_under_backpressure():
    ch = Channel(2)

    def produce():
        for i in range(200):
            ch.put(i)
        ch.close()

    threading.Thread(target=produce, daemon=True).start()
    assert list(ch) == list(range(200))


def test_close_wakes_blocked_reader():
    ch = Channel(1)
    t, result = _blocked(ch.get)
    assert t.is_alive()
    ch.close()
    t.join(2)
    assert isinstance(result[0], EndOfStream)


def test_fail_wakes_blocked_reader_with_original_exception_and_traceback():
    ch = Channel(1)
    t, result = _blocked(ch.get)

    def origin():
        raise KeyError("shard part-3 missing")

    try:
        origin()
    except KeyError as exc:
        ch.fail(exc)
    t.join(2)
    err = result[0]
    assert isinstance(err, KeyError) and "part-3" in str(err)
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "origin" in frames  # the frame where it really happened is still in the traceback


def test_fail_wakes_blocked_writer():
    ch = Channel(1)
    ch.put("full")
    t, result = _blocked(lambda: ch.put("more"))
    assert t.is_alive()
    ch.fail(RuntimeError("downstream died"))
    t.join(2)
    assert isinstance(result[0], RuntimeError)


def test_fail_after_close_still_reaches_readers_and_drops_items():
    ch = Channel(2)
    ch.put(1)
    ch.close()
    ch.fail(ValueError("late"))
    with pytest.raises(ValueError, match="late"):
        ch.get()


def test_first_error_wins():
    ch = Channel(1)
    ch.fail(ValueError("first"))
    ch.fail(RuntimeError("second"))
    with pytest.raises(ValueError, match="first"):
        ch.put(1)


def test_ordered_emitter_puts_in_sequence_whatever_the_thread_timing():
    ch = Channel(100)
    emitter = OrderedEmitter(ch)
    emitter.finish(20)
    threads = [
        threading.Thread(target=lambda s=s: (time.sleep(0.002 * ((s * 7) % 5)), emitter.emit(s, s)), daemon=True)
        for s in reversed(range(20))
    ]
    for t in threads:
        t.start()
    assert list(ch) == list(range(20))


def test_ordered_emitter_abort_wakes_waiting_workers():
    ch = Channel(4)
    emitter = OrderedEmitter(ch)
    t, result = _blocked(lambda: emitter.emit(3, "x"))  # waits for 0..2 forever
    emitter.abort(OSError("stage 1 failed"))
    t.join(2)
    assert isinstance(result[0], OSError)
    with pytest.raises(OSError):
        ch.get()
