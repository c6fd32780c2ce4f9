"""Autoregressive token sampling for the Reasoner: greedy, or temperature / top-k / top-p, seeded.

Input: one row of logits [V] (any float dtype, any device) and a `TokenSampler` built once per request.
Output: the next token id. Penalties come first, as vLLM applies them: repetition_penalty r over every
token of the prompt and of the output so far (a positive logit divided by r, a negative one multiplied:
transformers' RepetitionPenaltyLogitsProcessor), then the OpenAI penalties over the output so far
(logit -= frequency_penalty * count + presence_penalty * [count > 0]). temperature == 0 is then greedy
(argmax, first index on ties), as in vLLM. Otherwise logits / temperature, then top-k (keep the k largest),
then top-p (keep the smallest prefix of the sorted probabilities whose mass reaches p; the top token always
stays), then a draw from a CPU `torch.Generator` seeded with the request's seed, so a seeded request gives
the same tokens on every run and device. Every sampled token counts as output for the next call.
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
    presence_penalty: float = 0.0
    """Subtracted once from every token already in the output."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence in the output."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens of the prompt and the output (multiplicative)."""
    prompt_ids: tuple[int, ...] = ()
    """The prompt, for repetition_penalty."""
    generator: torch.Generator = field(init=False)
    output_counts: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.generator = torch.Generator()
        if self.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def penalize(self, logits: Tensor) -> Tensor:
        """The penalties on a float32 CPU copy of logits [V] (the input is untouched)."""
        scores = logits.detach().float().cpu().clone()
        if self.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self.prompt_ids) | set(self.output_counts)), dtype=torch.long)
            if seen.numel():
                vals = scores[seen]
                r = self.repetition_penalty
                scores[seen] = torch.where(vals > 0, vals / r, vals * r)
        if self.output_counts and (self.presence_penalty or self.frequency_penalty):
            ids = torch.tensor(list(self.output_counts), dtype=torch.long)
            counts = torch.tensor(list(self.output_counts.values()), dtype=torch.float32)
            scores[ids] -= self.frequency_penalty * counts + self.presence_penalty
        return scores

    def sample(self, logits: Tensor) -> int:
        """logits [V] -> the next token id (recorded as output for the penalties of later calls)."""
        token = self._choose(self.penalize(logits) if self.penalized else logits)
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        return token

    def _choose(self, logits: Tensor) -> int:
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
