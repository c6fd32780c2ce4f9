"""Model loads in one process take turns (`model_loads`).

diffusers' `from_pretrained` builds its model inside accelerate's `init_empty_weights`, which patches
`nn.Module.register_parameter` for the whole process, not for its own thread: while it runs, a module that any
other thread builds gets its parameters on the meta device, and that load fails later ("Cannot copy out of meta
tensor"). It happened to an Engine retried after a Ctrl-C or a LoadTimeout while the abandoned load still ran on
its thread (commands/bounded_load.py), and to two threads building Engines at once. So every load holds this
process-wide lock: a retry waits for the abandoned load to end (its time counts against the retry's own
timeout) and then loads; two Engines built at once load one after the other. The lock is re-entrant: a whole
load (serve_backend.load_backend) takes it, and so do the component loads inside it, which users may also call
on their own (VideoPipeline.from_pretrained, Reasoner.from_pretrained, diffusers components).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("worldserve.load")

_LOCK = threading.RLock()
_waiting: set[int] = set()
"""Idents of the threads waiting for the lock (read by bounded_load to say why a load timed out)."""
_waiting_guard = threading.Lock()


@contextmanager
def model_loads(what: str) -> Iterator[None]:
    """Hold the process's model-load lock around a load of `what` (waiting, with one log line, while another
    thread's load holds it)."""
    if not _LOCK.acquire(blocking=False):
        log.info("%s waits for another model load in this process to end first", what)
        me = threading.get_ident()
        with _waiting_guard:
            _waiting.add(me)
        try:
            _LOCK.acquire()
        finally:
            with _waiting_guard:
                _waiting.discard(me)
    try:
        yield
    finally:
        _LOCK.release()


def is_waiting(thread: threading.Thread) -> bool:
    """Whether `thread` is waiting for another load to end (not loading yet)."""
    with _waiting_guard:
        return thread.ident in _waiting
