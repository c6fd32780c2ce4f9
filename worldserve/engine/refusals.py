"""Why the engine client takes no more work: the exceptions the API answers with 429, 503 or 400."""

from __future__ import annotations


class QueueFullError(Exception):
    """More than `max_queued_requests` jobs wait for admission (HTTP 429)."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the request queue is full; retry in about {retry_after_s}s")
        self.retry_after_s = retry_after_s


class ShuttingDownError(Exception):
    """The server is stopping and takes no new work (HTTP 503)."""


class ChatUnavailableError(Exception):
    """This server has no chat backend (e.g. the fake backend)."""
