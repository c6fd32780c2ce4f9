"""CUDA graph capture shared by the Reasoner's decode step (und_decoder.py) and its prefill pieces
(prefill_graphs.py).

`GraphCapture(device)`: one memory pool and one warm-up side stream for all of an owner's graphs.
`capture(fns)` runs the functions, in order, twice on the side stream (torch.compile's compiles, cuBLAS
workspaces), then captures each into a graph of its own in the shared pool: [(graph, the function's output)].
One side stream for every capture: memory the caching allocator keeps for a stream serves that stream only, so
a stream per capture would strand each warm-up's activations (GBs for the prefill's buckets on Nano).
Captures use capture_error_mode "thread_local": CUDA calls of other threads (e.g. the keep-alive pings of a
multi-GPU pipeline's peers, runner/peers.py, sent from a thread of their own) neither break a capture nor
fail themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class GraphCapture:
    """A pool and a warm-up stream; `capture` warms functions up and captures them (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._side: torch.cuda.Stream | None = None

    def capture(self, fns: Sequence[Callable[[], Any]]) -> list[tuple[torch.cuda.CUDAGraph, Any]]:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            for _ in range(2):
                for fn in fns:
                    fn()
        torch.cuda.current_stream().wait_stream(self._side)
        out = []
        for fn in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                result = fn()
            out.append((graph, result))
        return out
