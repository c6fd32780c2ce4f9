"""The offline Engine's private event loop (offline/loop_thread.py): a call is never stranded by stop() (a
close() on another thread). A call submitted while stop() is under way is refused, and a call whose task has
not ended when the loop stops is answered with a RuntimeError. Both had left their caller waiting forever."""

from __future__ import annotations

import asyncio
import threading

import pytest

from worldserve.offline.loop_thread import LoopThread

HANG_GUARD_S = 60.0
"""Only so that a regression fails the test instead of hanging it: the fixed calls return at once."""


def test_a_call_made_while_stop_is_under_way_is_refused():
    """stop() has queued its cancel (the loop busy meanwhile) when a call comes: refused, not queued behind
    the cancel on a loop that stops before running it."""
    loop = LoopThread()
    gate = threading.Event()
    loop.loop.call_soon_threadsafe(gate.wait)
    loop.stop(timeout_s=0)
    gate.set()

    async def forever() -> None:
        await asyncio.sleep(3600)

    with pytest.raises(RuntimeError, match="closed"):
        loop.run(forever(), timeout_s=HANG_GUARD_S)
    loop.stop()
    assert not loop.running


def test_a_call_the_stopped_loop_left_unfinished_is_answered(caplog):
    """A call whose coroutine's `finally` needs more than the one turn stop() gives: the caller gets a
    RuntimeError when the loop ends, and nothing is logged (its cancellation, handed to the loop after the loop
    closed, logged an "Event loop is closed" traceback)."""
    loop = LoopThread()
    started = threading.Event()

    async def slow_to_cancel() -> None:
        try:
            started.set()
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)

    outcome: list[BaseException] = []

    def call() -> None:
        try:
            loop.run(slow_to_cancel(), timeout_s=HANG_GUARD_S)
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert started.wait(HANG_GUARD_S)
    loop.stop()
    caller.join()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "closed while the call ran" in str(outcome[0])
    assert "Event loop is closed" not in caplog.text
