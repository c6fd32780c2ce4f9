"""The offline Engine's model load bounded by `init_timeout`, as `worldserve serve` bounds its own: the same
commands/bounded_load.py (serve_backend.load_backend on a loader thread, the caller waiting at most
`init_timeout` seconds; an abandoned load's backend closed when it ends). Unlike serve, which logs and leaves,
the caller gets the error: a LoadTimeout (a TimeoutError) naming `init_timeout`, or the load's own.
"""

from __future__ import annotations

from typing import Any

from worldserve.config import EngineConfig


def load_within(config: EngineConfig) -> tuple[Any, ...]:
    """load_backend's tuple for `config` (resolved), within `config.model.init_timeout` seconds."""
    from worldserve.commands.bounded_load import LoadTimeout, bounded_load
    from worldserve.commands.serve_backend import load_backend, release_loaded

    def load() -> tuple[Any, ...]:
        return load_backend(config.model, config.parallel, config.scheduler, config.reasoner, config.lora)

    timeout_s = config.model.init_timeout
    try:
        return bounded_load(load, timeout_s, thread_name="worldserve-offline-load", release=release_loaded)
    except LoadTimeout:
        raise LoadTimeout(
            f"the model did not load within init_timeout={timeout_s:g} s (raise it for a cold cache or a large "
            "checkpoint)"
        ) from None
