"""Autoregressive token sampling for the Reasoner: greedy, or temperature / top-k / top-p, seeded.

Input: one row of logits [V] (any float dtype, any device) and a `TokenSampler` built once per request.
Output: the next token id. temperature == 0 is greedy (argmax, first index on ties), as in vLLM. Otherwise
logits / temperature, then top-k (keep the k largest), then top-p (keep the smallest prefix of the sorted
probabilities whose mass reaches p; the top token always stays), then a draw from a CPU `torch.Generator`
seeded with the request's seed, so a seeded request gives the same tokens on every run and device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(slots=True, kw_only=True)
class TokenSampler:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 keeps everything."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    seed: int | None = None
    """Seed of this request's generator (None: a random seed)."""
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.generator = torch.Generator()
        if self.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sample(self, logits: Tensor) -> int:
        """logits [V] -> the next token id."""
        if self.greedy:
            return int(logits.argmax())
        scores = logits.detach().float().cpu() / self.temperature  # [V]
        if 0 < self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = sorted_scores.softmax(-1)
            before = probs.cumsum(-1) - probs  # mass strictly before each token
            drop = before >= self.top_p
            scores = scores.index_fill(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
