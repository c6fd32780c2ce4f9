"""The offline Engine's model load bounded by `init_timeout`, as `worldserve serve` bounds its own
(commands/serve_backend.py `load_backend_within`): serve_backend.load_backend runs on a loader thread and the
caller waits at most `init_timeout` seconds for it. Past that (or on an interrupt while waiting) the caller gets
a TimeoutError (or the interrupt) at once; the load still running is abandoned: when it ends, what it loaded is
closed (a multi-GPU pipeline's peer processes) and dropped. A load that fails raises its own error here.
"""

from __future__ import annotations

import threading
from typing import Any

from worldserve.config import EngineConfig


def load_within(config: EngineConfig) -> tuple[Any, ...]:
    """load_backend's tuple for `config` (resolved), within `config.model.init_timeout` seconds."""
    from worldserve.commands.serve_backend import load_backend

    outcome: dict[str, Any] = {}
    lock = threading.Lock()

    def target() -> None:
        try:
            value = load_backend(
                config.model, config.parallel, config.scheduler, config.reasoner, config.lora
            )
        except BaseException as exc:
            outcome.setdefault("error", exc)
            return
        with lock:
            abandoned = "abandoned" in outcome
            outcome.setdefault("value", value)
        if abandoned and hasattr(value[0], "close"):
            value[0].close()

    loader = threading.Thread(target=target, name="worldserve-offline-load", daemon=True)
    loader.start()
    try:
        loader.join(config.model.init_timeout)
    finally:
        with lock:
            done = "value" in outcome or "error" in outcome
            if not done:
                outcome["abandoned"] = True
    if not done:
        raise TimeoutError(
            f"the model did not load within init_timeout={config.model.init_timeout:g} s "
            "(raise it for a cold cache or a large checkpoint)"
        )
    if "error" in outcome:
        raise outcome["error"]
    value: tuple[Any, ...] = outcome["value"]
    return value
