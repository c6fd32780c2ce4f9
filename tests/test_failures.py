"""failures.release_frames: a kept exception lets its frames' locals go, along its cause / context chain,
and keeps its lines and message."""

from __future__ import annotations

import gc
import traceback
import weakref

from worldserve.failures import release_frames


class Held:
    pass


def _fail_inner(refs: list) -> None:
    state = Held()  # (a failed step's latents)
    refs.append(weakref.ref(state))
    raise RuntimeError("out of memory")


def _fail_outer(refs: list) -> None:
    outer = Held()
    refs.append(weakref.ref(outer))
    try:
        _fail_inner(refs)
    except RuntimeError as exc:
        raise ValueError("the step failed") from exc


def test_the_chain_s_frames_let_their_locals_go_and_keep_their_lines():
    refs: list = []
    try:
        _fail_outer(refs)
    except ValueError as exc:
        kept = exc
    kept.__cause__.__context__ = kept  # (a loop in the chain is walked once)
    release_frames(kept)
    gc.collect()
    assert [r() for r in refs] == [None, None]
    lines = "".join(traceback.format_exception(kept.__cause__))
    assert "_fail_inner" in lines and "out of memory" in lines
    release_frames(None)
