"""Peer ranks of a multi-GPU pipeline, rank 0's side: spawn, connect, message, watch and stop them; and what
the video pipeline's peers load and exchange (`peer_worker_main`, the denoise step's inputs).

Used by CFG-parallel (one peer runs the uncond branch) and Ulysses (P - 1 peers run the same forward on
their share of the tokens). Every rank holds a full transformer on its own device (cuda:r; cpu with gloo
for tests). Messages are small pickled tuples plus tensors through parallel/comm.py; every wait polls the
peer processes, so a dead peer raises `PeerError` (a RuntimeError) instead of hanging. Start-up: every rank
joins the world first and then loads its weights (all at once), and the peers tell rank 0 on a plain pipe
(runner/peer_start.py) that they are joining, then that they are ready: rank 0 never waits inside
torch.distributed on a peer that may be dead or still loading. A peer (runner/peer_process.py `run_peer`)
serves until ("stop",), then exits without the interpreter's slow teardown; it exits on its own within a
second once rank 0 is gone, whatever it is doing (runner/peer_start.py `watch_leader`). A peer left without
a message for a while gets ("ping",): its pending receive would otherwise time out after the world's timeout
(gloo's wait, NCCL's watchdog) and end it, while the server sat idle.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from worldserve.parallel import comm
from worldserve.parallel.groups import ParallelGroup
from worldserve.runner.parallel_layout import COLLECTIVE_TIMEOUT_S
from worldserve.runner.peer_process import INIT_TIMEOUT_S, LEADER, run_peer, serve_messages, wait_until
from worldserve.runner.peer_start import JOIN_TIMEOUT_S, PeerLink, StartupPipes, exit_reason

if TYPE_CHECKING:
    from multiprocessing.context import SpawnContext

    from worldserve.runner.kernel_options import KernelOptions

log = logging.getLogger("worldserve.peers")
_Local = TypeVar("_Local")  # what PeerRanks.start's load_local returns on rank 0
KEEPALIVE_S = 60.0
"""A peer that has had no message for this long (at most a quarter of the world timeout) gets ("ping",)."""
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set (setdefault) before peers are spawned: no NVLink multicast on the lent H200 hosts."""


class PeerBranch(Protocol):
    """What a peer rank serves (`peer_worker_main`'s `make_branch(device)`, e.g. parallel_worker.BranchRank):
    it takes the loaded transformer, then answers rank 0's messages by kind."""

    def load(self, transformer: Any) -> PeerBranch: ...

    def handlers(
        self, group: ParallelGroup, dev: torch.device, leader_alive: Callable[[], bool]
    ) -> dict[str, Callable[..., None]]: ...


class PeerRanks:
    """Rank 0's handle on peer ranks 1..P-1."""

    def __init__(self, processes: Sequence, group: ParallelGroup, comm_device: torch.device, label: str):
        self.processes = list(processes)
        self.group = group
        self.comm_device = comm_device  # NCCL: rank 0's GPU; gloo: cpu
        self.label = label
        self.closed = False
        self.lock = threading.Lock()
        """Held over every exchange with the peers (one at a time; the keep-alive pings take it too)."""
        self._sent = dict.fromkeys(self.ranks, time.monotonic())  # rank -> when it last got a message
        self._stop = threading.Event()
        self._reported: set[int] = set()  # the dead peers `gone` has logged
        self.exchange_timeout_s = COLLECTIVE_TIMEOUT_S
        """How long an exchange waits on a peer that is alive but does not answer (stopped, deadlocked):
        then a PeerError, as for a dead one (it waited the world's 30-minute timeout, /health green)."""

    def keep_alive(self, period_s: float) -> None:
        """Ping, every `period_s`, the peers that got no message meanwhile (a daemon thread)."""

        def loop() -> None:
            while not self._stop.wait(period_s / 4):
                with self.lock:
                    idle = [r for r, t in self._sent.items() if time.monotonic() - t >= period_s]
                    if self.closed or not idle:
                        continue
                    try:
                        self.send(("ping",), idle)
                    except (comm.PeerError, RuntimeError) as exc:  # a dead peer: the next exchange reports it
                        log.warning("%s: keep-alive pings stopped: %s", self.label, exc)
                        return

        threading.Thread(target=loop, name=f"worldserve-{self.label}-keepalive", daemon=True).start()

    @classmethod
    def start(
        cls, label: str, target: Callable, peer_args: Callable[[int, PeerLink], tuple],
        devices: Sequence[torch.device], load_local: Callable[[], _Local], timeout_s: float = INIT_TIMEOUT_S,
    ) -> tuple[PeerRanks, _Local]:  # fmt: skip
        """Spawn `target(*peer_args(rank, link))` for ranks 1..P-1 (`link` goes to their run_peer), join the
        world as rank 0 once every peer says it is joining, run `load_local()` here while the peers load
        theirs (a collective set-up, such as new_group, comes first in both), wait for every peer's ("ready",)
        and start the keep-alive pings. `timeout_s`: the world's (the peers' run_peer must use the same). A
        peer that exits meanwhile is a PeerError naming its rank and exit code, raised at once (while rank 0
        loads: when its load returns, or when a torch.distributed wait in it runs out), the other peers killed.
        -> (peers, load_local's result)."""
        import torch.multiprocessing as mp

        if comm.world_initialized():
            raise RuntimeError("a torch.distributed world already exists in this process (one at a time)")
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
        store, init_method = comm.host_store(len(devices), timeout_s)
        ctx = mp.get_context("spawn")
        pipes = StartupPipes(ctx, label, len(devices) - 1, timeout_s)
        procs: list = []
        try:
            _spawn_peers(procs, ctx, pipes, label, target, peer_args, len(devices), init_method)
            group = _join_world(pipes, label, devices, init_method, timeout_s, store)
            local = _load_beside_peers(pipes, load_local)
            self = cls(procs, group, devices[0], label)
            # Every peer's first message now, while each is known to wait for one (NCCL builds rank 0's
            # communicator with a peer on their first exchange, a wait that polls no liveness).
            self.send(("ping",))
        except BaseException:
            _kill_left(procs, os.getpid())
            comm.destroy_world()
            raise
        finally:
            pipes.close()
        self.keep_alive(min(KEEPALIVE_S, timeout_s / 4))
        self.bound_waits(COLLECTIVE_TIMEOUT_S)
        return self, local

    def bound_waits(self, timeout_s: float) -> None:
        """Rank 0 gives a peer alive but stuck up after `timeout_s` in an exchange (`exchange_timeout_s`: a
        PeerError, the engine stopped as a crash), and its world group's collectives (tensor parallelism's
        all-reduces: they had the world's 1,800 s) after twice that: later than an exchange, whose polling
        must give up first, since NCCL's watchdog aborts the process at the group's timeout (gloo raises)."""
        self.exchange_timeout_s = timeout_s
        comm.bound_world_waits(2 * timeout_s)

    @property
    def ranks(self) -> range:
        return range(1, len(self.processes) + 1)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def check(self) -> None:
        if self.closed:
            raise RuntimeError(f"the {self.label} pipeline is closed")
        if (gone := self.gone()) is not None:
            raise comm.PeerError(gone)

    def gone(self, wait_s: float = 0.0, *, public: bool = False) -> str | None:
        """Why a peer is gone (the first dead one), None while all live: cheap, for health checks. `wait_s`:
        how long to wait for one dying (a failed exchange: its transport closes before it is reaped).
        `public`: as HTTP clients hear it (/health, the 503s): its rank and exit, no pid or log to see (the
        log line, written once, has them)."""
        wait_until(lambda: not all(p.is_alive() for p in self.processes), wait_s)
        for r, p in enumerate(self.processes, 1):
            if not p.is_alive():
                # (a peer killed by a signal wrote nothing: its own log has no reason to point to)
                said = "" if p.exitcode is not None and p.exitcode < 0 else "; see its log above"
                reason = f"{self.label} peer (rank {r}, pid {p.pid}) exited: {exit_reason(p.exitcode)}{said}"
                if r not in self._reported:  # (once: /health asks again and again)
                    self._reported.add(r)
                    log.error("%s", reason)
                return f"{self.label} peer rank {r} exited: {exit_reason(p.exitcode)}" if public else reason
        return None

    def _gone(self, r: int, exc: Exception) -> comm.PeerError:
        code = self.processes[r - 1].exitcode
        if code is None:  # (alive: stuck, or its transport failed)
            return comm.PeerError(f"{self.label} peer (rank {r}) is not answering: {exc}")
        return comm.PeerError(f"{self.label} peer (rank {r}) is gone ({exit_reason(code)}): {exc}")

    def send(self, msg: tuple[object, ...], to: Sequence[int] | None = None) -> None:
        """Pickled `msg` to the ranks `to`, or to every peer (nothing, and no liveness check, for `to=[]`)."""
        if to is not None and not to:
            return
        self.check()
        for r in self.ranks if to is None else to:
            self._sent[r] = time.monotonic()
            try:
                comm.send_object(msg, r, self.group, self.comm_device, self.alive, self.exchange_timeout_s)
            except comm.PeerError as exc:
                raise self._gone(r, exc) from exc

    def send_tensor(self, x: torch.Tensor, to: Sequence[int] | None = None) -> None:
        x = x.to(self.comm_device)
        for r in self.ranks if to is None else to:
            try:
                comm.send_tensor(x, r, self.group, self.alive, self.exchange_timeout_s)
            except comm.PeerError as exc:
                raise self._gone(r, exc) from exc

    def recv_object(self, src: int) -> Any:
        try:
            return comm.recv_object(src, self.group, self.comm_device, self.alive, self.exchange_timeout_s)
        except comm.PeerError as exc:
            raise self._gone(src, exc) from exc

    def recv_tensor(self, out: torch.Tensor, src: int) -> torch.Tensor:
        try:
            return comm.recv_tensor(out, src, self.group, self.alive, self.exchange_timeout_s)
        except comm.PeerError as exc:
            raise self._gone(src, exc) from exc

    def kill(self) -> None:
        """Stop the peers at once, without a word (they may be in the middle of an exchange), and tear the
        process group down: after a failure inside an exchange, when what they wait for is unknown."""
        self.closed = True
        self._stop.set()
        for p in self.processes:
            p.kill()
        for p in self.processes:
            p.join(5)
        comm.destroy_world()

    def close(self, timeout_s: float = 30.0) -> None:
        """("stop",) to the live peers, destroy the process group (every rank tears it down at once, so none
        waits on another), then join them (killed after `timeout_s`)."""
        self._stop.set()
        if self.closed:
            return
        for r, p in enumerate(self.processes, 1):
            if p.is_alive():
                try:
                    comm.send_object(("stop",), r, self.group, self.comm_device, self.alive, timeout_s)
                except comm.PeerError:
                    pass
        self.closed = True
        comm.destroy_world()
        for r, p in enumerate(self.processes, 1):
            p.join(timeout_s)
            if p.is_alive():
                log.warning("%s peer rank %d did not stop within %gs; killing it", self.label, r, timeout_s)
                p.kill()
                p.join(5)


_STARTED: list[tuple[Sequence, int]] = []
"""(peer processes, the rank 0 pid that owns them) of every start: `kill_peers_left`'s."""


def kill_peers_left() -> None:
    """SIGKILL every peer still alive, now: the exit hooks' work (_kill_left), for a rank 0 leaving with
    os._exit, which runs none (cli.console after an abandoned load). Its peers had each found rank 0 gone on
    their own and said so at ERROR, twice, after a mere --init-timeout or Ctrl-C during the load."""
    for procs, owner in _STARTED:
        _kill_left(procs, owner)


def _kill_left(procs: Sequence, owner: int) -> None:
    """At rank 0's exit (before multiprocessing's own exit hook): SIGKILL the peers still alive (not in a
    forked child of rank 0, which runs the hooks too but does not own them)."""
    if os.getpid() != owner:
        return
    for p in procs:
        try:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(5)
        except ValueError:  # (a Process already closed)
            pass


# ---------------------------------------------------------------------------------------------- start-up
def _spawn_peers(
    procs: list, ctx: SpawnContext, pipes: StartupPipes, label: str, target: Callable,
    peer_args: Callable[[int, PeerLink], tuple], world_size: int, init_method: str,
) -> None:  # fmt: skip
    """Spawn `target(*peer_args(rank, link))` for ranks 1..world_size-1, appended to `procs` (the caller's
    list: its clean-up kills what is there, this raising or not), and have them SIGKILLed at rank 0's exit."""
    procs.extend([
        ctx.Process(target=target, name=f"worldserve-{label}-rank{r}", daemon=True,
                    args=peer_args(r, pipes.link(r, init_method)))
        for r in range(1, world_size)
    ])  # fmt: skip
    pipes.spawn(procs)
    # Peers ignore SIGTERM (run_peer), and multiprocessing's exit hook terminates daemon children
    # with SIGTERM then joins them without a timeout: a rank 0 leaving any other way than close() /
    # kill() (Ctrl-C or --init-timeout during the load, an unhandled error) killed them first.
    atexit.register(_kill_left, procs, os.getpid())
    _STARTED.append((procs, os.getpid()))


def _join_world(
    pipes: StartupPipes, label: str, devices: Sequence[torch.device], init_method: str, timeout_s: float,
    store: Any,
) -> ParallelGroup:  # fmt: skip
    """Join the world as rank 0 once every peer says it is joining (a PeerError when one died instead, or
    when the rendezvous fails)."""
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])
    pipes.wait_for("joining", "before joining the world")
    backend = "nccl" if devices[0].type == "cuda" else "gloo"
    try:
        return comm.init_world(backend, init_method, 0, len(devices), timeout_s, JOIN_TIMEOUT_S, store=store)
    except RuntimeError as exc:  # (the rendezvous timed out: a peer died right after saying joining)
        pipes.check("while joining the world")
        raise comm.PeerError(f"{label} ranks could not join the world: {exc}") from exc


def _load_beside_peers(pipes: StartupPipes, load_local: Callable[[], _Local]) -> _Local:
    """`load_local()` here while the peers load theirs, then wait for every peer's ("ready",)."""
    try:
        local = load_local()
    except comm.DistError:  # a collective set-up (new_group) that ran out waiting on a peer that died
        pipes.check("while loading")
        raise
    pipes.wait_for("ready", "while loading")
    return local


# ---------------------------------------------------------------------------------------------- step inputs
def step_plan(states: Sequence) -> list[tuple]:
    """What a peer needs to rebuild these requests' GenItems this step (the tensors follow separately),
    including whether each request runs its uncond branch this step (its guidance interval)."""
    from worldserve.runner.video_state import guided

    return [
        (s.request_id, s.schedule.timesteps[s.step_index].cpu(), float(s.params.fps), tuple(s.clean_frames),
         tuple(s.latents.shape), None if s.sound is None else tuple(s.sound.shape), guided(s))
        for s in states
    ]  # fmt: skip


def send_step(peers: PeerRanks, states: Sequence, to: Sequence[int] | None = None) -> None:
    """("denoise", plan), then each request's latents (+ sound) in plan order, to the ranks `to` (or all)."""
    peers.send(("denoise", step_plan(states)), to)
    for s in states:
        peers.send_tensor(s.latents, to)
        if s.sound is not None:
            peers.send_tensor(s.sound, to)


def recv_step(
    plan: Sequence[tuple], group: ParallelGroup, dev: torch.device, leader_alive: Callable[[], bool]
) -> list[tuple]:
    """A peer's side of send_step: [(request_id, timestep, fps, clean, latents, sound, guided)] in plan order."""
    out = []
    for request_id, timestep, fps, clean, latent_shape, sound_shape, is_guided in plan:
        lat = comm.recv_tensor(
            torch.empty(latent_shape, dtype=torch.float32, device=dev), LEADER, group, leader_alive
        )
        snd = None
        if sound_shape is not None:
            snd = comm.recv_tensor(
                torch.empty(sound_shape, dtype=torch.float32, device=dev), LEADER, group, leader_alive
            )
        out.append((request_id, timestep, fps, clean, lat, snd, is_guided))
    return out


# ---------------------------------------------------------------------------------------------- peer processes
def peer_worker_main(
    rank: int, link: PeerLink, world_size: int, model_path: str, device: str, dtype: torch.dtype,
    kernels: KernelOptions, make_branch: Callable[[torch.device], PeerBranch], label: str,
    tp: ParallelGroup | None = None,
) -> None:  # fmt: skip
    """Entry point of a spawned rank (design.md anti-pattern 10: the process's whole life in one function):
    once in the world, `make_branch(device)` (its collective set-up, with every rank's: a class with
    `load(transformer)` and `handlers(group, device, leader_alive)`: message kind -> callable), load the
    transformer (this rank's tensor-parallel slices with `tp`) with `kernels` on `device` into it and serve
    until ("stop",)."""
    load = functools.partial(_load_branch, model_path, dtype, kernels, make_branch, tp)
    run_peer(rank, link, world_size, device, label, load, functools.partial(_serve_branch, label))


def _load_branch(
    model_path: str,
    dtype: torch.dtype,
    kernels: KernelOptions,
    make_branch: Callable[[torch.device], PeerBranch],
    tp: ParallelGroup | None,
    device: torch.device,
) -> PeerBranch:
    from worldserve.runner.video_pipeline import load_configured_transformer

    branch = make_branch(device)  # first: its process groups, created with every rank's before any loads
    return branch.load(
        load_configured_transformer(Path(model_path), dtype, device, kernels, tp=tp, progress=False)
    )


@torch.inference_mode()
def _serve_branch(
    label: str, branch: PeerBranch, group: ParallelGroup, dev: torch.device, leader_alive: Callable[[], bool]
) -> None:
    serve_messages(group, dev, leader_alive, branch.handlers(group, dev, leader_alive), label)
