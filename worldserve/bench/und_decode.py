"""Timing the und tower's Reasoner decode step: B chats of C context tokens each, one new token apiece.

`und_decode_seconds` prefills B random prompts into their own K/V caches, then times the batched decode step
(und_step over B single tokens + lm_head), the work one continuous-batching step of the chat worker does.
Used by bench/reasoner_decode.py (eager vs compiled und tower) and bench/layerwise_offload.py.
"""

from __future__ import annotations

import torch

from worldserve.bench.timing import time_region
from worldserve.models.cosmos3.batch import UndBatch


def und_decode_seconds(
    model, device: torch.device, *, batch: int = 1, context: int = 300, repeats: int = 5
) -> float:
    """Median seconds of one batched decode step (each of `batch` sequences at `context` tokens)."""
    vocab = model.config.vocab_size
    caches = [model.new_und_cache(context + 2 + repeats) for _ in range(batch)]
    prompts = [(torch.arange(context, device=device) * (i + 1)) % vocab for i in range(batch)]
    model.und_step(UndBatch.text(prompts), caches, kv_only=True)
    position = [context]

    def one() -> None:
        ids = [torch.tensor([7 + i], device=device) for i in range(batch)]
        model.compute_logits(model.und_step(UndBatch.text(ids, starts=[position[0]] * batch), caches))
        position[0] += 1

    return time_region(one, device, warmup=2, repeats=repeats).median
