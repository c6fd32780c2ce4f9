"""Why the engine client takes no more work or a request ends early: the exceptions the API answers with 429,
503 or 400, and the JobError (code, message, field) a failed job records (`error_for`)."""

from __future__ import annotations

from typing import NamedTuple

from worldserve.params import ParamError


class QueueFullError(Exception):
    """More than `max_queued_requests` jobs wait for admission (HTTP 429)."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the request queue is full; retry in about {retry_after_s}s")
        self.retry_after_s = retry_after_s


class ShuttingDownError(Exception):
    """The server is stopping and takes no new work (HTTP 503)."""


class ChatUnavailableError(Exception):
    """This server has no chat backend (e.g. the fake backend)."""


SHUTDOWN_REASON = "the server is shutting down"


class CancelledRequest(Exception):
    """An ephemeral request was aborted, or the engine stopped (`reason`: SHUTDOWN_REASON) before it
    finished (503 for its caller)."""

    status_code = 503

    def __init__(self, request_id: str, reason: str | None = None):
        super().__init__(
            f"request {request_id} was cancelled " + (f"({reason})" if reason else "before it finished")
        )


class JobError(NamedTuple):
    """What a failed request records and answers: an HTTP-like code, the message, the field at fault."""

    code: int
    message: str
    param: str | None = None


def error_for(exc: BaseException, what: str = "Video generation") -> JobError:
    """The JobError of a request that raised `exc` (`what` failed: ...; a ParamError names its field)."""
    if isinstance(exc, ParamError):
        return JobError(400, exc.message, exc.param)
    code = getattr(exc, "status_code", 500)
    return JobError(code if isinstance(code, int) and 400 <= code < 600 else 500, f"{what} failed: {exc}")
