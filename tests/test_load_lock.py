"""Model loads in one process take turns (weights/load_lock.py): diffusers' from_pretrained puts every module
built anywhere in the process on the meta device while it runs, so an Engine retried while an abandoned load
still ran failed with "Cannot copy out of meta tensor", and so did two Engines built at once."""

from __future__ import annotations

import threading

import pytest

from tests.offline_engines import OPTIONS, TINY
from worldserve import Engine
from worldserve.commands.bounded_load import LoadTimeout, bounded_load
from worldserve.weights.load_lock import model_loads


def test_an_engine_retried_right_after_a_load_timeout_loads_and_generates():
    with pytest.raises(LoadTimeout):
        Engine(None, init_timeout=0.05, **OPTIONS)  # abandoned: its load goes on on its thread
    with Engine(None, **OPTIONS) as engine:  # waits for it, then loads
        out = engine.generate_video("a fox in the snow", **TINY)
    assert out.video[4:8] == b"ftyp"


def test_two_engines_built_at_once_on_two_threads_both_load():
    engines: list[Engine] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            engines.append(Engine(None, **OPTIONS))
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        assert len(engines) == 2
        for engine in engines:
            assert engine.generate_video("a cat", **TINY).video[4:8] == b"ftyp"
    finally:
        for engine in engines:
            engine.close()


def test_a_load_that_timed_out_waiting_for_another_says_so_and_runs_after_it():
    holding, release_it = threading.Event(), threading.Event()

    def other_load() -> None:
        with model_loads("another model"):
            holding.set()
            release_it.wait()

    other = threading.Thread(target=other_load)
    other.start()
    holding.wait()
    ran, released = threading.Event(), []

    def load() -> str:
        with model_loads("this model"):
            ran.set()
            return "loaded"

    with pytest.raises(LoadTimeout, match="waited all along for an earlier load in this process"):
        bounded_load(load, 0.2, thread_name="test-load", release=released.append)
    assert not ran.is_set()
    release_it.set()
    other.join()
    assert ran.wait(10)  # the abandoned load ran once the other ended, and its value went to `release`
    for _ in range(100):
        if released:
            break
        threading.Event().wait(0.05)
    assert released == ["loaded"]


def test_the_lock_is_reentrant_within_a_load():
    with model_loads("outer"), model_loads("inner"):
        pass
