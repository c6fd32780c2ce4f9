"""`LastingThreadPool` (worldserve/lasting_pool.py): a ThreadPoolExecutor by type whose work goes on through
the interpreter's exit, where concurrent.futures' own pools refuse work (the offline Engine's requests in
threads Python waits for: tests/test_offline_engine_exit.py runs that end to end)."""

from __future__ import annotations

import asyncio
import concurrent.futures.thread
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from worldserve.lasting_pool import LastingThreadPool


def test_it_runs_calls_returns_results_and_raises_their_errors():
    pool = LastingThreadPool(2, thread_name_prefix="test-pool")
    assert isinstance(pool, ThreadPoolExecutor)
    assert list(pool.map(lambda x: x * x, range(10))) == [x * x for x in range(10)]
    failing = pool.submit(int, "not a number")
    with pytest.raises(ValueError):
        failing.result()
    names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(8)}
    assert all(n.startswith("test-pool_") for n in names) and len(names) <= 2
    pool.shutdown()


def test_it_serves_after_concurrent_futures_marked_the_interpreter_exiting(monkeypatch):
    """concurrent.futures' exit hook sets its module's `_shutdown`: every ThreadPoolExecutor refuses work from
    then on; this pool does not, and its workers are daemon threads (never holding the exit up)."""
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        ThreadPoolExecutor(1).submit(print)
    pool = LastingThreadPool(1)
    assert pool.submit(lambda: threading.current_thread().daemon).result() is True
    pool.shutdown()


def test_shutdown_runs_or_cancels_the_queue_and_refuses_more():
    gate = threading.Event()
    pool = LastingThreadPool(1)
    first = pool.submit(gate.wait)
    queued = [pool.submit(lambda i=i: i) for i in range(3)]
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert first.result() is True
    assert all(f.cancelled() for f in queued)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)
    kept = LastingThreadPool(1)
    later = [kept.submit(lambda i=i: i) for i in range(3)]
    kept.shutdown(wait=True)
    assert [f.result() for f in later] == [0, 1, 2]


def test_each_worker_runs_the_initializer_first_and_asyncio_takes_it_as_its_default_executor():
    started: list[str] = []
    pool = LastingThreadPool(1, initializer=lambda: started.append(threading.current_thread().name))
    loop = asyncio.new_event_loop()
    loop.set_default_executor(pool)
    try:
        assert loop.run_until_complete(asyncio.to_thread(lambda: 7)) == 7
    finally:
        loop.close()  # (shuts its default executor down)
    assert len(started) == 1
    with pytest.raises(RuntimeError):
        pool.submit(print)


def test_a_pool_dropped_without_shutdown_ends_its_workers_after_its_queued_calls():
    """Workers hold the pool weakly (as concurrent.futures' do): a pool nobody holds any more ends its threads
    once the calls it had queued have run (an Engine's media-fetch pool kept 32 idle threads per Engine)."""
    import gc

    gate = threading.Event()
    pool = LastingThreadPool(3, thread_name_prefix="dropped-pool")
    futures = [pool.submit(gate.wait)] + [pool.submit(lambda i=i: i) for i in range(5)]
    del pool
    gc.collect()
    gate.set()
    assert [f.result(timeout=30) for f in futures[1:]] == list(range(5))
    for thread in [t for t in threading.enumerate() if t.name.startswith("dropped-pool")]:
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_an_initializer_that_raises_even_systemexit_leaves_the_worker_serving():
    def initializer() -> None:
        raise SystemExit("no")

    pool = LastingThreadPool(1, initializer=initializer)
    assert pool.submit(lambda: 5).result(timeout=30) == 5
    pool.shutdown()
