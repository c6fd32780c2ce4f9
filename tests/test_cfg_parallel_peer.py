"""Peer ranks dying or idling: a dead peer gives a clear error, quickly, instead of a hang; in the server's
engine it stops the loop with its jobs queued again (not failed one by one while /health says healthy); an
idle peer outlives the world's timeout (keep-alive pings); close() still works."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from serving_helpers import make_client, wait_until

from worldserve.engine.client import EncodeOptions, JobSpec, JobStatus, ShuttingDownError
from worldserve.engine.outputs import BackendLost
from worldserve.params import VideoParams

SMALL = dict(num_frames=5, height=32, width=32, generate_sound=False)


def _ends(fn, hang_s: float = 60.0):
    """fn()'s result, or its exception raised here, from a thread of its own; a failure if it has not ended
    within `hang_s`. A guard against a hang (a dead peer waited for until the world's 1800 s timeout), not a
    speed bound: the exception's kind and message say what ended it."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="test-peer-call", daemon=True)
    thread.start()
    thread.join(hang_s)
    if thread.is_alive():
        pytest.fail(f"still waiting after {hang_s:g}s (on the dead peer?)")
    if "error" in out:
        raise out["error"]
    return out.get("result")


def test_dead_peer_raises_instead_of_hanging(tiny_ckpt, caplog):
    from worldserve.parallel.comm import PeerError
    from worldserve.runner.video_pipeline import load_pipeline

    pipe = load_pipeline(tiny_ckpt, cfg_parallel_size=2, device="cpu", dtype=torch.float32, progress=False)
    try:
        params = VideoParams(prompt="a fox", num_inference_steps=3, guidance_scale=6.0, **SMALL)
        state = pipe.prepare("r0", params)
        pipe.denoise([state])
        # the peer dies while rank 0 blocks on it (here: waiting for a message that never comes)
        threading.Timer(0.5, pipe.process.kill).start()
        with pytest.raises(PeerError, match="gone"):
            _ends(lambda: pipe.peers.recv_object(1))
        pipe.process.join(10)
        # /health's question: answered from the processes, before any request meets the dead peer
        with caplog.at_level(logging.ERROR, logger="worldserve.peers"):
            problem = pipe.problem()  # killed by a signal: named, and no log of its own to point to
            assert pipe.problem() == problem  # (asked again: logged once)
        # /health's words: the rank and its exit (no pid: the log line, written once, has it)
        assert problem == "parallel peer rank 1 exited: exit code -9 (SIGKILL)", problem
        [logged] = [r.getMessage() for r in caplog.records if r.name == "worldserve.peers"]
        assert "peer (rank 1, pid" in logged and logged.endswith("exited: exit code -9 (SIGKILL)"), logged
        with pytest.raises(BackendLost, match="--cfg-parallel-size 2: .*peer .*(exited|gone)"):
            _ends(lambda: pipe.denoise([state]))
        # guidance-1 requests never touch the peer: they still run
        solo = pipe.prepare(
            "r1", VideoParams(prompt="a fox", num_inference_steps=2, guidance_scale=1.0, **SMALL)
        )
        pipe.denoise([solo])
        assert solo.step_index == 1
        assert pipe.problem() == "--cfg-parallel-size 2: the peer ranks are stopped"
    finally:
        pipe.close()
    assert not pipe.process.is_alive()


@pytest.mark.parametrize(
    "layout, where, said",
    [({"cfg_parallel_size": 2}, "between steps", "no answer within 2 s"),
     ({"tensor_parallel_size": 2}, "inside a step", "Timed out waiting 4000ms")],
)  # fmt: skip
def test_a_stuck_peer_is_given_up_on_within_the_bounded_wait(tiny_ckpt, layout, where, said):
    """A peer alive but not answering (SIGSTOP: a deadlock, a wedged driver) was waited for until the world's
    1,800 s timeout, the job held and /health green. After the start rank 0 gives it up as a lost backend
    after `bound_waits` (300 s; 2 s here): in an exchange (CFG-parallel's velocities: the peer stopped between
    steps) and, after twice that, in tensor parallelism's all-reduces on the world group (the peer stopped
    inside a step, its inputs received; gloo raises, NCCL's watchdog would abort the process)."""
    import os
    import signal

    from worldserve.runner.video_pipeline import load_pipeline

    pipe = load_pipeline(tiny_ckpt, device="cpu", dtype=torch.float32, progress=False, **layout)
    try:
        state = pipe.prepare(
            "r0", VideoParams(prompt="a fox", num_inference_steps=3, guidance_scale=6.0, **SMALL)
        )
        pipe.denoise([state])
        pipe.peers.bound_waits(2.0)
        if where == "between steps":
            os.kill(pipe.process.pid, signal.SIGSTOP)
        else:
            forward = pipe.local.forward

            def stop_the_peer_then_forward(*args, **kwargs):
                os.kill(pipe.process.pid, signal.SIGSTOP)
                return forward(*args, **kwargs)

            pipe.local.forward = stop_the_peer_then_forward
        with pytest.raises(BackendLost, match=said):
            _ends(lambda: pipe.denoise([state]))
    finally:
        if pipe.process.is_alive():
            os.kill(pipe.process.pid, signal.SIGCONT)
        pipe.close()
    assert not pipe.process.is_alive()


def test_ctrl_c_inside_an_exchange_stops_the_peers_and_close_returns(tiny_ckpt):
    """A KeyboardInterrupt in the middle of an exchange leaves the peers out of step: they are killed then
    (only an Exception did that), so close() does not send its ("stop",) to a peer blocked on the step
    (`generate` hung there after Ctrl-C in every parallel mode)."""
    from worldserve.runner.video_pipeline import load_pipeline

    pipe = load_pipeline(tiny_ckpt, cfg_parallel_size=2, device="cpu", dtype=torch.float32, progress=False)
    try:
        state = pipe.prepare(
            "r0", VideoParams(prompt="a fox", num_inference_steps=3, guidance_scale=6.0, **SMALL)
        )
        send = pipe.peers.send

        def interrupted(msg, to=None):
            send(msg, to)  # (the message went out; the peer now waits on the rest of the step)
            raise KeyboardInterrupt

        pipe.peers.send = interrupted
        with pytest.raises(KeyboardInterrupt):
            pipe.denoise([state])
        assert (
            not pipe.process.is_alive()
            and pipe.problem() == "--cfg-parallel-size 2: the peer ranks are stopped"
        )
    finally:
        pipe.close()  # (nothing to wait for: the peers were killed in the exchange, as asserted above)


def test_a_peer_dying_mid_job_stops_the_engine_and_keeps_the_jobs(tiny_ckpt, tmp_path, caplog):
    """The server's engine: the running job goes back to the queue (it resumes at restart) and so does the
    next one; /health turns unhealthy and new jobs are refused with a reason (was: both jobs failed with a
    500 and /health stayed healthy, failing every later CFG job the same way). The log names the dead peer
    in one line, without a traceback of the transport's error (the peer's death is the cause)."""
    import asyncio

    from worldserve.runner.video_pipeline import load_pipeline

    pipe = load_pipeline(tiny_ckpt, cfg_parallel_size=2, device="cpu", dtype=torch.float32, progress=False)
    params = VideoParams(prompt="a fox", num_inference_steps=50, guidance_scale=6.0, **SMALL)
    spec = JobSpec(model="test-model", prompt="a fox", size="32x32", seconds="1", quality="default", fps=24.0,
                   num_frames=5)  # fmt: skip

    async def main():
        client = make_client(tmp_path, backend=pipe)
        await client.start()
        try:
            running = client.submit(params, spec, EncodeOptions(), None)
            queued = client.submit(params, spec, EncodeOptions(), None)
            await asyncio.to_thread(wait_until, lambda: client.store.get(running.id).progress >= 4, 60)
            pipe.process.kill()
            await asyncio.to_thread(wait_until, lambda: not client.engine.alive, 10)
            ok, reason = client.health()
            with pytest.raises(ShuttingDownError, match="engine has stopped"):
                client.submit(params, spec, EncodeOptions(), None)
            return ok, reason, client.store.get(running.id), client.store.get(queued.id)
        finally:
            await client.shutdown(5)

    try:
        with caplog.at_level(logging.ERROR, logger="worldserve.parallel"):
            ok, reason, running, queued = asyncio.run(main())
    finally:
        pipe.close()
    [record] = [r for r in caplog.records if "failed inside an exchange" in r.getMessage()]
    assert "peer (rank 1" in record.getMessage() and record.exc_info is None, record.getMessage()
    # which peer went, and how, as /health tells of a peer gone while idle (an error's own text stays the log's)
    assert reason.startswith(
        "engine crashed: --cfg-parallel-size 2: the peer ranks are stopped after an error: parallel peer rank 1 "
        "exited: exit code -9 (SIGKILL)"
    ), reason
    assert reason.endswith(". Restart the server") and "pid" not in reason, reason
    assert not ok
    assert running.status is JobStatus.QUEUED
    assert queued.status is JobStatus.QUEUED


def _echo_peer(rank: int, link, world: int, timeout_s: float) -> None:
    """A peer that answers ("echo", x) to ("echo", x)."""
    from worldserve.parallel import comm
    from worldserve.runner.peer_process import LEADER, run_peer, serve_messages

    def serve(_loaded, group, dev, leader_alive):
        def echo(x):
            comm.send_object(("echo", x), LEADER, group, dev, leader_alive)

        serve_messages(group, dev, leader_alive, {"echo": echo}, "test")

    run_peer(rank, link, world, "cpu", "test", lambda dev: None, serve, timeout_s)


def test_an_idle_peer_outlives_the_world_timeout():
    """A peer waiting for its next message longer than the world's timeout (here 8 s; 1800 s in the server)
    is kept alive by pings (was: its receive timed out and it exited, so the next job after an idle half hour
    found the peer gone). (8 s, not less: the world's timeout bounds the spawned peer's start too, whose
    imports take ~3.5 s on an idle CI core and failed a 4 s world under load.)"""
    from worldserve.runner.peers import PeerRanks

    cpu = torch.device("cpu")
    peers, _ = PeerRanks.start(
        "test", _echo_peer, lambda r, init: (r, init, 2, 8.0), [cpu, cpu], lambda: None, timeout_s=8.0
    )
    try:
        time.sleep(12.5)  # (past 1.5x the timeout: without pings the receive had timed out at 8 s)
        with peers.lock:
            peers.send(("echo", 7))
            assert peers.recv_object(1) == ("echo", 7)
    finally:
        peers.close()
    assert peers.processes[0].exitcode == 0


def test_an_abandoned_load_kills_its_peers_before_leaving(tiny_ckpt, tmp_path):
    """--init-timeout expiring while CFG-parallel peers load: rank 0 leaves with os._exit (cli.console), which
    runs no exit hook, so its peers were left to find it gone on their own and each said so at ERROR, twice;
    they are killed before it leaves now (runner/peers.py kill_peers_left)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "worldserve.cli", "serve", str(tiny_ckpt), "--cfg-parallel-size", "2",
            "--device", "cpu", "--init-timeout", "0.5", "--port", "0", "--storage-dir", str(tmp_path / "s")]  # fmt: skip
    # (a spawned peer imports torch for seconds: the 0.5 s expire while it loads, whatever the machine)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr
    assert "did not become ready within 0.5s" in proc.stderr and "is gone" not in proc.stderr, proc.stderr
