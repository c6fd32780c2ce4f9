"""One denoising step of a batch of video requests, a failure kept to the request it belongs to.

`step_batch` calls `backend.denoise` once over the batch: on the common path that one call is all it does.
When the call raises (anything but BackendLost, which stops the engine) and the batch has more than one
member, each member is told apart by its `step_index`, which a backend advances last, once that state's
update is whole (FakeBackend; VideoPipeline.combine_and_step):
- advanced by one: its update landed before the failure (the real pipeline steps the states in order
  after one batched forward): it counts as stepped;
- not advanced: the call wrote nothing into it (the forward, where out of memory strikes, only reads the
  states), so it steps again alone, and fails only if it fails alone, with its own error. A state the
  backend left half updated (its video stepped, its sound not) is caught by its solver, which expects its
  next step (sampling/flow.py unipc_step), and that request fails alone, rather than stepping twice;
- if every member had advanced, the error came after all the updates: it is the call's, not one member's,
  and fails them all, as it fails a batch of one.
Before the retries the failed call's traceback lets its frames' locals go (the forward's activations, which
the retries need the memory of) and the backend gives back what it can (its optional `free_cached_memory`:
on CUDA, the caching allocator's free blocks). The chat path does the same for its prefill
(runner/chat_admission.py _prefill_each). Runs on the engine thread; each backend call under `lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from worldserve.engine.outputs import BackendLost, VideoBackend
from worldserve.engine.request import Request
from worldserve.failures import release_frames

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchStep:
    """What one step of a batch came to."""

    stepped: list[tuple[Request, float]] = field(default_factory=list)
    """The requests advanced by one step (those a failed call advanced, then those stepped alone, each in batch
    order), each with the seconds its step took (a failed batch call's time included)."""
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    """The requests whose step failed, each with its own error."""
    calls: list[tuple[float, int]] = field(default_factory=list)
    """(seconds, requests) of each denoise call that succeeded (the engine's step metrics)."""
    too_large: bool = False
    """The batch call failed and every member it left untouched then stepped alone: the failure was the
    batch's size (out of memory at it), not a member's (the engine steps this shape in smaller batches)."""


def step_batch(backend: VideoBackend, batch: Sequence[Request], lock: threading.Lock) -> BatchStep:
    """Advance every request of `batch` (prepared, one batch key) by one step: together, or, when that call
    fails, each alone that the failure left untouched (module docstring). Raises BackendLost."""
    before = [request.steps_done for request in batch]
    t0 = time.monotonic()
    try:
        with lock:
            backend.denoise([request.prepared for request in batch])
    except BackendLost:
        # (not the batch's fault: the loop crashes and its jobs are queued again)
        raise
    except Exception as exc:
        failure = exc
    else:
        seconds = time.monotonic() - t0
        return BatchStep(stepped=[(request, seconds) for request in batch], calls=[(seconds, len(batch))])
    return _isolate(backend, batch, before, failure, time.monotonic() - t0, lock)


def _isolate(
    backend: VideoBackend, batch: Sequence[Request], before: list[int], failure: Exception, failed_s: float,
    lock: threading.Lock,
) -> BatchStep:  # fmt: skip
    """After the batch call failed with `failure` (taking `failed_s`): the members it advanced count as
    stepped, the ones it left untouched step again alone."""
    outcome = BatchStep()
    advanced = [request.steps_done == done + 1 for request, done in zip(batch, before, strict=True)]
    untouched = [request.steps_done == done for request, done in zip(batch, before, strict=True)]
    if len(batch) == 1 or all(advanced):
        outcome.failed = [(request, failure) for request in batch]
        return outcome
    log.warning("a denoising step of %d requests failed (%r): each request it left as it was steps alone",
                len(batch), failure, exc_info=failure)  # fmt: skip
    for request, was_advanced, was_untouched in zip(batch, advanced, untouched, strict=True):
        if was_advanced:
            outcome.stepped.append((request, failed_s))
        elif not was_untouched:
            # (a backend that moved it by more than a step: nothing to resume it from)
            outcome.failed.append((request, failure))
    # its traceback's frames hold the failed forward's activations, which the retries need the memory of
    release_frames(failure)
    free = getattr(backend, "free_cached_memory", None)
    if free is not None:
        free()
    for request in (r for r, was_untouched in zip(batch, untouched, strict=True) if was_untouched):
        t0 = time.monotonic()
        try:
            with lock:
                backend.denoise([request.prepared])
        except BackendLost:
            raise
        except Exception as exc:
            outcome.failed.append((request, exc))
            continue
        seconds = time.monotonic() - t0
        outcome.calls.append((seconds, 1))
        outcome.stepped.append((request, failed_s + seconds))
    outcome.too_large = not outcome.failed
    return outcome
