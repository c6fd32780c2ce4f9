"""Timing the Reasoner's decode step: B chats of C context tokens each, one new token apiece.

`und_decode_seconds` prefills B random prompts into sequences of the decoder's paged pool, then times the
decode step the chat worker runs for them (runner/und_decoder.py: paged attention + lm_head; compiled and
CUDA-graphed on a GPU unless the decoder is eager). `contiguous_decode_seconds` times the same step through
`und_step` with one contiguous cache per chat (the Reasoner's path before the paged decoder), the baseline.
Used by bench/reasoner_decode.py and bench/layerwise_offload.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worldserve.bench.timing import time_region
from worldserve.models.cosmos3.batch import UndBatch
from worldserve.runner.und_decoder import UndDecoder

if TYPE_CHECKING:
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer

MAX_MODEL_LEN = 32768
"""The serve default: it sets the block-table width, hence the kernel's split count, as in production."""


def make_decoder(
    model: Cosmos3Transformer, *, max_batch: int, tokens: int, enforce_eager: bool = False
) -> UndDecoder:
    """A decoder over a pool of `tokens` tokens (at least MAX_MODEL_LEN), graphs per bucket up to max_batch."""
    pool = model.new_paged_pool(max(tokens, MAX_MODEL_LEN))
    return UndDecoder(
        model, pool, max_batch=max_batch, max_model_len=MAX_MODEL_LEN, enforce_eager=enforce_eager
    )


def _prompts(model: Cosmos3Transformer, device: torch.device, batch: int, context: int) -> list[torch.Tensor]:
    vocab = model.config.vocab_size
    return [(torch.arange(context, device=device) * (i + 1)) % vocab for i in range(batch)]


def und_decode_seconds(
    model: Cosmos3Transformer,
    device: torch.device,
    decoder: UndDecoder,
    *,
    batch: int = 1,
    context: int = 300,
    repeats: int = 5,
) -> float:
    """Median seconds of one batched decode step (each of `batch` sequences at `context` tokens)."""
    seqs = [decoder.pool.sequence() for _ in range(batch)]
    for s in seqs:
        s.reserve(context)
    model.und_step(UndBatch.text(_prompts(model, device, batch, context)), seqs, kv_only=True)
    tokens = [7 + i for i in range(batch)]

    def one() -> None:
        for s in seqs:
            s.reserve(1)
        decoder.step(tokens, seqs, [s.length for s in seqs])

    try:
        return time_region(one, device, warmup=2, repeats=repeats).median
    finally:
        for s in seqs:
            s.release()


def contiguous_decode_seconds(
    model: Cosmos3Transformer, device: torch.device, *, batch: int = 1, context: int = 300, repeats: int = 5
) -> float:
    """The same step through und_step over contiguous per-chat caches (eager, a Python loop per chat)."""
    caches = [model.new_und_cache(context + 2 + repeats) for _ in range(batch)]
    model.und_step(UndBatch.text(_prompts(model, device, batch, context)), caches, kv_only=True)
    position = [context]

    def one() -> None:
        ids = [torch.tensor([7 + i], device=device) for i in range(batch)]
        model.compute_logits(model.und_step(UndBatch.text(ids, starts=[position[0]] * batch), caches))
        position[0] += 1

    return time_region(one, device, warmup=2, repeats=repeats).median
