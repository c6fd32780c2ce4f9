"""A peer rank's own process frame, whatever it serves: say it is joining, join the world, load, say it is
ready, answer rank 0's messages until ("stop",), then exit without the interpreter's slow teardown.

Separate from runner/peers.py, which is rank 0's side (spawning, messaging, watching and stopping its peers)
and what the video pipeline's peers load and exchange: this frame knows nothing of the model. Any error is
exit code 1 (a bad checkpoint one line, as rank 0 says it; anything else its traceback), and rank 0 being
gone, found by a failed exchange or by runner/peer_start.py `watch_leader`, ends the peer within a second.
The peer ignores SIGINT / SIGTERM: rank 0 owns the shutdown. Every receive polls rank 0's liveness, so an
idle wait never outlives it; rank 0 pings idle peers (PeerRanks.keep_alive) before the world's timeout.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch

from worldserve.parallel import comm
from worldserve.parallel.groups import ParallelGroup
from worldserve.runner.peer_start import PeerLink, ignore_held_signals, watch_leader

log = logging.getLogger("worldserve.peers")
LEADER = 0
INIT_TIMEOUT_S = 1800.0


def run_peer(
    rank: int, link: PeerLink, world_size: int, device: str, label: str,
    load: Callable[[torch.device], object], serve: Callable[[object, ParallelGroup, torch.device, Callable], None],
    timeout_s: float = INIT_TIMEOUT_S,
) -> None:  # fmt: skip
    """A peer process: say ("joining",) on `link`, join the world, `load(device)`, say ("ready",), then
    `serve(loaded, group, device, leader_alive)` until it returns (after ("stop",)); exit code 1 on any error
    (a bad checkpoint: one line, as rank 0 says it; anything else: its traceback), or once rank 0 is gone."""
    from worldserve.weights.checkpoint import CheckpointError

    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [{label} rank {rank}] %(message)s")
    # Rank 0 owns the shutdown: a terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process
    # group, and a peer that died of it cut the running jobs' grace short (rank 0 lost its peers mid-step).
    # A peer ends when rank 0 says ("stop",), or within LEADER_POLL_S of rank 0 being gone (watch_leader).
    # (It started with them held: runner/peer_start.py StartupPipes.spawn.)
    ignore_held_signals()
    watch_leader(link, label, rank)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    leader_alive = link.leader_alive

    try:
        link.conn.send(("joining",))
        group = comm.init_world(
            "nccl" if dev.type == "cuda" else "gloo", link.init_method, rank, world_size, timeout_s
        )
        loaded = load(dev)
        link.conn.send(("ready",))
        link.conn.close()
        serve(loaded, group, dev, leader_alive)
    except comm.PeerError as exc:
        log.error("rank 0 is gone (%s); exiting", exc)
        sys.exit(1)
    except (BrokenPipeError, ConnectionResetError):  # a start-up word to a rank 0 that has exited
        log.error("rank 0 is gone (its start-up pipe is closed); exiting")
        sys.exit(1)
    except CheckpointError as exc:  # the user's to fix, and the same files rank 0 reads: no traceback
        log.error("could not load the model: %s", exc)
        sys.exit(1)
    except BaseException as exc:
        if not leader_alive() or (
            isinstance(exc, RuntimeError) and wait_until(lambda: not leader_alive(), 1.0)
        ):
            # (rank 0 vanished mid-collective: the transport's error is only the symptom)
            log.error("rank 0 is gone (%s); exiting", type(exc).__name__)
        else:
            traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
    finally:
        comm.destroy_world()
    # A clean stop: nothing left to flush but the logs. Skip the interpreter's teardown (torch.compile's
    # worker pools, CUDA context) that kept a 2-GPU peer alive past the leader's 30 s join.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_messages(
    group: ParallelGroup,
    dev: torch.device,
    leader_alive: Callable[[], bool],
    handlers: dict[str, Callable[..., None]],
    label: str,
) -> None:
    """A peer's loop: receive rank 0's messages and call handlers[kind](*args) until ("stop",); ("ping",) is
    only there to end an idle wait before it times out."""
    while True:
        kind, *args = comm.recv_object(LEADER, group, dev, leader_alive)
        if kind == "stop":
            return
        if kind == "ping":
            continue
        if kind not in handlers:
            raise ValueError(f"unknown {label} message {kind!r}")
        handlers[kind](*args)


def wait_until(done: Callable[[], bool], wait_s: float) -> bool:
    """Whether `done()` holds within `wait_s` (asked every 50 ms): a transport's error can come before the
    process at its other end has finished dying."""
    deadline = time.monotonic() + wait_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
