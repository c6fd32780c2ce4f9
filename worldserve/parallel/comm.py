"""Collectives and point-to-point messages: the only module that calls torch.distributed.

Every collective is the identity when the group has one rank, so single-device code pays nothing and
tests can fake a world by handing in a group whose `size` is 1.
Point-to-point (`send_tensor` / `recv_tensor` / `send_object` / `recv_object`, used by CFG-parallel) raises
`PeerError` rather than hanging when the peer dies: NCCL isend / irecv are polled with an `alive()` check;
gloo's only complete inside wait(), which raises once a dead peer's socket closes. Rank 0's exchanges also
give up on a peer that is alive but stuck (`timeout_s`). NCCL needs tensors on the
rank's GPU (`device`); gloo takes CPU tensors. `init_world` joins through a TCPStore of its own, so rank 0
can bound the rendezvous apart from the world's (long) timeout; `host_store` binds rank 0's before its peers
start (no free-port race).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor
from torch.distributed import DistError  # noqa: F401  (re-exported: a wait that ran out)

from worldserve.parallel.groups import ParallelGroup

_POLL_S = 0.0005


class PeerError(RuntimeError):
    """The peer rank exited or its connection broke while we waited on it."""


def all_reduce(x: Tensor, group: ParallelGroup) -> Tensor:
    """Sum `x` over the ranks of `group` (in place) and return it."""
    if group.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=group.group)
    return x


def all_gather_rows(x: Tensor, group: ParallelGroup) -> Tensor:
    """Every rank's `x` (the same shape on each), concatenated along dim 0 in rank order, on every rank."""
    if group.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts)


def all_to_all_blocks(send: Tensor, group: ParallelGroup) -> Tensor:
    """[P, ...] blocks: block j of `send` goes to rank j; block j of the result came from rank j."""
    if group.size == 1:
        return send
    import torch.distributed as dist

    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group.group)
    return recv


def new_group(ranks: list[int], setup_timeout_s: float, timeout_s: float) -> Any:
    """A process group of `ranks` (collective: every rank of the world calls it, with the same ranks, in
    the same order), created within `setup_timeout_s`; its collectives then wait `timeout_s` (torch >= 2.6;
    older versions keep the setup's)."""
    import torch.distributed as dist

    group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=setup_timeout_s))
    if hasattr(group, "set_timeout"):
        group.set_timeout(timedelta(seconds=timeout_s))
    return group


def bound_world_waits(timeout_s: float) -> None:
    """This process's waits on the world group (tensor-parallel all-reduces, a step's messages) give up after
    `timeout_s` from now on (the world was made with the long start-up timeout that model loading needs)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if dist.is_initialized():
        _set_pg_timeout(timedelta(seconds=timeout_s))


# ---------------------------------------------------------------------------------------------- world
def host_store(world_size: int, timeout_s: float) -> tuple[Any, str]:
    """Rank 0's TCPStore, bound now on a port the OS picks -> (store, its init_method "tcp://127.0.0.1:PORT").
    Bind it before the peers start and hand both to `init_world`: a port found free, closed and bound seconds
    later (after the peers' spawn) could be another process's by then (another server's or test's store, which
    the peers would join)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, f"tcp://127.0.0.1:{store.port}"


def init_world(
    backend: str, init_method: str, rank: int, world_size: int, timeout_s: float,
    join_timeout_s: float | None = None, store: Any = None,
) -> ParallelGroup:  # fmt: skip
    """torch.distributed.init_process_group (the default group) over a TCPStore at `init_method`
    ("tcp://host:port", hosted by rank 0: the `store` that `host_store` bound, which rank 0 passes) -> its
    ParallelGroup. Every rank of the world must join through here (the same store layout). `join_timeout_s`
    bounds the rendezvous alone (rank 0's wait for every other rank to join, or a rank's wait for rank 0's
    store), `timeout_s` (default for it) everything after."""
    import torch.distributed as dist

    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    join = timedelta(seconds=timeout_s if join_timeout_s is None else min(join_timeout_s, timeout_s))
    if rank != 0:
        store = dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=join)
        store.set(f"worldserve/joined/{rank}", "1")
    else:
        if store is None:
            raise ValueError("rank 0 joins through the store host_store bound (pass store=)")
        joined = [f"worldserve/joined/{r}" for r in range(1, world_size)]
        try:
            store.wait(joined, join)
        except DistError as exc:
            missing = world_size - 1 - sum(store.check([k]) for k in joined)
            raise RuntimeError(
                f"timed out after {join.total_seconds():g} s waiting for clients: {missing} of the "
                f"{world_size - 1} other ranks did not join the world"
            ) from exc
    store.set_timeout(timedelta(seconds=timeout_s))  # later waits on it (new_group, NCCL ids) may be long
    dist.init_process_group(
        backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    return ParallelGroup(rank=rank, size=world_size, group=None)


def destroy_world() -> None:
    """Tear the default process group down (no-op when none)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def world_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


# ---------------------------------------------------------------------------------------------- p2p
def _wait(
    start: Callable[[], Any], alive: Callable[[], bool] | None, what: str, timeout_s: float | None = None
) -> None:
    """Start the work (`start()`: gloo raises there too once a peer's connection is closed) and poll it until
    done; PeerError if `alive()` turns False, the transport fails, or (`timeout_s`) the peer, alive but stuck,
    has not answered within that many seconds."""
    import torch.distributed as dist

    t0 = time.monotonic()
    try:
        work = start()
        if alive is None or dist.get_backend() != "nccl":
            # gloo's p2p work only completes inside wait(); a dead peer's closed socket makes it raise
            work.wait() if timeout_s is None else work.wait(timedelta(seconds=timeout_s))
            return
        while not work.is_completed():
            if not alive():
                raise PeerError(f"peer exited while we waited to {what}")
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise PeerError(f"could not {what}: no answer within {timeout_s:g} s (the peer is stuck)")
            time.sleep(_POLL_S)
        work.wait()
    except PeerError:
        raise
    except RuntimeError as exc:  # gloo: "Connection closed by peer" or its wait's timeout, NCCL: aborted
        if timeout_s is not None and time.monotonic() - t0 >= timeout_s:
            raise PeerError(
                f"could not {what}: no answer within {timeout_s:g} s (the peer is stuck)"
            ) from exc
        raise PeerError(f"could not {what}: {exc}") from exc


def send_tensor(
    x: Tensor, dst: int, group: ParallelGroup, alive: Callable[[], bool] | None = None,
    timeout_s: float | None = None,
) -> None:  # fmt: skip
    """Send `x` to `dst` (`alive`, `timeout_s`: as `_wait`'s)."""
    import torch.distributed as dist

    if alive is not None and not alive():
        raise PeerError(f"peer rank {dst} has exited")
    x = x.contiguous()
    _wait(lambda: dist.isend(x, dst, group=group.group), alive, f"send to rank {dst}", timeout_s)


def recv_tensor(
    out: Tensor, src: int, group: ParallelGroup, alive: Callable[[], bool] | None = None,
    timeout_s: float | None = None,
) -> Tensor:  # fmt: skip
    """Receive into `out` (its shape, dtype and device must match the sender's tensor) and return it."""
    import torch.distributed as dist

    _wait(lambda: dist.irecv(out, src, group=group.group), alive, f"receive from rank {src}", timeout_s)
    return out


def send_object(
    obj: Any, dst: int, group: ParallelGroup, device: torch.device,
    alive: Callable[[], bool] | None = None, timeout_s: float | None = None,
) -> None:  # fmt: skip
    """Pickle `obj` and send it (length first, then bytes) to `dst`."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    send_tensor(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst, group, alive, timeout_s)
    send_tensor(data, dst, group, alive, timeout_s)


def recv_object(
    src: int, group: ParallelGroup, device: torch.device, alive: Callable[[], bool] | None = None,
    timeout_s: float | None = None,
) -> Any:  # fmt: skip
    """The object `send_object` sent from `src`."""
    size = recv_tensor(torch.empty(1, dtype=torch.int64, device=device), src, group, alive, timeout_s)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)  # [size] the pickled bytes
    return pickle.loads(recv_tensor(data, src, group, alive, timeout_s).cpu().numpy().tobytes())
