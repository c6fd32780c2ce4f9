"""commands/bounded_load.py, the load serve and the offline Engine wait on for at most init_timeout: a value in
time is returned, the load's own errors (its own TimeoutError too) raised as themselves, and a load abandoned
past the timeout has its late value released, never leaked."""

from __future__ import annotations

import threading

import pytest

from worldserve.commands.bounded_load import LoadTimeout, bounded_load


def test_a_load_in_time_returns_its_value_and_its_errors_are_its_own():
    released: list[object] = []
    assert bounded_load(lambda: ("backend",), 5, thread_name="t", release=released.append) == ("backend",)

    def network_timeout():
        raise TimeoutError("read timed out")

    with pytest.raises(TimeoutError, match="read timed out") as caught:
        bounded_load(network_timeout, 5, thread_name="t", release=released.append)
    assert not isinstance(caught.value, LoadTimeout) and released == []


def test_an_abandoned_load_s_late_value_is_released():
    gate, released, done = threading.Event(), [], threading.Event()

    def slow():
        gate.wait(10)
        return "late backend"

    def release(value):
        released.append(value)
        done.set()

    with pytest.raises(LoadTimeout, match="within 0.01 s"):
        bounded_load(slow, 0.01, thread_name="t", release=release)
    gate.set()
    assert done.wait(10) and released == ["late backend"]
