"""Start-up handshake between rank 0 and its spawned peer ranks (runner/peers.py `PeerRanks.start`), on plain
pipes rather than torch.distributed.

Each peer says ("joining",) just before it joins the world and ("ready",) once its weights are loaded. Rank 0
waits for each word on the pipes and the peers' process sentinels together, so a peer that exits (an import
error, a bad GPU, an out-of-memory kill while loading) is a one-line `PeerError` naming its rank and exit
code at once, where a wait inside torch.distributed (the rendezvous, gloo's mesh, NCCL building a
communicator on a first message) would have sat until the world's 30-minute timeout. Rank 0 joins the
world only once every peer is alive at its door, and bounds that rendezvous by `JOIN_TIMEOUT_S`.

A peer holds SIGINT and SIGTERM from its first instruction (`spawn` starts it with both blocked) until its
run_peer ignores them: a terminal's Ctrl-C during the start, which reaches the whole process group, had ended
every peer still importing torch with a KeyboardInterrupt traceback (rank 0 owns the shutdown).

The other way round, a peer watches rank 0 (`watch_leader`, its whole life): once rank 0 is gone (killed, or
a SIGTERM's default exit, which skips every clean-up), the peer exits within `LEADER_POLL_S` whatever it is
doing, rather than finishing a minutes-long load or waiting in the rendezvous (up to the world's timeout)
on a GPU no one will use.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from worldserve.parallel.comm import PeerError

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

JOIN_TIMEOUT_S = 60.0
"""Rank 0's bound on the world's rendezvous (at most the world's timeout). It starts once every peer has said
("joining",), so it takes well under a second; only a peer dying right then can make it run out."""
LEADER_POLL_S = 0.5
"""How often a peer checks that rank 0 (its parent process) is still there."""
HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
"""The signals a peer is started with blocked (a blocked mask survives fork and exec), released by run_peer
once it ignores them."""


@contextmanager
def signals_held() -> Iterator[None]:
    """HELD_SIGNALS blocked in the calling thread (the one that starts the peers: serve's loader thread),
    whose mask the processes it starts inherit; other threads, the main one among them, still take them."""
    from multiprocessing import resource_tracker

    # (first: the tracker's own start, with a process's first spawn, unblocks SIGINT and SIGTERM after it)
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_held_signals() -> None:
    """In a peer: ignore HELD_SIGNALS and unblock them (one that came while they were held is dropped)."""
    for sig in HELD_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


@dataclass(frozen=True, slots=True)
class PeerLink:
    """What a spawned peer gets to reach rank 0 (picklable into the spawned process)."""

    init_method: str
    """tcp://127.0.0.1:PORT: rank 0's TCPStore, the world's rendezvous (parallel/comm.py `init_world`)."""
    conn: Connection
    """The peer's (write) end of its start-up pipe: ("joining",), then ("ready",)."""
    leader_pid: int
    """Rank 0's process id: the peer's parent while rank 0 lives."""

    def leader_alive(self) -> bool:
        """Whether rank 0 is still the peer's parent (a dead parent's children are handed to another)."""
        return os.getppid() == self.leader_pid


def watch_leader(link: PeerLink, label: str, rank: int, period_s: float = LEADER_POLL_S) -> None:
    """In a peer: a daemon thread that ends the process (exit code 1, one line on stderr) once rank 0 is gone,
    whether the peer is loading, joining the world (a C++ wait no signal reaches) or serving. It calls no
    torch.distributed (os._exit only), so it is safe beside them."""

    def loop() -> None:
        while link.leader_alive():
            time.sleep(period_s)
        os.write(2, f"ERROR [{label} rank {rank}] rank 0 (pid {link.leader_pid}) is gone; exiting\n".encode())
        os._exit(1)

    threading.Thread(target=loop, name=f"worldserve-{label}-rank{rank}-watch", daemon=True).start()


def exit_reason(code: int | None) -> str:
    """'exit code 3', 'exit code -9 (SIGKILL)' (killed by a signal: the OOM killer's is SIGKILL)."""
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class StartupPipes:
    """Rank 0's ends of the peers' start-up pipes, and the waits on them that watch the peers' processes."""

    def __init__(self, ctx: BaseContext, label: str, peers: int, timeout_s: float) -> None:
        self.label = label
        self.timeout_s = timeout_s
        self._pipes = [ctx.Pipe(duplex=False) for _ in range(peers)]  # (rank 0's read end, the peer's end)
        self.procs: list = []

    def link(self, rank: int, init_method: str) -> PeerLink:
        return PeerLink(init_method, self._pipes[rank - 1][1], os.getpid())

    def spawn(self, procs: Sequence) -> None:
        """Start the peers' processes (ranks 1..) with HELD_SIGNALS blocked, then close the peers' ends here:
        each is then held by its peer alone, so the peer's exit reads as the end of its pipe."""
        self.procs = list(procs)
        with signals_held():
            for p in self.procs:
                p.start()
        for _, theirs in self._pipes:
            theirs.close()

    def wait_for(self, word: str, stage: str) -> None:
        """Until every peer has said (word,); PeerError at once when one exits first (`stage`: 'while
        loading'), says anything else, or when the world's timeout passes."""
        pending = {r: ours for r, (ours, _) in enumerate(self._pipes, 1)}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = ", ".join(map(str, pending))
                raise PeerError(
                    f"{self.label} rank(s) {ranks} did not say {word!r} within {self.timeout_s:g}s"
                )
            wait([*pending.values(), *(self.procs[r - 1].sentinel for r in pending)], timeout=min(left, 1.0))
            for r, ours in list(pending.items()):
                try:
                    if ours.poll():
                        if (msg := ours.recv()) != (word,):
                            raise PeerError(
                                f"unexpected start-up message from {self.label} rank {r}: {msg!r}"
                            )
                        del pending[r]
                        continue
                except (EOFError, OSError):  # its end is closed: the peer is gone (or going)
                    raise self._exited(r, stage) from None
                if not self.procs[r - 1].is_alive():
                    raise self._exited(r, stage)

    def check(self, stage: str) -> None:
        """PeerError for the first peer that has exited, if any."""
        for r, p in enumerate(self.procs, 1):
            if not p.is_alive():
                raise self._exited(r, stage)

    def _exited(self, r: int, stage: str) -> PeerError:
        p = self.procs[r - 1]
        p.join(5)  # (its pipe can close a moment before the process is reaped: then its exit code is known)
        # (a signal, SIGKILL's above all, leaves no log of the peer's own to see)
        said = "" if p.exitcode is not None and p.exitcode < 0 else "; see its log above"
        return PeerError(f"{self.label} rank {r} exited {stage} ({exit_reason(p.exitcode)}){said}")

    def close(self) -> None:
        for ours, theirs in self._pipes:
            ours.close()
            theirs.close()
