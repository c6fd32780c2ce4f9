"""The jobs a restart finds unfinished, restored to run again (EngineClient.start).

`restored_jobs(store, ...)` goes through the store's `recover()` (in-progress jobs queued again, or failed
after too many interruptions) and yields each unfinished job's (id, params, encode options), rebuilt from its
persisted inputs and validated again against the model now served: the server may have restarted with
another checkpoint or without a Reasoner. A job that cannot run again fails at once with the reason (its
reference file is gone: 500; the model now served does not take it: 400, naming the field), counted as a
failed request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from worldserve.engine.job_files import inputs_from_record
from worldserve.engine.jobs import JobStore
from worldserve.engine.observer import EngineObserver
from worldserve.engine.request import EncodeOptions
from worldserve.params import ParamError, VideoParams

log = logging.getLogger(__name__)
INTERRUPTED = "The job was interrupted by a restart and"


def restored_jobs(
    store: JobStore,
    ttl_s: float | None,
    validate: Callable[[VideoParams], VideoParams],
    observer: EngineObserver,
) -> Iterator[tuple[str, VideoParams, EncodeOptions]]:
    """(job id, params, encode options) of every unfinished job that can run again, oldest first."""

    def fail(job_id: str, message: str, code: int = 500, param: str | None = None) -> None:
        log.warning("job %s: %s", job_id, message)
        if store.fail(job_id, code, message, completed_at=time.time(), ttl_s=ttl_s, param=param):
            observer.on_failed(code)

    for job_id in store.recover(ttl_s=ttl_s, on_failed=observer.on_failed):
        try:
            record, reference = store.load_inputs(job_id)
            params, encode = inputs_from_record(record, reference)
        except FileNotFoundError:
            fail(
                job_id,
                f"{INTERRUPTED} its uploaded reference (image or video) is missing from the storage folder; submit it again.",
            )
            continue
        except Exception as exc:
            fail(job_id, f"{INTERRUPTED} could not be restored: {exc}")
            continue
        try:
            params = validate(params)
        except ParamError as exc:
            fail(
                job_id,
                f"{INTERRUPTED} the model now served does not take it ({exc.param}): {exc.message}",
                400,
                exc.param,
            )
            continue
        yield job_id, params, encode
