"""A model load the caller waits on for at most a timeout (serve's --init-timeout, the offline Engine's
`init_timeout`): the load runs on a daemon thread; past the timeout, or on an interrupt while waiting, the caller
stops waiting at once and the load still running is abandoned: when it ends, what it loaded is handed to
`release` (a multi-GPU pipeline's peer processes closed) and dropped. Python cannot stop a thread, and a load
blocked in a download or a CUDA call may never end: the caller decides what to do next (serve leaves the
process; the Engine's caller gets the LoadTimeout)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from worldserve.weights.load_lock import is_waiting

_Loaded = TypeVar("_Loaded")


class LoadTimeout(TimeoutError):
    """The load did not end within its timeout (a TimeoutError of the load's own, e.g. a network read's,
    is raised as itself)."""


def bounded_load(
    load: Callable[[], _Loaded], timeout_s: float, *, thread_name: str, release: Callable[[_Loaded], Any]
) -> _Loaded:
    """load()'s value, waited for at most `timeout_s` seconds. LoadTimeout past it; load's own error raised
    here; an interrupt while waiting raised at once. Abandoned (either of the first and the last), a value
    that comes later goes to `release`."""
    outcome: dict[str, Any] = {}
    lock = threading.Lock()

    def target() -> None:
        try:
            value = load()
        except BaseException as exc:
            with lock:
                outcome.setdefault("error", exc)
            return
        with lock:
            abandoned = "abandoned" in outcome
            outcome.setdefault("value", value)
        if abandoned:
            release(value)

    loader = threading.Thread(target=target, name=thread_name, daemon=True)
    loader.start()
    try:
        loader.join(timeout_s)
    finally:
        with lock:
            done = "value" in outcome or "error" in outcome
            if not done:
                outcome["abandoned"] = True
    if not done:
        why = (
            " (it waited all along for an earlier load in this process to end)" if is_waiting(loader) else ""
        )
        raise LoadTimeout(f"the model did not load within {timeout_s:g} s{why}")
    if "error" in outcome:
        raise outcome["error"]
    loaded: _Loaded = outcome["value"]
    return loaded
