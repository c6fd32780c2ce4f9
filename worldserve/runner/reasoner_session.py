"""ReasonerSession: one chat completion in progress (runner/reasoner.py starts them and steps them together).

A session holds the pending logits of its next token, its paged K/V sequence, its sampler and the text so
far. `Reasoner.step_all` samples every session at once and hands each its token (`advance`), which updates
the text and says which decode step to run next; the decode's logits come back through `receive`.

Text: detokenized incrementally, as vLLM does: each step decodes only the tokens since the previous
boundary (with one boundary of context before them), so a step costs the same at token 10 and at token
10,000; a token that ends inside a UTF-8 character adds no text until the character completes, and a chat
that ends inside one leaves its bytes out (vLLM's DecodeStream never completes them). Stop strings are
searched where the new text could complete one; of several completed by one token, the one ending first
wins (ties: the request's order), as vLLM's check_stop_strings. Unless `include_stop_str_in_output`, a
possible stop-string prefix is held back from the deltas until it is ruled out (vLLM's stop_buffer_length).
With `defer_stops_past_thoughts` (a --reasoning-parser server), stop strings end the answer, not its
thoughts, as vLLM's detokenizer defers them while a request reasons: in an answer that opens with <think>, a
match must start after </think>.
Structured outputs: a session with a grammar (sampling/token_grammar.py) masks each step's logits to the tokens
the grammar allows next and advances the grammar with each token taken.
vLLM's ends: `ignore_eos` generates past the end-of-sequence ids, `stop_token_ids` end it too (stop_reason:
the id), and before `min_tokens` tokens no end applies: the ending ids' logits are -inf, and a stop string
counts only once it ends in a later token; `include_stop_str_in_output` keeps a matched stop string in the
text. The token that ends a chat (end-of-sequence or stop id) is not in `token_ids`, but it is output as vLLM
outputs it (vllm/v1/engine/detokenizer.py update, the logprobs processor): it counts in `completion_tokens`,
has its logprobs entry (the last one) and adds no text, unless `include_stop_str_in_output`: then its text
joins the output as any token's would (a special token's subject to `skip_special_tokens`), and a stop string
that text completes is the stop_reason (vLLM's detokenizer searches the text it adds; without the option it
adds none). The last delta counts the answer's thought tokens (`thought_tokens`: usage's reasoning_tokens).

Preemption (the pool ran out of K/V blocks): `preempt` frees the blocks; `resume` prefills the prompt and
the tokens produced so far again, at the positions their decode steps had, which gives the pending logits
back as the decode step would have; the text and the sampler state are untouched.
Chunked prefill (vLLM's): a session whose prompt (or resume) is longer than what its iteration's token budget
leaves (step_budget.py) starts `prefilling`; `prefill_next` computes its next chunk (Reasoner.step_all, one a
step), the last one gives the pending logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from worldserve.chat_params import THINK_END, THINK_START
from worldserve.engine.outputs import ChatDelta, TokenLogprob
from worldserve.models.layers.paged_kv import PagedSequence, PoolExhausted
from worldserve.param_errors import ParamError
from worldserve.runner.chat_logprobs import batch_logprobs
from worldserve.sampling.tokens import TokenSampler, host_to

if TYPE_CHECKING:
    from worldserve.runner.chat_prompt import ChatPrompt
    from worldserve.runner.reasoner import Reasoner
    from worldserve.sampling.token_grammar import TokenGrammar


class ReasonerSession:
    """One chat completion in progress: pending logits, its paged K/V sequence and the text emitted so far."""

    def __init__(
        self, reasoner: Reasoner, sampler: TokenSampler, seq: PagedSequence | None, logits: Tensor,
        position: int, *, prompt: ChatPrompt, started: int, max_tokens: int, stop: Sequence[str],
        top_logprobs: int | None = None,
        ends: tuple[bool, int, tuple[int, ...], bool] = (False, 0, (), False),
        grammar: TokenGrammar | None = None, skip_special_tokens: bool = True,
    ) -> None:  # fmt: skip
        """`ends`: vLLM's (ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output) of the request;
        `grammar`: the structured output constraint the tokens must follow; `skip_special_tokens`: special
        tokens are left out of the text (vLLM's default)."""
        self._r, self._sampler, self._seq = reasoner, sampler, seq
        self.grammar = grammar
        self.skip_special_tokens = skip_special_tokens
        self._logits: Tensor | None = None if logits is None else self._constrained(logits)
        self._position = position
        self._prompt = prompt
        self.started = started
        self.prompt_tokens = len(prompt.input_ids)
        self.prompt_token_ids = prompt.input_ids
        self.prompt_logprobs: tuple | None = None  # with params.prompt_logprobs: set by the Reasoner
        # prompt tokens found in the prefix cache (usage's cached_tokens): set by the Reasoner
        self.cached_tokens = 0
        self.prefill_left = 0  # prompt tokens a chunked prefill has still to compute (prefill_next)
        self.max_tokens = max_tokens
        self.stop = tuple(stop)
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.ignore_eos, self.min_tokens, extra, self.keep_stop = ends
        self.stop_token_ids = frozenset(extra)  # the request's own, besides the model's end-of-sequence ids
        self._ends: Tensor | None = None  # every id that ends it, to mask before min_tokens
        self.token_ids: list[int] = []  # without the token that ended it (end-of-sequence or stop token id)
        self._ended_by_token = False  # that token came: it counts as output (vLLM's completion tokens)
        self.finish_reason: str | None = None
        self.failure: ParamError | None = None
        """Why the chat ended with finish_reason "error" (`fail`): the request's rules allow no next token."""
        self.stop_reason: str | int | None = None
        self._text = ""  # detokenized so far, up to the last token boundary outside a character
        self._tail = ""  # complete characters decoded after it, held while a character is unfinished
        self._prefix_at = self._read_at = 0  # incremental detokenization boundaries (token indices)
        self._prefix: str | None = ""  # the decode of [prefix_at, read_at); None: not computed yet
        self._emitted = 0  # characters of _text already sent
        self._closed = False
        self._stops_from: int | None = 0  # stop strings start at or after this character; None: thinking

    @property
    def completion_tokens(self) -> int:
        """Tokens generated, an ending end-of-sequence / stop token id included (vLLM counts it as output)."""
        return len(self.token_ids) + self._ended_by_token

    @property
    def sampler(self) -> TokenSampler:
        return self._sampler

    @property
    def pending_logits(self) -> Tensor | None:
        """Logits of the next token (those the grammar forbids at -inf), or None while its decode step is
        outstanding or the chat is over; before `min_tokens` tokens, those of every token that would end it
        are -inf too (vLLM's min_tokens), unless the grammar allows nothing else."""
        if self._logits is None or self.completion_tokens >= self.min_tokens:
            return self._logits
        if self._ends is None:
            ids = sorted((set() if self.ignore_eos else set(self._r.stop_token_ids)) | self.stop_token_ids)
            self._ends = host_to(ids, torch.long, self._logits.device)  # no wait for the queued GPU work
        masked = self._logits.index_fill(0, self._ends, float("-inf"))
        if self.grammar is not None and not bool(torch.isfinite(masked).any()):  # a host read: grammars only
            return self._logits
        return masked

    def step(self) -> ChatDelta:
        """Sample one token, return the new text (possibly empty) and the finish reason once done."""
        return self._r.step_all([self])[0]

    # ------------------------------------------------------------------ chunked prefill
    @property
    def prefilling(self) -> bool:
        """A chunked prefill is under way: prefill_next computes its next chunk (Reasoner.step_all)."""
        return self.prefill_left > 0 and self._seq is not None and self.finish_reason is None

    def prefill_next(self, budget: int) -> None:
        """The prompt's next chunk of up to `budget` tokens; after the last one the first token's logits."""
        self.prefilled(self._r.prefiller.extend(self._prompt, self.token_ids, self._seq, budget))

    def prefilled(self, hidden: Tensor) -> None:
        """After a prefill pass whose computed rows' hidden states are `hidden` [n, d]: the tokens left to
        prefill (chunked), or, once every token is in, the pending logits of the next one (its last row)."""
        assert self._seq is not None, "a prefill pass ran on a session without K/V blocks"
        self.prefill_left = self.resume_tokens - self._seq.length
        if not self.prefill_left:
            self._logits = self._constrained(self._r.transformer.compute_logits(hidden[-1:])[0])

    # ------------------------------------------------------------------ preemption
    @property
    def preempted(self) -> bool:
        """Its K/V blocks were taken back; it waits to be resumed (Reasoner.step_all)."""
        return self._seq is None and self.finish_reason is None

    @property
    def resume_tokens(self) -> int:
        """Tokens a resume prefills (prompt + output so far)."""
        return self.prompt_tokens + len(self.token_ids)

    def preempt(self) -> None:
        """Free its K/V blocks (the full ones offered to the prefix cache: the resume may find them); the token
        `advance` just took stays in token_ids and is recomputed."""
        assert self._seq is not None, "only a session holding K/V blocks is preempted"
        self._r.prefiller.register(self._prompt, self.token_ids, self._seq)
        self._seq.release()
        self._seq, self._logits = None, None
        self._sampler.drop_device_counts()  # out of the batch until its resume

    def resume(self, budget: int | None = None) -> bool:
        """Prefill the prompt + the tokens produced so far again (at most `budget` tokens now: chunked, the
        rest through prefill_next); False (nothing taken) while the pool is short.

        The last produced token's logits come out of this prefill, as its decode step would have given them."""
        try:
            hidden, seq, position = self._r.prefill(
                self._prompt, self.token_ids, whole=False, budget=budget, resumed=True
            )
        except PoolExhausted:
            return False
        self._seq, self._position = seq, position
        self.prefilled(hidden)
        return True

    def idle_delta(self) -> ChatDelta:
        """The step outcome of a preempted or still prefilling session: no text yet."""
        return ChatDelta(text="", finish_reason=None, completion_tokens=self.completion_tokens)

    def fail(self, failure: ParamError) -> ChatDelta:
        """End the chat with vLLM's finish_reason "error" (its rules allow no next token): `failure` says why,
        for the worker to answer (a 400 before any text, an error event in a started stream)."""
        self.failure, self.finish_reason, self._logits = failure, "error", None
        self.close()
        return ChatDelta(text="", finish_reason="error", completion_tokens=self.completion_tokens)

    def close(self) -> None:
        """Give the K/V blocks back and leave the Reasoner's books (cancelled, failed or finished); idempotent."""
        if self._seq is not None:
            self._r.prefiller.register(self._prompt, self.token_ids, self._seq)  # for a later turn's prompt
            self._seq.release()
            self._seq = None
        if not self._closed:
            self._closed = True
            self._sampler.drop_device_counts()
            self._r.forget(self)

    # ------------------------------------------------------------------ one token
    def receive(self, logits: Tensor) -> None:
        """The next token's logits, after the decode of the token `advance` returned, already masked by the
        grammar (Reasoner.step_all masks the batch's rows at once: token_grammar.constrain_rows)."""
        self._logits = logits
        self._position += 1

    def _constrained(self, logits: Tensor) -> Tensor:
        """The logits with the grammar's forbidden tokens at -inf (log-probabilities are reported under these,
        as vLLM applies the grammar's mask before it computes them)."""
        return logits if self.grammar is None else self.grammar.constrain(logits)

    @property
    def logprob_logits(self) -> Tensor | None:
        """[V]: the logits the next token's log-probabilities are reported under (the grammar's mask applied,
        as vLLM applies it; not min_tokens' nor the sampler's rules)."""
        return self._logits

    def advance(
        self, token: int, logprob: TokenLogprob | None = None
    ) -> tuple[ChatDelta, tuple[int, Any, int] | None]:
        """Take `token`, sampled from the pending logits by this session's sampler (step_all samples every
        session at once), and update the text: (delta, the decode step to run next as (token, paged sequence,
        position) for Reasoner.decode_many, or None once finished). The caller runs it and hands its logits
        to `receive`. `logprob`: the token's entry when top_logprobs is set (step_all computes every
        session's at once with batch_logprobs; computed here when not given)."""
        if self.finish_reason is not None or self._logits is None:
            raise RuntimeError("the session is finished")
        finished = (token in self._r.stop_token_ids and not self.ignore_eos) or token in self.stop_token_ids
        # every sampled token has its entry, the ending one too (vLLM's logprobs parallel its token ids)
        if self.top_logprobs is not None and logprob is None:
            logprob = batch_logprobs(self._r.token_texts, [self._logits], [token], [self.top_logprobs])[0]
        logprobs = () if logprob is None else (logprob,)
        before = len(self._text) + len(self._tail)
        self._take(token, finished)
        view = self._text + self._tail  # all complete characters so far
        cut, matched = self._stop_in(view, before, finished)
        self._settle_finish(token, finished, cut, matched)
        end, decode = self._next_decode(token, view, cut, matched)
        delta = view[self._emitted : max(end, self._emitted)]
        self._emitted = max(end, self._emitted)
        thoughts = 0  # counted once, at the end, for an answer that thinks (its text opens with <think>)
        if decode is None and view.lstrip().startswith(THINK_START):
            thoughts = thought_tokens(self.token_ids, self._r.tokenizer, self.skip_special_tokens)
        out = ChatDelta(
            text=delta,
            finish_reason=self.finish_reason,
            completion_tokens=self.completion_tokens,
            logprobs=logprobs,
            stop_reason=self.stop_reason,
            reasoning_tokens=thoughts,
            token_ids=(token,),
        )
        return out, decode

    def _take(self, token: int, finished: bool) -> None:
        """Count `token` (an ending one only as output; any other joins token_ids and the grammar) and
        detokenize the text it adds."""
        if finished:
            self._ended_by_token = True
        else:
            self.token_ids.append(token)
            if self.grammar is not None:
                self.grammar.accept(token)
        # the ending token is detokenized only with include_stop_str_in_output (vLLM's skipped_stop_token_id)
        self._detokenize(ending=(token,) if finished and self.keep_stop else ())

    def _stop_in(self, view: str, before: int, finished: bool) -> tuple[int, str | None]:
        """(index, string) of the stop string the text since `before` characters completes in `view`, or
        (-1, None) when none does or none is searched this step."""
        # vLLM searches stop strings only once more than min_tokens tokens are out, and in the step a stop
        # token ended only the text include_stop_str_in_output adds (none without it)
        searched = self.completion_tokens > self.min_tokens and (self.keep_stop or not finished)
        searched = searched and self._stop_search_start(view) is not None
        return self._find_stop(view, before) if searched else (-1, None)

    def _settle_finish(self, token: int, finished: bool, cut: int, matched: str | None) -> None:
        """finish_reason (and stop_reason) once `token` ended the chat, a stop string matched at `cut`, or
        max_tokens are out; unchanged (None) otherwise."""
        if finished or cut >= 0:
            self.finish_reason = "stop"
            # vLLM's stop_reason: the matched stop string, the id of a request's stop token or of the model's
            # end-of-sequence ids besides the tokenizer's eos (<|endoftext|>), None for the tokenizer's eos
            ended_by_id = token in self.stop_token_ids or token in self._r.reported_stop_ids
            self.stop_reason = matched if cut >= 0 else token if ended_by_id else None
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"

    def _next_decode(
        self, token: int, view: str, cut: int, matched: str | None
    ) -> tuple[int, tuple[int, Any, int] | None]:
        """(where the text that may be sent ends in `view`, the decode step to run next): a chat going on holds
        back a possible stop-string prefix and waits for receive(); a finished one is cut at its stop string
        (kept with include_stop_str_in_output) and closed."""
        if self.finish_reason is None:
            end = len(view) - (0 if self.keep_stop else max((len(s) - 1 for s in self.stop), default=0))
            self._logits = None  # until receive()
            return end, (token, self._seq, self._position)
        end = (cut + len(matched) if self.keep_stop else cut) if matched is not None else len(view)
        self._logits = None
        self.close()
        return end, None

    def _detokenize(self, *, ending: Sequence[int] = ()) -> None:
        """vLLM's incremental detokenization: decode [prefix_at, end) and [prefix_at, read_at), the difference
        is the new text. It joins _text unless it ends inside a character (then its complete characters wait
        in _tail, and an unfinished character at the chat's end stays out). `ending`: the token that ended
        the chat, decoded after token_ids (include_stop_str_in_output), though not one of them."""
        decode = self._r.tokenizer.decode
        ids = [*self.token_ids, *ending] if ending else self.token_ids
        skip = self.skip_special_tokens
        if self._prefix is None:  # decoded once per boundary, not once per token
            self._prefix = decode(ids[self._prefix_at : self._read_at], skip_special_tokens=skip)
        prefix = self._prefix
        full = decode(ids[self._prefix_at :], skip_special_tokens=skip)
        new = full[len(prefix) :] if len(full) > len(prefix) else ""
        if new and not new.endswith("\ufffd"):
            self._text += new
            self._tail = ""
            self._prefix_at, self._read_at, self._prefix = self._read_at, len(ids), None
        else:
            self._tail = new.rstrip("\ufffd")

    def defer_stops_past_thoughts(self, defer: bool = True) -> None:
        """ChatParams.stops_after_thoughts: before the first token, let stop strings match only past the
        thoughts of an answer that opens with <think> (undecided until its first characters)."""
        self._stops_from = None if defer else 0

    def _stop_search_start(self, view: str) -> int | None:
        """Where stop strings may start in `view`: 0, or with stops_after_thoughts in an answer that opens with
        <think>, just past its </think> (None until it comes: the answer is still thinking)."""
        if self._stops_from is None:
            body = view.lstrip()
            if body and not (body.startswith(THINK_START) or THINK_START.startswith(body)):
                self._stops_from = 0  # not a thinking answer
            elif (end := view.find(THINK_END)) >= 0:
                self._stops_from = end + len(THINK_END)
        return self._stops_from

    def _find_stop(self, view: str, before: int) -> tuple[int, str | None]:
        """(index, string) of the stop string in `view` that ends first (ties: the request's order; -1, None if
        none), starting at or after `_stops_from`. Only one ending in the text added since `before` characters
        can be new; earlier ones would have finished an earlier step."""
        low = self._stops_from or 0
        starts = ((n, s, view.find(s, max(0, low, before - len(s) + 1))) for n, s in enumerate(self.stop))
        found = [(i + len(s), n, i, s) for n, s, i in starts if i >= 0]
        return min(found)[2:] if found else (-1, None)


def thought_tokens(ids: Sequence[int], tokenizer: Any, skip_special_tokens: bool = True) -> int:
    """The tokens of an answer's thoughts, as --reasoning-parser qwen3 splits the answer (api/reasoning.py) and
    vLLM counts them (its usage's reasoning_tokens: the thought's own tokens, not its tags): in an answer whose
    first token that is not all whitespace is <think>, the tokens after it up to its </think> (to the end when
    it never comes); 0 for an answer that does not open with <think>. `ids`: the generated tokens, without the
    one that ended the chat; `skip_special_tokens`: as the answer's text was decoded (a skipped token is no
    text before the <think>)."""
    start, end = tokenizer.convert_tokens_to_ids(THINK_START), tokenizer.convert_tokens_to_ids(THINK_END)
    for i, token in enumerate(ids):
        if token == start:
            rest = ids[i + 1 :]
            return rest.index(end) if end in rest else len(rest)
        if tokenizer.decode([token], skip_special_tokens=skip_special_tokens).strip():
            return 0
    return 0
