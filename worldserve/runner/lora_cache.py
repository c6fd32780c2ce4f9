"""The LoRA adapters a rank has loaded: checked on request, read once, the last few kept in host memory (LRU),
on the device only while requests run with them.

`check(request)` reads the adapter's headers against the model (weights/lora_adapter.py inspect_adapter; the
API calls it through the backend's `validate` before a job is accepted, so a bad path, an adapter that does
not fit, or one with a module above `max_rank` (serve's --max-lora-rank) is a 400 naming `lora`), at a scale
of 0 too: that request runs the base model, but an adapter reference that is wrong is a bad input whatever
its scale (as diffusers' `set_adapters` refuses an adapter it does not hold at weight 0, and as --lora-path
is checked at --lora-scale 0; vLLM-Omni's diffusion LoRA manager skips a scale-0 adapter unchecked). The
server's own adapter (--lora-path, which the API gives the requests that name none) is checked once, at the
start (`load_static`): at scale 0 its requests read no files, so an adapter removed after the start does not
turn every plain request into a 400 naming `lora` its caller never sent; only request-named ones are checked.
`max_rank` is given when the cache is made, on every rank alike (rank 0's VideoPipeline and each peer's
BranchRank take it from the same --max-lora-rank), so a peer that reads an adapter checks the bound rank 0
checked.
`get(request)` returns the adapter's LoraWeights on the model's device at the request's scale (this rank's
tensor-parallel slices), or None for no adapter or a scale of 0 (the base model: no weights are read). The
last `max_loaded` adapter / scale pairs read stay in host memory (pinned on a CUDA machine:
vLLM's --max-cpu-loras), so a request of one of them copies it to the device (~40 ms for 1 GB) rather than
reading its files again; the device copy is shared by the requests running with it and freed once the last
of them releases it (GPU memory holds only adapters in use). An adapter whose files changed since it was read
(weights/lora_adapter.py `_identity`) is read again.

A server whose one adapter is --lora-path's (no --enable-lora) merges its gen-pathway deltas into the weights
at load (`merge_lora`, through KernelOptions.merged_lora on every rank), each output row when rounding
changes no more than a trace of its delta (MERGE_ERASURE_LIMIT): the cache then answers that adapter's
requests with what stays unmerged (its und tower deltas, the rows left out), reads no files for them, and
refuses any other adapter (the gen weights are no longer the base model's).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from worldserve.models.layers.lora import LoraWeights
from worldserve.params import LoraRequest, ParamError
from worldserve.weights.lora_adapter import AdapterSpec, inspect_adapter, load_adapter

if TYPE_CHECKING:
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.models.layers.lora import MergedLora

log = logging.getLogger(__name__)

DEFAULT_MAX_LOADED = 4
"""Adapters kept read in host memory between requests (vLLM's --max-cpu-loras; a rank-64 adapter of every linear
of Cosmos3-Nano's layers takes ~1 GB in bf16 here, the block-diagonal B of fused q|k|v and gate|up included)."""


class LoraCache:
    """One rank's adapters for `transformer` (its config, dtype, device and tensor-parallel group). `max_rank`:
    the highest module rank `check` lets through (--max-lora-rank; None: no bound), fixed when the cache is
    made: every rank's cache is built with it (VideoPipeline's and BranchRank's `max_lora_rank`)."""

    def __init__(
        self,
        transformer: Cosmos3Transformer,
        max_loaded: int = DEFAULT_MAX_LOADED,
        max_rank: int | None = None,
    ) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.transformer = transformer
        self.max_loaded = max_loaded
        self._max_rank = max_rank
        self._loaded: OrderedDict[tuple, LoraWeights] = (
            OrderedDict()
        )  # host copies, least recently used first
        self._on_device: weakref.WeakValueDictionary[tuple, LoraWeights] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()  # (the API's validate and the engine thread's prepare may overlap)
        # (--lora-path's adapter, checked at the start: load_static)
        self._static: LoraRequest | None = None

    @property
    def max_rank(self) -> int | None:
        """--max-lora-rank's bound (None: none); read-only, as every rank's cache must keep the one it was
        made with."""
        return self._max_rank

    @property
    def static(self) -> LoraRequest | None:
        """The server's own adapter (`load_static`'s), None without one."""
        return self._static

    def load_static(self, request: LoraRequest) -> None:
        """The server's own adapter (--lora-path at --lora-scale, the one requests naming none run with) checked
        against the model and this cache's bound and read now (at scale 0 nothing is read; merged: its unmerged
        rest); ParamError naming `lora`. Its scale-0 requests are not checked again (`check`)."""
        self._inspect(request)
        self.get(request)
        self._static = request

    def check(self, request: LoraRequest | None) -> AdapterSpec | None:
        """The adapter's files checked against the model (headers only); ParamError naming `lora`. At a scale
        of 0 too (the request runs the base model, but names an adapter that must be one this server could
        run: its headers are read, its weights are not). None for no adapter, for the adapter merged into
        the model (its files were read at load; what runs is what was merged), and for the server's own
        adapter at scale 0 (`load_static` checked it at the start; its requests read nothing of it)."""
        if self._merged(request) is not None or request is None:
            return None
        if request == self._static and not request.active:
            return None
        return self._inspect(request)

    def _inspect(self, request: LoraRequest) -> AdapterSpec:
        """`request`'s adapter checked against the model and this cache's bound (headers only)."""
        return inspect_adapter(request.validate().path, self.transformer.config, max_rank=self._max_rank)

    def get(self, request: LoraRequest | None) -> LoraWeights | None:
        """The request's adapter on the device (None: the base model): the copy requests running with it
        share, else a copy of the host one, else read from its files; for the merged adapter its unmerged
        und deltas (None when it has none)."""
        if (merged := self._merged(request)) is not None:
            return merged.rest
        # (the base model: no weights read; a scale of 0's adapter was checked by the request's validate)
        if request is None or not request.active:
            return None
        spec = self._inspect(request)
        key = (spec.identity, float(request.scale))
        device = self.transformer.device
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
            if (found := self._on_device.get(key)) is not None:
                return found
            host = self._loaded.get(key)
        if host is None:
            host = self._read(request, spec, key)
        weights = host.to(
            device, non_blocking=True
        ).mark_ranks_dynamic()  # (one compiled graph for all ranks)
        with self._lock:
            self._on_device[key] = weights
        return weights

    def _merged(self, request: LoraRequest | None) -> MergedLora | None:
        """The model's MergedLora when `request` names it; None on a model without one. On a model with one,
        any other request (another adapter, another scale, none: the base model) is a ParamError naming
        `lora`: its gen weights are no longer the base model's."""
        merged = self.transformer.merged_lora
        if merged is None:
            return None
        if request is None or merged.source != merged_source(request.validate()):
            path, scale = cast("tuple[str, float]", merged.source)  # (merged_source's)
            raise ParamError("lora", f"this server runs the LoRA adapter {path} at scale {scale:g} merged into "
                             "its weights (--lora-path without --enable-lora): it runs no other adapter, nor the "
                             "base model")  # fmt: skip
        return merged

    def _read(self, request: LoraRequest, spec: AdapterSpec, key: tuple) -> LoraWeights:
        """The adapter read from its files into host memory (pinned for a CUDA model), kept as the most recent."""
        t = self.transformer
        cpu = torch.device("cpu")
        host = load_adapter(spec, request.scale, t.config, dtype=t.dtype, device=cpu, tp=t.tp)
        if t.device.type == "cuda":
            host = host.pinned()
        log.info("LoRA adapter %r read from %s (%d modules, %.1f MB, scale %g)", request.name, request.path,
                 len(spec.modules), host.nbytes / 2**20, request.scale)  # fmt: skip
        with self._lock:
            self._loaded[key] = host
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)
        return host


def merged_source(request: LoraRequest) -> tuple[str, float]:
    """What names a merged adapter (MergedLora.source): its path and scale."""
    return request.path, float(request.scale)


MERGE_ERASURE_LIMIT = 0.05
"""The largest share of an output row's LoRA delta a merge may change by rounding into the weights (models/
layers/lora.py merge_pair); past it that row stays unmerged. A delta below half a bf16 weight's last bit
(~0.2 % of the weight) rounds away whole, which a barely trained module or row, a small adapter or a small
--lora-scale is made of; larger ones only take the zero-mean rounding noise every bf16 weight carries. That
noise enters a row's measure too (std ~0.3 % for deltas of 1 % of the weights over 4096 inputs): a limit of
1 % would leave rows, and so whole linears, unmerged by chance; 5 % sits far above it and below the
systematic loss of deltas under ~0.4 % of a weight."""


def merge_lora(
    transformer: Cosmos3Transformer, request: LoraRequest, device: torch.device
) -> tuple[int, int, float]:
    """`request`'s adapter read (this rank's tensor-parallel slices, float32) and its gen-pathway deltas merged
    into `transformer`'s weights (Cosmos3Transformer.merge_gen_lora), each output row unless rounding would
    change more than MERGE_ERASURE_LIMIT of its delta; the und deltas and the rows left out run unmerged, from
    `device` (where the model will run). Nothing merged: the weights stay as loaded and the cache applies the
    adapter unmerged (`transformer.merged_lora` says which). Returns (gen-pathway linears merged whole, their
    count, the largest |erasure| merged). ParamError naming `lora` for an adapter that does not fit the model."""
    spec = inspect_adapter(request.validate().path, transformer.config)
    cpu = torch.device("cpu")
    weights = load_adapter(
        spec, request.scale, transformer.config, dtype=torch.float32, device=cpu, tp=transformer.tp
    )
    whole, worst = transformer.merge_gen_lora(
        weights, merged_source(request), device, max_erasure=MERGE_ERASURE_LIMIT
    )
    total = len(weights.top) + sum(len(layer.get("gen", {})) for layer in weights.layers)
    name, dtype = request.name, str(transformer.dtype).removeprefix("torch.")
    if whole < total:
        log.warning("LoRA adapter %r (%s, scale %g): %d of its %d gen-pathway linears keep rows unmerged (~5 %% "
                    "of a step if all do): rounding into the %s weights would change more than %g %% of those "
                    "rows' deltas", name, request.path, request.scale, total - whole, total, dtype,
                    100 * MERGE_ERASURE_LIMIT)  # fmt: skip
    if transformer.merged_lora is not None:
        log.info("LoRA adapter %r (%s, scale %g) merged into the gen pathway's weights (%d of %d linears whole; "
                 "rounding changed at most %.2g %% of a merged row's delta)", name, request.path, request.scale,
                 whole, total, 100 * worst)  # fmt: skip
    return whole, total, worst


def check_adapter_fits(
    root: str | Path, request: LoraRequest, flag: str, max_rank: int | None = None
) -> None:
    """ValueError naming `flag` unless `request`'s adapter fits the transformer of the checkpoint at `root`
    (its headers against the config) and, with `max_rank` (--max-lora-rank), no module's rank is above it:
    before minutes of weights load, not after."""
    from worldserve.weights.checkpoint import read_transformer_config

    config = read_transformer_config(Path(root))
    try:
        inspect_adapter(request.validate().path, config, max_rank=max_rank)
    except ParamError as exc:
        raise ValueError(f"{flag}: {exc.message}") from None
