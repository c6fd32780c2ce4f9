"""The offline `Engine` refuses no request for a full queue, as vLLM's `LLM` has no admission bound: the
`max_queued_requests` option (serve's --max-queued-requests, a 429 past it) is accepted for parity and bounds
nothing here. Lists from several threads, and more single calls than the bound, all wait their turn (the fake
backend, whose `step_gate` holds the first step until every request is in the engine: no clock).
"""

from __future__ import annotations

import threading

import pytest
from serving_helpers import wait_until

SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 1}


@pytest.fixture()
def engine():
    """The fake backend, 2 requests a batch, a queue bound of 3 (serve would 429 the fourth waiting request)."""
    from worldserve import Engine

    with Engine(None, backend="fake", max_batch_size=2, max_queued_requests=3) as engine:
        yield engine


def run_in_threads(engine, calls: list) -> list:
    """Each call (prompt or list of prompts) to generate_video in a thread of its own, all started while the
    engine's first step is held, released once all are in the engine (or one has ended: a refusal); each
    thread's result or error, in the calls' order."""
    backend = engine._parts.backend
    backend.step_gate = held = threading.Event()
    results: list = [None] * len(calls)

    def call(i: int) -> None:
        try:
            results[i] = engine.generate_video(calls[i], **SMALL)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    # (a list keeps at most 2 x max_batch_size of its items in the engine at once)
    wanted = sum(min(len(c), 4) if isinstance(c, list) else 1 for c in calls)
    try:
        for thread in threads:
            thread.start()
        wait_until(
            lambda: engine.num_unfinished_requests == wanted or any(r is not None for r in results), 60.0
        )
    finally:
        held.set()
        backend.step_gate = None
        for thread in threads:
            thread.join()
    return results


def test_two_lists_from_two_threads_both_run(engine):
    """Two threads each generating a list of 4 at once: 8 requests in the engine, past the bound of 3, and
    neither list refused (before: one got QueueFullError though each list alone fits)."""
    lists = [[f"a{i}" for i in range(4)], [f"b{i}" for i in range(4)]]
    results = run_in_threads(engine, lists)
    for prompts, outputs in zip(lists, results, strict=True):
        assert isinstance(outputs, list), outputs
        assert [o.params.prompt for o in outputs] == prompts
        assert all(o.video for o in outputs)


def test_more_threads_than_the_bound_all_run(engine):
    """Six single calls from six threads, all in the engine together (twice the bound): each gets its video."""
    prompts = [f"p{i}" for i in range(6)]
    results = run_in_threads(engine, prompts)
    assert [r.params.prompt for r in results] == prompts
    assert all(r.video for r in results)
    assert engine.config.scheduler.max_queued_requests == 3
