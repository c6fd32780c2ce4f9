"""Multi-rank start-up (runner/peers.py, runner/peer_start.py) on gloo CPU ranks: every rank joins the world
first and loads at the same time; a peer that exits before joining or while it loads is one PeerError line
naming its rank and exit code, at once, with no peer process left (was: rank 0 waited on it inside
torch.distributed until the world's 30-minute timeout); a rendezvous that runs out leaves no half-made world.

Where rank 0 could hang it runs in a spawned process, killed when it has not answered in time: a rank 0
left stuck in init_process_group in the test process would break every later world there."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time

import pytest
import torch

CPU = torch.device("cpu")


def _as_rank0(fn, *args, timeout_s: float = 90.0):
    """fn(*args, answer) in a spawned process (not daemonic: it spawns peers) -> what it put in `answer`."""
    ctx = multiprocessing.get_context("spawn")
    answer = ctx.Queue()
    p = ctx.Process(target=fn, args=(*args, answer), name="test-rank0")
    p.start()
    try:
        return answer.get(timeout=timeout_s)
    except queue.Empty:
        pytest.fail(f"rank 0 gave no answer within {timeout_s:g}s (hung on a dead peer?)")
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


def _outcome(start, answer) -> None:
    """Run `start()` (rank 0's start-up), put (error type, message, live child processes)."""
    try:
        start()
        err = (None, "")
    except Exception as exc:
        err = (type(exc).__name__, str(exc))
    answer.put((*err, [c.name for c in multiprocessing.active_children()]))


# ---------------------------------------------------------------------------------------------- the real pipeline
def _peer_dying_in_its_load(rank: int, *args) -> None:
    """runner/peers.py peer_worker_main, but rank 2 exits (code 3) as its transformer starts to load."""
    from worldserve.runner import peers, video_pipeline

    if rank == 2:

        def dies(*_args, **_kwargs):
            os._exit(3)

        video_pipeline.load_configured_transformer = dies
    peers.peer_worker_main(rank, *args)


def _load_4_ranks_one_dying(ckpt: str, answer) -> None:
    from worldserve.runner import parallel_pipeline
    from worldserve.runner.video_pipeline import load_pipeline

    parallel_pipeline.peer_worker_main = _peer_dying_in_its_load
    _outcome(
        lambda: load_pipeline(ckpt, cfg_parallel_size=2, ulysses_degree=2, device="cpu", dtype=torch.float32,
                              progress=False),
        answer,
    )  # fmt: skip


def test_a_peer_dying_while_it_loads_is_one_line_and_leaves_no_peer(tiny_ckpt):
    """--cfg-parallel-size 2 --ulysses-degree 2: rank 2 exits while it loads its weights, after every rank
    joined the world (and made its Ulysses group); rank 0 says so in one line naming the rank and exit code,
    in seconds (_as_rank0's 90 s wait is the hang guard: the world's timeout is 1800 s), and ranks 1 and 3
    are gone too."""
    kind, message, children = _as_rank0(_load_4_ranks_one_dying, str(tiny_ckpt))
    assert (kind, message) == (
        "PeerError",
        "--cfg-parallel-size 2 --ulysses-degree 2: parallel rank 2 exited while loading (exit code 3); "
        "see its log above",
    )
    assert children == []


# ---------------------------------------------------------------------------------------------- PeerRanks.start
def _peer_dying_before_it_joins(rank: int, link) -> None:
    """A peer that is killed (SIGKILL, as the OOM killer does) a second into its start, before it joins the
    world: after rank 0's (instant) load has returned."""
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def _start_with_a_peer_dying_before_it_joins(answer) -> None:
    from worldserve.runner.peers import PeerRanks

    _outcome(
        lambda: PeerRanks.start("test", _peer_dying_before_it_joins, lambda r, link: (r, link), [CPU, CPU],
                                lambda: None, timeout_s=120.0),
        answer,
    )  # fmt: skip


def test_a_peer_dying_before_it_joins_the_world_fails_at_once():
    """Alive when rank 0's load returned, dead before joining: rank 0 does not enter the rendezvous until
    every peer says it is joining (was: init_process_group waited the world's timeout for the dead peer: 120 s
    here, past _as_rank0's 60 s wait, the hang guard)."""
    kind, message, children = _as_rank0(_start_with_a_peer_dying_before_it_joins, timeout_s=60)
    assert (kind, message) == (
        "PeerError",
        "test rank 1 exited before joining the world (exit code -9 (SIGKILL))",  # (a kill leaves no log)
    )
    assert children == []


def _peer_loading_with_rank0(rank: int, link, marker: str) -> None:
    from worldserve.runner.peer_process import run_peer, serve_messages

    def load(_dev) -> None:
        open(marker, "w").close()

    def serve(_loaded, group, dev, leader_alive) -> None:
        serve_messages(group, dev, leader_alive, {}, "test")

    run_peer(rank, link, 2, "cpu", "test", load, serve, 60.0)


def test_every_rank_loads_at_the_same_time(tmp_path):
    """The peers load while rank 0 does (was: their rendezvous waited for rank 0's whole load first)."""
    from worldserve.runner.peers import PeerRanks

    marker = tmp_path / "peer-loading"

    def load_local() -> bool:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return marker.exists()

    peers, overlapped = PeerRanks.start(
        "test", _peer_loading_with_rank0, lambda r, link: (r, link, str(marker)), [CPU, CPU], load_local,
        timeout_s=60.0,
    )  # fmt: skip
    peers.close()
    assert overlapped and peers.processes[0].exitcode == 0


def test_a_rendezvous_that_runs_out_leaves_no_world_and_the_next_start_works(tmp_path):
    """Rank 0's join is bounded (here 1 s, nobody coming); it raises, leaves no world behind, and a
    two-rank start after it runs (a rendezvous left hanging had broken every later one in the process)."""
    from worldserve.parallel import comm
    from worldserve.runner.peers import PeerRanks

    t0 = time.monotonic()
    store, init_method = comm.host_store(2, 60.0)
    with pytest.raises(RuntimeError, match="waiting for clients: 1 of the 1 other ranks did not join"):
        comm.init_world("gloo", init_method, 0, 2, 60.0, join_timeout_s=1.0, store=store)
    # The bound is the behaviour (the join's 1 s, not the world's 60 s; both end in the same error) and
    # nothing else tells them apart: ~2 s here (the store rounds the 1 s up), so 15 s is over 5x that.
    assert time.monotonic() - t0 < 15 and not comm.world_initialized()
    marker = tmp_path / "peer-loading"
    peers, _ = PeerRanks.start(  # (its first message, a ping, went through)
        "test", _peer_loading_with_rank0, lambda r, link: (r, link, str(marker)), [CPU, CPU], lambda: None,
        timeout_s=60.0,
    )  # fmt: skip
    peers.close()
    assert marker.exists() and peers.processes[0].exitcode == 0


def test_a_peer_outlives_the_signals_that_reach_its_process_group(tmp_path):
    """A terminal's Ctrl-C and a service manager's stop signal every process of the group: a peer ignores
    SIGINT and SIGTERM (rank 0 runs the graceful shutdown and stops it; it had died at once, so rank 0 lost
    it mid-step and the running jobs lost their grace), and still ends cleanly when rank 0 closes it."""
    from worldserve.runner.peers import PeerRanks

    marker = tmp_path / "peer-loading"
    peers, _ = PeerRanks.start(
        "test", _peer_loading_with_rank0, lambda r, link: (r, link, str(marker)), [CPU, CPU], lambda: None,
        timeout_s=60.0,
    )  # fmt: skip
    peer = peers.processes[0]
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(peer.pid, sig)
    time.sleep(1.0)
    alive = peer.is_alive()
    peers.close()
    assert alive and peer.exitcode == 0


RANK0_LEAVING = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_parallel_start import _peer_loading_with_rank0
from worldserve.runner.peers import PeerRanks
cpu = torch.device("cpu")
peers, _ = PeerRanks.start("test", _peer_loading_with_rank0, lambda r, link: (r, link, {marker!r}), [cpu, cpu],
                           lambda: None, timeout_s=60.0)
print(peers.processes[0].pid, flush=True)
"""  # rank 0's script ends with its peer up, neither closed nor killed (an error, a Ctrl-C in the load)


def test_a_rank0_leaving_without_closing_its_peers_exits(tmp_path):
    """The peers ignore SIGTERM, which multiprocessing's exit hook sends its daemon children before joining
    them with no timeout: rank 0's own exit hook kills what is left first (it had waited forever)."""
    import subprocess
    import sys
    from pathlib import Path

    script = RANK0_LEAVING.format(tests=str(Path(__file__).parent), marker=str(tmp_path / "peer-loading"))
    # (the run's timeout is the hang guard: without the exit hook's kill, rank 0 waits for its peer forever)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    peer = int(done.stdout.split()[0])
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(peer, 0)


RANK0_SIGNALLING = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from test_parallel_start import _peer_loading_with_rank0
from worldserve.runner import peer_start
from worldserve.runner.peers import PeerRanks
spawn = peer_start.StartupPipes.spawn

def spawn_then_signal(self, procs):
    spawn(self, procs)
    for p in procs:
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(p.pid, sig)

peer_start.StartupPipes.spawn = spawn_then_signal
cpu = torch.device("cpu")
peers, _ = PeerRanks.start("test", _peer_loading_with_rank0, lambda r, link: (r, link, {marker!r}), [cpu, cpu],
                           lambda: None, timeout_s=60.0)
peers.close()
print(peers.processes[0].exitcode, flush=True)
"""  # a fresh interpreter: its first spawn starts multiprocessing's resource tracker too


def test_a_peer_still_starting_outlives_the_signals_that_reach_its_process_group(tmp_path):
    """Ctrl-C in the terminal while the peers are still starting (importing torch, before run_peer ignores
    the signals): they hold SIGINT and SIGTERM from their first instruction and start as usual (each had died
    of a KeyboardInterrupt traceback, or at once of the SIGTERM). The signals go out right after the spawn,
    long before a peer's interpreter could run a line of its own."""
    import subprocess
    import sys
    from pathlib import Path

    script = RANK0_SIGNALLING.format(tests=str(Path(__file__).parent), marker=str(tmp_path / "peer-loading"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "0\n"), done.stderr[-2000:]
