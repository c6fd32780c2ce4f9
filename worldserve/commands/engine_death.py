"""Engine death ends `worldserve serve`, as vLLM's launcher ends `vllm serve` (its engine-dead handlers and its
watchdog set uvicorn's should_exit, serving-api.md §3.2 / §6.2).

The engine is dead when nothing in this process can serve again (EngineClient.death): the video engine's loop
crashed (a bug, or a lost peer rank mid-step: BackendLost), the Reasoner's chat worker stopped (a bug of its
loop), or a parallel backend lost a peer rank while it idled (its `problem`). `EngineDeathWatch.check` runs at
every tick of uvicorn's main loop (GracefulServer.on_tick: every 0.1 s, reads of the client's state, and the
peers' liveness), logs the reason once and says whether the server should stop: it then stops as on SIGTERM
(intake stops, running requests get --shutdown-timeout to finish and their callers their 503s, unfinished jobs
stay queued for the next start) and `worldserve serve` exits with status 1, so a supervisor restarts it
(systemd's Restart=on-failure, a container's restart policy). vLLM exits 0 there (vllm-project/vllm#48966,
open; #52178 proposes the 1 kept here, a later SIGTERM not clearing it). VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1
(vLLM's) keeps the server up instead, /health answering 503 with the reason, as before; a SIGTERM then exits 0.
A death during a shutdown already under way changes nothing (the signal's exit status stays).
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("worldserve.serve")

ENGINE_DEATH_EXIT_STATUS = 1
"""`worldserve serve`'s exit status once an engine death stopped it."""


class DeathReporter(Protocol):
    def death(self) -> str | None:
        """Why nothing in this process can serve again (EngineClient.death), None while it can."""
        ...


class EngineDeathWatch:
    """Whether an engine death should stop the server (`check`) and, once one has, its reason (`reason`)."""

    def __init__(self, client: DeathReporter, *, keep_alive: bool):
        self._client = client
        self._keep_alive = keep_alive
        self.seen: str | None = None
        """The death found (and logged), None while none is."""
        self.reason: str | None = None
        """The death that stopped the server (None: none did, or VLLM_KEEP_ALIVE_ON_ENGINE_DEATH kept it up)."""

    @property
    def exit_status(self) -> int:
        return ENGINE_DEATH_EXIT_STATUS if self.reason is not None else 0

    def check(self) -> bool:
        """True once, when the engine is found dead and the server is to stop; the death is logged once."""
        if self.seen is not None:
            return False
        reason = self.seen = self._client.death()
        if reason is None:
            return False
        if self._keep_alive:
            log.error("the engine is dead (%s); VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set: the server stays up, "
                      "answering 503 until it is restarted", reason)  # fmt: skip
            return False
        self.reason = reason
        log.error("the engine is dead (%s): the server shuts down, as on SIGTERM (unfinished jobs stay queued "
                  "for the next start), and exits with status %d; VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it up",
                  reason, ENGINE_DEATH_EXIT_STATUS)  # fmt: skip
        return True
