"""Dynamo's graph limits for the compiled parts of the model (the gen layers' math, the VAE decoder's blocks).

They compile with static shapes: one graph per shape. Dynamo keeps at most `recompile_limit` graphs per guard
set (default 8) and `accumulated_recompile_limit` per function (256); past either, that function runs eagerly
for the rest of the process without a word (the gen layers 1.13x slower). A video server meets many shapes
(resolutions, frame counts, CFG on or off, batch mixes; the VAE 8-24 graphs a size), so both are raised to
`COMPILED_SHAPES_LIMIT`; a new shape's compile is paid once either way.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager

COMPILED_SHAPES_LIMIT = 4096
"""Graphs a compiled function may keep before dynamo falls back to eager."""


def raise_recompile_limits(n: int = COMPILED_SHAPES_LIMIT) -> None:
    """Raise both limits to at least `n`, for this thread: process-wide up to torch 2.11, but from torch 2.12 a
    config value set is the setting thread's own (a ContextVar), so the threads that run compiled code call
    `limits_in_this_thread` as they start."""
    import torch._dynamo  # here, not at import: dynamo takes ~2 s to import, and an eager process never needs it

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, n)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, n)


def recompile_limits(n: int = COMPILED_SHAPES_LIMIT) -> AbstractContextManager[object]:
    """Both limits at least `n` inside a `with` block (the VAE decode), as they were outside it."""
    import torch._dynamo

    cfg = torch._dynamo.config
    return cfg.patch(
        recompile_limit=max(n, cfg.recompile_limit),
        accumulated_recompile_limit=max(n, cfg.accumulated_recompile_limit),
    )


def limits_in_this_thread() -> None:
    """`raise_recompile_limits` in a thread that runs compiled code (the engine's, the chat worker's), once
    anything compiled in this process (dynamo imported: an eager process does not pay its ~2 s import).
    Without it, on torch >= 2.12 such a thread kept dynamo's 8 graphs and then ran eagerly without a word."""
    if "torch._dynamo" in sys.modules:
        raise_recompile_limits()
