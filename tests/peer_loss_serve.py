"""`worldserve serve --backend fake` whose fake backend can lose its peer ranks as a parallel backend does (run
as a subprocess by tests/test_engine_death.py; not a test module). In the folder named by
WORLDSERVE_TEST_FAULTS: a file `lost` makes the next denoise step raise BackendLost (a peer gone mid-step: the
engine loop stops as on a crash, its jobs queued again), a file `gone` makes `problem()` report a peer gone
(one dying while the engine idles). Only the model's edge is replaced: the server is the real one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from worldserve.engine import fake_backend
from worldserve.engine.outputs import BackendLost

FAULTS = Path(os.environ["WORLDSERVE_TEST_FAULTS"])


class PeerLosingBackend(fake_backend.FakeBackend):
    def problem(self) -> str | None:
        return "fake peer (rank 1, pid 0) exited: killed (test)" if (FAULTS / "gone").exists() else None

    def denoise(self, states: Sequence[fake_backend.FakeState]) -> None:
        if (FAULTS / "lost").exists():
            raise BackendLost("fake peer (rank 1) exited mid-step (test)", "the peer ranks are gone (test)")
        super().denoise(states)


if __name__ == "__main__":
    # (`--backend fake` imports FakeBackend from its module when the server loads it)
    fake_backend.FakeBackend = PeerLosingBackend  # type: ignore[misc]
    from worldserve.cli import main

    sys.exit(main(sys.argv[1:]))
