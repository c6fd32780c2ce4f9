"""Scheduler policy on fake requests: FCFS admission under the batch cap, oldest group first, drain."""

from __future__ import annotations

from worldserve.engine.fake_backend import FakeState
from worldserve.engine.request import Request
from worldserve.engine.scheduler import Scheduler
from worldserve.params import VideoParams


def _req(name: str, width: int = 64) -> Request:
    return Request(job_id=name, params=VideoParams(prompt=name, width=width, height=64, num_frames=5,
                                                   num_inference_steps=3), arrival_time=0.0)  # fmt: skip


def _prepare(request: Request) -> Request:
    request.state = FakeState(request.job_id, 0, request.params.num_inference_steps, request.params)
    return request


def test_admission_is_fcfs_and_capped():
    s = Scheduler(max_batch_size=2)
    for name in "abc":
        s.add(_req(name))
    admitted = s.admit()
    assert [r.job_id for r in admitted] == ["a", "b"]
    for r in admitted:
        s.start(_prepare(r))
    assert s.admit() == [], "cap reached: c waits"
    s.finish(admitted[0])
    assert [r.job_id for r in s.admit()] == ["c"]


def test_next_batch_is_oldest_group():
    s = Scheduler(max_batch_size=3)
    for r in (_req("a", 64), _req("b", 128), _req("c", 64)):
        s.add(r)
    for r in s.admit():
        s.start(_prepare(r))
    assert [r.job_id for r in s.next_batch()] == ["a", "c"]
    s.finish(s.running[0])
    assert [r.job_id for r in s.next_batch()] == ["b"]


def test_remove_and_drain():
    s = Scheduler(max_batch_size=1)
    a, b = _req("a"), _req("b")
    s.add(a)
    s.add(b)
    s.start(_prepare(s.admit()[0]))
    assert s.remove("b") is b and s.remove("a") is a and s.remove("zz") is None
    assert not s.has_work()
    s.add(_req("c"))
    s.admitting = False
    assert s.admit() == [] and not s.has_work()
