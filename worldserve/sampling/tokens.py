"""Autoregressive token sampling for the Reasoner: greedy, or temperature / top-k / top-p, seeded; batched.

`sample_tokens(samplers, logits [B, V])` draws one token per row, row b with `samplers[b]` (one
`TokenSampler` per request, built once), every row in one pass on the logits' device and one host sync
(a step of 32 chats costs about what one costs). `TokenSampler.sample(logits [V])` is the same for one row.
Per row, as vLLM orders it: the token restrictions first (`allowed_token_ids`: every other token -inf;
`bad_words`: a word's last token -inf where the output ends with the tokens before it, a one-token word
always; `logit_bias` added), then the penalties: repetition_penalty r over every token of the prompt and of the
output so far (a positive logit divided by r, a negative one multiplied: transformers'
RepetitionPenaltyLogitsProcessor), then the OpenAI penalties over the output so far (logit -=
frequency_penalty * count + presence_penalty * [count > 0]). temperature 0 (below 1e-5) is then greedy (argmax,
first index on ties), as in vLLM. Otherwise logits / temperature, then min_p (keep the tokens at least min_p times as likely as the most likely
one), then top-k (keep the k largest and the
tokens tied with the k-th, as vLLM does; with every k <= 1024 only the top max(k) are sorted), then top-p
(keep the smallest prefix of the sorted probabilities whose mass reaches p; the top token always stays),
then inverse-CDF sampling with one uniform number drawn from the request's CPU `torch.Generator` (seeded
with the request's seed): a seeded request gives the same tokens on every run, on any device. Every
sampled token counts as output for the next call; its count also lives on the logits' device (one [P, V] slab
per batch of penalized rows, updated in place while the batch stays the same), so the penalties of a step cost no host work
that grows with the text or kernels that grow with the batch. Only the drawn tokens are read back (and, with
top-k, one tie count): the rules add no host sync. A row its allowed_token_ids / bad_words / logit_bias would
leave with no token keeps its scores for that token (chosen on the device; read afterwards): `sample_tokens`
reports those rows to a caller that asks (the Reasoner fails their chats), else logs a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from worldserve.chat_params import GREEDY_BELOW, ChatParams

log = logging.getLogger(__name__)


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
    min_p: float = 0.0
    """Keep tokens at least this fraction as likely as the most likely one (0: all)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these may be sampled (None: any)."""
    bad_words: tuple[tuple[int, ...], ...] = ()
    """Token sequences never generated: the last token is banned where the output ends with the others."""
    output: list[int] = field(init=False, default_factory=list)
    """The tokens sampled so far, in order (kept for bad_words)."""
    generator: torch.Generator = field(init=False)
    output_counts: dict[int, int] = field(init=False, default_factory=dict)
    _counts: tuple[Tensor, int] | None = field(init=False, default=None, repr=False)
    """(slab [P, V] float32 on the device, row): where this sampler's output counts live (see _batch_counts)."""
    _unsynced: list[int] = field(init=False, default_factory=list, repr=False)
    """Tokens recorded since its counts row was last updated."""
    _prompt_mask: Tensor | None = field(init=False, default=None, repr=False)
    _fixed: tuple[Tensor, ...] | None = field(init=False, default=None, repr=False)  # device rule tensors
    _bad_after: dict[int, dict[tuple[int, ...], list[int]]] = field(
        init=False, default_factory=dict, repr=False
    )
    """bad_words by the tokens before their last: {how many: {those tokens: the last tokens they ban}} (a step
    looks up one tuple per length, not every word: 60,000 words took 23 ms a step, now 2 us)."""

    @classmethod
    def of(
        cls, params: ChatParams, prompt_ids: Sequence[int], bad_words: tuple[tuple[int, ...], ...] = ()
    ) -> TokenSampler:
        """The sampler of a chat's params (its prompt for repetition_penalty; its bad words as token ids)."""
        return cls(
            temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0), seed=params.seed,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, prompt_ids=tuple(prompt_ids), min_p=params.min_p,
            logit_bias=params.logit_bias, allowed_token_ids=params.allowed_token_ids, bad_words=bad_words,
        )  # fmt: skip

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for word in self.bad_words:
            self._bad_after.setdefault(len(word) - 1, {}).setdefault(word[:-1], []).append(word[-1])
        self.generator = torch.Generator()
        if self.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        """temperature below GREEDY_BELOW samples greedily (vLLM's epsilon: x / 1e-45 would overflow)."""
        return self.temperature < GREEDY_BELOW

    @property
    def restricted(self) -> bool:
        """Whether the request set allowed_token_ids, bad_words or logit_bias."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    def rule_tensors(self, vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """([V] bool: the tokens allowed_token_ids forbids, [V] float32: logit_bias), built once on `device`."""
        if self._fixed is None or self._fixed[0].device != device:
            forbidden = torch.zeros(vocab, dtype=torch.bool)
            if self.allowed_token_ids is not None:
                forbidden.fill_(True)[list(self.allowed_token_ids)] = False
            bias = torch.zeros(vocab, dtype=torch.float32)
            for token, value in self.logit_bias:
                bias[token] += value
            self._fixed = (forbidden.to(device), bias.to(device))
        return self._fixed  # type: ignore[return-value]

    def banned_now(self) -> list[int]:
        """bad_words' tokens banned for the next token: a word's last token where the output ends with the
        rest of it (a one-token word always)."""
        end = len(self.output)
        return [
            token
            for n, by_before in self._bad_after.items()
            if n <= end
            for token in by_before.get(tuple(self.output[end - n :]), ())
        ]

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def record(self, token: int) -> None:
        """Count `token` as output (for the penalties of later calls)."""
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        if self.bad_words:
            self.output.append(token)
        if self.penalized:  # only the penalties read the device-side counts
            self._unsynced.append(token)

    def counts_at(self, vocab: int, device: torch.device) -> tuple[Tensor, int]:
        """(slab, row): where this sampler's output counts live on `device`, as of the last _batch_counts (the
        tokens in _unsynced are not in them yet); built from output_counts when there are none there yet."""
        if (
            self._counts is not None
            and self._counts[0].device == device
            and self._counts[0].shape[1] == vocab
        ):
            return self._counts
        counts = torch.zeros(1, vocab, dtype=torch.float32, device=device)
        if self.output_counts:
            ids = host_to(list(self.output_counts), torch.long, device)
            counts[0, ids] = host_to(list(self.output_counts.values()), torch.float32, device)
        self._counts, self._unsynced = (counts, 0), []
        return self._counts

    def drop_device_counts(self) -> None:
        """Let go of its row of a batch's counts slab (a chat preempted or done: out of the batch for a while or
        for good, its reference would keep the whole [P, V] slab alive); rebuilt from output_counts if needed."""
        self._counts = None
        self._unsynced.clear()

    def prompt_mask(self, vocab: int, device: torch.device) -> Tensor:
        """[V] bool: the prompt's tokens (with the output so far, what repetition_penalty discounts)."""
        if self._prompt_mask is None or self._prompt_mask.device != device:
            self._prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            if self.prompt_ids:
                self._prompt_mask[host_to(list(self.prompt_ids), torch.long, device)] = True
        return self._prompt_mask

    def penalize(self, logits: Tensor) -> Tensor:
        """The penalties on a float32 copy of logits [V] (the input is untouched)."""
        scores = logits.detach().to(torch.float32, copy=True)[None]  # [1, V]
        _penalize([self], scores)
        return scores[0]

    def sample(self, logits: Tensor) -> int:
        """logits [V] -> the next token id (recorded as output for the penalties of later calls)."""
        return sample_tokens([self], logits[None])[0]


TOPK_FAST_PATH = 1024
"""When every sampled row has 0 < top_k <= this, only the top max(k) candidates are sorted (torch.topk)."""


def host_to(values: list | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list (or CPU tensor) as a tensor on `device`. On CUDA through pinned memory and a non-blocking
    copy: a plain torch.tensor(..., device="cuda") or .to("cuda") waits for all queued GPU work (the decode
    step's graph) while holding the GIL, which stalls the HTTP server's thread for that long."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _rows(
    samplers: Sequence[TokenSampler], wanted: list[int], scores: Tensor
) -> tuple[Tensor | None, Tensor]:
    """(index tensor of the wanted rows or None when they are all rows, those rows of scores)."""
    if len(wanted) == scores.shape[0]:
        return None, scores
    idx = host_to(wanted, torch.long, scores.device)
    return idx, scores.index_select(0, idx)


def _put_rows(scores: Tensor, idx: Tensor | None, x: Tensor) -> None:
    """Write rows x back where _rows took them from (all of scores when idx is None)."""
    if idx is None:
        scores.copy_(x)
    else:
        scores.index_copy_(0, idx, x)


def _batch_counts(sub: Sequence[TokenSampler], vocab: int, device: torch.device) -> Tensor:
    """[P, V] float32: the output counts of these samplers, row p sub[p]'s, up to date.

    The counts live in one slab per batch: when the batch is the one of the last call (a decode's steady
    state) its slab is updated in place; otherwise the rows are gathered into a new slab (one kernel) that
    the samplers then point to. Either way every token recorded since goes in with one host-to-device copy
    and one scatter-add, whatever the batch size (not a copy and a kernel a chat)."""
    at = [s.counts_at(vocab, device) for s in sub]
    slab = at[0][0]
    if not (slab.shape[0] == len(sub) and all(t is slab and row == p for p, (t, row) in enumerate(at))):
        slab = torch.stack([t[row] for t, row in at])  # [P, V]: one gather of the rows
        for p, s in enumerate(sub):
            s._counts = (slab, p)
    pending = [(p, t) for p, s in enumerate(sub) for t in s._unsynced]
    if pending:
        flat = host_to([p * vocab + t for p, t in pending], torch.long, device)  # [N]: row * V + token
        slab.view(-1).index_add_(0, flat, torch.ones(len(pending), device=device))  # one kernel, no sort
        for s in sub:
            s._unsynced.clear()
    return slab


def _penalize(samplers: Sequence[TokenSampler], scores: Tensor) -> None:
    """Apply each row's penalties to scores [B, V] (float32) in place, the penalized rows at once."""
    rows = [i for i, s in enumerate(samplers) if s.penalized]
    if not rows:
        return
    vocab, device = scores.shape[1], scores.device
    sub = [samplers[i] for i in rows]
    idx, x = _rows(samplers, rows, scores)  # [P, V]
    knobs = [[s.repetition_penalty, s.frequency_penalty, s.presence_penalty] for s in sub]
    r, freq, pres = host_to(knobs, torch.float32, device).unbind(1)  # [P] each
    counts = _batch_counts(sub, vocab, device)  # [P, V]
    if any(s.repetition_penalty != 1.0 for s in sub):
        seen = _stacked([s.prompt_mask(vocab, device) for s in sub]) | (counts > 0)  # [P, V]
        big = torch.finfo(x.dtype).max  # (a score divided by a tiny penalty stays finite: the top one)
        x = torch.where(seen, torch.where(x > 0, (x / r[:, None]).clamp(max=big), x * r[:, None]), x)
    x = x - freq[:, None] * counts - pres[:, None] * (counts > 0)
    _put_rows(scores, idx, x)


def _sorted_candidates(x: Tensor, k: Tensor, k_max: int) -> tuple[Tensor, Tensor]:
    """(values, indices) of each row of x [S, V] sorted descending, far enough to hold every row's k largest
    and all tokens tied with its k-th (so a row's draw never depends on the other rows of the batch).

    With k_max <= TOPK_FAST_PATH only the top candidates are sorted (topk); one host read checks for ties
    past them, after a GIL-free wait for the GPU, and widens the cut when there are."""
    if k_max > TOPK_FAST_PATH:
        return x.sort(-1, descending=True)
    vals, order = x.topk(k_max, dim=-1)
    kth = vals.gather(1, (k.long() - 1).clamp(max=k_max - 1)[:, None])  # [S, 1]
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()
    tied = int((x >= kth).sum(-1).max())
    return (vals, order) if tied <= k_max else x.topk(min(tied, x.shape[1]), dim=-1)


def _stacked(rows: Sequence[Tensor]) -> Tensor:
    """[R, V] from R tensors [V]: a view for one (no copy), else one stack."""
    return rows[0][None] if len(rows) == 1 else torch.stack(list(rows))


def _restrict(samplers: Sequence[TokenSampler], scores: Tensor) -> tuple[list[int], Tensor | None]:
    """Apply allowed_token_ids, bad_words and logit_bias to scores [B, V] (float32) in place, the restricted
    rows at once and with no host sync. A row they would leave with no token it allowed before (e.g.
    allowed ids outside a structured output's grammar) keeps its scores for this token: the grammar and the
    ends stay in force. Returns (the restricted rows, [R] bool on the device: where the rules stepped aside)
    for sample_tokens to read after its one sync."""
    rows = [i for i, s in enumerate(samplers) if s.restricted]
    if not rows:
        return rows, None
    vocab, device = scores.shape[1], scores.device
    sub = [samplers[i] for i in rows]
    idx, before = _rows(samplers, rows, scores)  # [R, V]
    forbidden, bias = (_stacked(t) for t in zip(*(s.rule_tensors(vocab, device) for s in sub), strict=True))
    x = before + bias if any(s.logit_bias for s in sub) else before.clone()  # [R, V]
    if any(s.allowed_token_ids is not None for s in sub):
        x.masked_fill_(forbidden, float("-inf"))
    banned = [(r, t) for r, s in enumerate(sub) for t in s.banned_now()]
    if banned:
        at = host_to(banned, torch.long, device)  # [N, 2]: (row of sub, token)
        x[at[:, 0], at[:, 1]] = float("-inf")
    stepped_aside = ~torch.isfinite(x).any(-1)  # [R]
    _put_rows(scores, idx, torch.where(stepped_aside[:, None], before, x))
    return rows, stepped_aside


def sample_tokens(
    samplers: Sequence[TokenSampler], logits: Tensor, *, conflicts: list[int] | None = None
) -> list[int]:
    """logits [B, V] (any float dtype, any device) -> one token id per row, row b drawn by samplers[b] and
    recorded as its output. One pass over all rows on the logits' device, one host sync. The rows whose rules
    left no token are drawn with the rules set aside: given `conflicts`, their indexes are appended to it (the
    caller fails those requests, as vLLM does: runner/chat_stepping.py); without it, a warning names them."""
    if len(samplers) != logits.shape[0]:
        raise ValueError(f"{len(samplers)} samplers for {logits.shape[0]} rows of logits")
    scores = logits.detach().to(torch.float32, copy=True)  # [B, V]: one copy, whatever the dtype
    restricted, stepped_aside = _restrict(samplers, scores)
    _penalize(samplers, scores)
    tokens = scores.argmax(-1)  # [B]: the greedy rows' answer (first index on ties)
    rows = [i for i, s in enumerate(samplers) if not s.greedy]
    if rows:
        sub = [samplers[i] for i in rows]
        vocab = scores.shape[1]
        ks = [s.top_k if 0 < s.top_k < vocab else vocab for s in sub]
        # per row: temperature, top_k, top_p (inf: off), a uniform draw from the request's generator, min_p
        knobs = [[s.temperature, k, s.top_p if s.top_p < 1 else float("inf"),
                  float(torch.rand((), generator=s.generator)), s.min_p] for s, k in zip(sub, ks, strict=True)]  # fmt: skip
        temp, k, p, u, min_p = host_to(knobs, torch.float32, scores.device).unbind(1)  # [S] each
        idx, x = _rows(samplers, rows, scores)
        x = x / temp[:, None]  # [S, V]
        vals, order = _sorted_candidates(x, k, max(ks))  # [S, n] each, descending
        kth = vals.gather(1, (k.long() - 1).clamp(max=vals.shape[1] - 1)[:, None])  # [S, 1]
        keep = vals >= kth  # the k largest, and every token tied with the k-th
        keep &= vals >= vals[:, :1] + min_p.log()[:, None]  # min_p (log 0 = -inf keeps all): p >= min_p p_max
        probs = vals.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= probs.cumsum(-1) - probs < p[:, None]  # drop a token once the mass before it reaches p
        cdf = vals.masked_fill(~keep, float("-inf")).softmax(-1).cumsum(-1)  # [S, n]
        # the kept tokens are a prefix of the sorted order
        last = (keep.sum(-1, keepdim=True) - 1).clamp_min(0)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # [S, 1]
        drawn = order.gather(1, torch.minimum(pick, last))[:, 0]
        tokens = drawn if idx is None else tokens.index_copy(0, idx, drawn)
    if tokens.is_cuda:  # wait with the GIL released (.tolist() would hold it): the HTTP thread runs meanwhile
        torch.cuda.current_stream(tokens.device).synchronize()
    out = tokens.tolist()
    if stepped_aside is not None and any(aside := stepped_aside.tolist()):  # no wait: the GPU is done
        rows = [row for row, a in zip(restricted, aside, strict=True) if a]
        if conflicts is not None:
            conflicts.extend(rows)
        else:
            log.warning("allowed_token_ids / bad_words / logit_bias leave no token allowed in rows %s: not "
                        "applied", rows)  # fmt: skip
    for s, t in zip(samplers, out, strict=True):
        s.record(t)
    return out
