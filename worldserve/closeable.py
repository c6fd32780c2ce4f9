"""`Closeable`: what a `with` block does for the objects a Python user holds that own processes, threads or
files (VideoPipeline, ParallelPipeline, the offline Engine): entering gives the object, leaving calls its
`close()`, whatever ended the block (contextlib.closing's rule, as a base class)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import TracebackType


class Closeable(AbstractContextManager):
    """A base whose subclasses define `close()` (idempotent); `with obj:` closes it on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
