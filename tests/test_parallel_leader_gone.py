"""Peer ranks when rank 0 is gone or the checkpoint is bad (runner/peer_process.py `run_peer`, runner/peer_start.py
`watch_leader`), on gloo CPU ranks.

Rank 0 killed outright (SIGKILL, or SIGTERM's default exit, which runs no clean-up) while its peers load or
wait in the rendezvous: each peer exits within a second or so (was: it finished its load, minutes for a 16B
checkpoint on a GPU no one would use, or waited in the rendezvous up to the world's timeout). A bad checkpoint
is one line from each peer, as from rank 0, not a traceback a rank."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

CPU = torch.device("cpu")


def _alive(pid: int) -> bool:
    """Running (not a zombie left for a parent that does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} did not appear within {timeout_s:g}s")
        time.sleep(0.05)


# ------------------------------------------------------------------------------------ processes (spawned)
def _peer(rank: int, link, folder: str, load_s: float) -> None:
    """A peer that writes its pid, then loads for `load_s` seconds (rank 0 is killed meanwhile)."""
    from worldserve.runner.peer_process import run_peer, serve_messages

    Path(folder, f"peer{rank}.pid").write_text(str(os.getpid()))

    def load(_dev) -> None:
        Path(folder, "peer-loading").touch()
        time.sleep(load_s)

    def serve(_loaded, group, dev, leader_alive) -> None:
        serve_messages(group, dev, leader_alive, {}, "test")

    run_peer(rank, link, 2, "cpu", "test", load, serve, 120.0)


def _rank0(folder: str, stall_join: bool) -> None:
    """Rank 0 in a process of its own (the test kills it): its peer loads for a minute; with `stall_join`
    rank 0 never hosts the rendezvous (as if killed just before), so the peer waits there."""
    from worldserve.parallel import comm
    from worldserve.runner.peers import PeerRanks

    if stall_join:

        def init_world(*_args, **_kwargs):
            Path(folder, "rank0-joining").touch()
            time.sleep(120)

        comm.init_world = init_world
    PeerRanks.start(
        "test", _peer, lambda r, link: (r, link, folder, 120.0), [CPU, CPU], lambda: None, timeout_s=120.0
    )
    time.sleep(120)


@pytest.mark.parametrize(
    ("stall_join", "stage"), [(False, "peer-loading"), (True, "rank0-joining")], ids=["loading", "joining"]
)
def test_peers_exit_at_once_when_rank0_is_killed(tmp_path, stall_join, stage):
    """SIGKILL to rank 0 while its peer loads, or while the peer waits in the rendezvous for rank 0's store:
    the peer exits within seconds, saying why."""
    rank0 = multiprocessing.get_context("spawn").Process(
        target=_rank0, args=(str(tmp_path), stall_join), name="test-rank0"
    )
    rank0.start()
    peer = None
    try:
        _wait_for(tmp_path / stage, 60)
        peer = int((tmp_path / "peer1.pid").read_text())
        time.sleep(0.3)  # (into the wait)
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.join(5)
        # (the 10 s wait is the hang guard: a peer blind to rank 0's end loads, or waits the world, for 120 s)
        t0 = time.monotonic()
        while _alive(peer) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not _alive(peer), "the peer outlived rank 0 by 10 s"
    finally:
        if rank0.is_alive():
            rank0.kill()
            rank0.join(5)
        if peer is not None and _alive(peer):
            os.kill(peer, signal.SIGKILL)


def _peer_with_a_bad_checkpoint(rank: int, link) -> None:
    from worldserve.runner.peer_process import run_peer
    from worldserve.weights.checkpoint import CheckpointError

    def load(_dev) -> None:
        raise CheckpointError(
            "/ckpt/transformer/shard-1.safetensors: unreadable safetensors file; re-download it"
        )

    run_peer(rank, link, 2, "cpu", "test", load, lambda *_: None, 60.0)


def test_a_bad_checkpoint_is_one_line_from_the_peer(capfd):
    """A CheckpointError in a peer's load (the same files rank 0 reads, so rank 0 says it too): one line on the
    peer's stderr, no traceback; rank 0 still names the rank and its exit code."""
    from worldserve.parallel.comm import PeerError
    from worldserve.runner.peers import PeerRanks

    with pytest.raises(PeerError, match="test rank 1 exited while loading \\(exit code 1\\)"):
        PeerRanks.start(
            "test", _peer_with_a_bad_checkpoint, lambda r, link: (r, link), [CPU, CPU], lambda: None,
            timeout_s=60.0,
        )  # fmt: skip
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if "shard-1" in line] == [
        "ERROR [test rank 1] could not load the model: "
        "/ckpt/transformer/shard-1.safetensors: unreadable safetensors file; re-download it"
    ]


# ------------------------------------------------------------------------------------ rank 0's set-up
def _peer_dying_after_it_joins(rank: int, link) -> None:
    """Joins the world, then dies (as if killed) before its collective set-up."""
    from worldserve.runner.peer_process import run_peer

    run_peer(rank, link, 2, "cpu", "test", lambda _dev: os._exit(5), lambda *_: None, 60.0)


def test_a_set_up_wait_that_runs_out_on_a_dead_peer_is_one_line():
    """Rank 0's load_local waits in torch.distributed (a Ulysses group's new_group, 300 s with gloo) on a peer
    that died after joining: when that wait raises, the error names the dead peer and its exit code (was: a
    DistStoreError traceback about a store key)."""
    from torch.distributed import DistStoreError

    from worldserve.parallel.comm import PeerError
    from worldserve.runner.peers import PeerRanks

    def load_local() -> None:  # (the wait itself, shortened: until the peer is gone, then the timeout error)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
            p.name == "worldserve-test-rank1" for p in multiprocessing.active_children()
        ):
            time.sleep(0.05)
        raise DistStoreError("wait timeout after 300000ms, keys: /default_pg/0//1//cpu//0/1")

    with pytest.raises(PeerError, match=r"^test rank 1 exited while loading \(exit code 5\)"):
        PeerRanks.start(
            "test", _peer_dying_after_it_joins, lambda r, link: (r, link), [CPU, CPU], load_local,
            timeout_s=60.0,
        )  # fmt: skip
