"""The LoRA adapters a rank has loaded: checked on request, loaded on first use, the last few kept (LRU).

`check(request)` reads the adapter's headers against the model (weights/lora_adapter.py inspect_adapter; the
API calls it through the backend's `validate` before a job is accepted, so a bad path or an adapter that does
not fit is a 400 naming `lora`). `get(request)` returns the adapter's LoraWeights on the model's device at
the request's scale (this rank's tensor-parallel slices), loading it unless one of the last `max_loaded`
adapter / scale pairs is it; None for no adapter or a scale of 0 (the base model). An adapter whose file
changed since it was loaded (size or modification time) is read again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from worldserve.models.layers.lora import LoraWeights
from worldserve.params import LoraRequest
from worldserve.weights.lora_adapter import AdapterSpec, inspect_adapter, load_adapter

log = logging.getLogger(__name__)

DEFAULT_MAX_LOADED = 4
"""Adapters kept on the device between requests (vLLM's --max-cpu-loras; a rank-64 adapter of every linear of
Cosmos3-Nano's layers takes ~1 GB in bf16 here, the block-diagonal B of fused q|k|v and gate|up included)."""


class LoraCache:
    """One rank's adapters for `transformer` (its config, dtype, device and tensor-parallel group)."""

    def __init__(self, transformer, max_loaded: int = DEFAULT_MAX_LOADED) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.transformer = transformer
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[tuple, LoraWeights] = OrderedDict()
        self._lock = threading.Lock()  # (the API's validate and the engine thread's prepare may overlap)

    def check(self, request: LoraRequest) -> AdapterSpec:
        """The adapter's files checked against the model (headers only); ParamError naming `lora`."""
        return inspect_adapter(request.validate().path, self.transformer.config)

    def get(self, request: LoraRequest | None) -> LoraWeights | None:
        """The request's adapter on the device (None: the base model), loaded or taken from the cache."""
        if request is None or not request.active:
            return None
        spec = self.check(request)
        key = (spec.identity, float(request.scale))
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
                return self._loaded[key]
        t = self.transformer
        weights = load_adapter(spec, request.scale, t.config, dtype=t.dtype, device=t.device, tp=t.tp)
        log.info("LoRA adapter %r loaded from %s (%d modules, %.1f MB, scale %g)", request.name, request.path,
                 len(spec.modules), weights.nbytes / 2**20, request.scale)  # fmt: skip
        with self._lock:
            self._loaded[key] = weights
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)  # (a request still holding it keeps its tensors alive)
        return weights
