"""The Reasoner's step of its running chats (ChatStepping, a base of runner/reasoner.py's Reasoner).

`step_all(sessions)`: one iteration's step of every running session within the iteration's token budget
(step_budget.py, vLLM's --max-num-batched-tokens order): the prefilling sessions' next chunks, oldest first,
then the resumes of preempted sessions (oldest first, while the pool has room for one plus a block for each
running session), then every ready session's token sampled at once (sampling/tokens.py; logprobs in one pass,
chat_logprobs.py), and ONE batched decode of the unfinished ones, the grammars' masks applied to the batch.
When the pool runs out of blocks, the newest running session is preempted (vLLM's recompute preemption) and
waits to be resumed. A chat its own rules leave with no next token fails (finish_reason "error").
Apart from the admission of new chats (chat_admission.py) and from the model-facing Reasoner (prefill, decode,
warm-up) because this is the scheduling of running chats: what runs in a step, and who gives way.

The Reasoner provides the state it reads: share, budget, pool, prefiller, token_texts, preemptions, _waiting,
decode_many.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from worldserve.engine.outputs import ChatDelta
from worldserve.models.layers.paged_kv import PoolExhausted
from worldserve.param_errors import ParamError
from worldserve.runner.chat_logprobs import batch_logprobs
from worldserve.runner.reasoner_session import ReasonerSession
from worldserve.runner.step_budget import decoding
from worldserve.sampling.token_grammar import constrain_rows
from worldserve.sampling.tokens import sample_tokens

if TYPE_CHECKING:
    from typing import Any

    from torch import Tensor

    from worldserve.models.layers.paged_kv import PagedSequence


class ChatStepping:
    """step_all() of the Reasoner (module docstring)."""

    if TYPE_CHECKING:  # the Reasoner's state this reads (runner/reasoner.py)
        share: Any
        budget: Any
        pool: Any
        prefiller: Any
        token_texts: Any
        preemptions: int
        _waiting: list

        def decode_many(self, steps: Sequence[tuple[int, PagedSequence, int]]) -> Tensor: ...

    def step_all(self, sessions: Sequence[ReasonerSession]) -> list[ChatDelta]:
        """One step of every session: the prefilling ones' next chunks (oldest first) and the resumes of
        preempted ones, within what the decodes and this iteration's admissions leave of the budget
        (step_budget.py); then sample each ready one and one batched decode of the unfinished ones, preempting
        the newest when the pool runs out of blocks."""
        with self.share.context():
            return self._step_all(sessions)

    def _step_all(self, sessions: Sequence[ReasonerSession]) -> list[ChatDelta]:
        try:
            self.budget.begin(decoding(sessions))  # what the decodes and this iteration's admissions left
            # chunked prefill: the prefilling sessions' next chunks, oldest first, while the budget lasts (as
            # vLLM schedules its running prefills), then the resumes (step_budget.py)
            for s in sorted((s for s in sessions if s.prefilling), key=lambda s: s.started):
                if not (n := self.budget.chunk(s.prefill_left)):
                    break  # a younger one must not take the tokens the older one waits for
                s.prefill_next(n)
                self.budget.spend(n + (not s.prefilling))  # its first decode, once complete
            self._resume_waiting(sessions)
            return self._sample_and_decode(sessions)
        finally:
            self.budget.end()

    def _sample_and_decode(self, sessions: Sequence[ReasonerSession]) -> list[ChatDelta]:
        """Sample every ready session's token at once, then one batched decode of the unfinished ones."""
        ready = [s for s in sessions if not (s.preempted or s.prefilling)]
        logprobs: dict = {}
        conflicts: list[int] = []  # rows of `ready` whose rules left no token: those chats fail
        if ready:
            drawn = sample_tokens(
                [s.sampler for s in ready],
                torch.stack([s.pending_logits for s in ready]),
                conflicts=conflicts,
            )
            tokens = dict(zip(map(id, ready), drawn, strict=True))
            wanting = [
                (s, t, s.top_logprobs)
                for s, t in zip(ready, drawn, strict=True)
                if s.top_logprobs is not None
            ]
            if wanting:  # every chat asking for logprobs, in one pass
                entries = batch_logprobs(self.token_texts, [s.logprob_logits for s, _, _ in wanting],
                                         [t for _, t, _ in wanting], [top for _, _, top in wanting])  # fmt: skip
                logprobs = {id(s): e for (s, _, _), e in zip(wanting, entries, strict=True)}
        deltas, pending = [], []
        failed = {id(ready[row]) for row in conflicts}
        for s in sessions:
            if s.preempted or s.prefilling:
                deltas.append(s.idle_delta())
                continue
            if id(s) in failed:
                deltas.append(s.fail(_no_token_left(s)))
                continue
            delta, decode = s.advance(tokens[id(s)], logprobs.get(id(s)))
            deltas.append(delta)
            if decode is not None:
                pending.append((s, decode))
        pending = self._make_room(pending, [s for s in sessions if s.prefilling])
        if pending:
            logits = self.decode_many([decode for _, decode in pending])
            # the grammars' masks, computed on the host while the GPU decodes, applied to the batch at once
            logits = constrain_rows(logits, [s.grammar for s, _ in pending])
            for (s, _), row in zip(pending, logits, strict=True):
                s.receive(row)
        return deltas

    def _resume_waiting(self, sessions: Sequence[ReasonerSession]) -> None:
        """Resume preempted sessions, oldest first, while the pool has room for one plus a block for each
        running session (so that a resumed session is not preempted again by this very step) and, with chunked
        prefill, the step's budget has a token left for it: a long one recomputes its first chunk now and the
        rest a step at a time. One that does not fit stays on the wait list."""
        running = sum(not s.preempted for s in sessions)
        for s in [s for s in self._waiting if s in sessions]:
            need = self.pool.blocks_for(s.resume_tokens + 1) + running
            budget = self.budget.resume_budget()
            if budget == 0 or self.pool.num_free < need:
                break  # a later one must not take the blocks (or tokens) the older one waits for
            before = self.prefiller.computed
            if not s.resume(budget):
                break
            done = not s.prefilling  # then it decodes its next token in this step too
            self.budget.spend(self.prefiller.computed - before + done)
            self._waiting.remove(s)
            running += 1

    def _make_room(self, pending: list, filling: list[ReasonerSession]) -> list:
        """Reserve each pending decode's slot; while the pool is short, preempt the newest running session, as
        vLLM does: a pending one, or one still prefilling (its blocks are all reserved; its committed ones stay
        cached for its resume)."""
        pending = sorted(pending, key=lambda p: p[0].started)  # oldest first keeps its blocks
        filling = sorted(filling, key=lambda s: s.started)
        while pending:
            try:
                for _, (_, seq, _) in pending:
                    seq.reserve(1)
                return pending
            except PoolExhausted:
                if filling and filling[-1].started > pending[-1][0].started:
                    victim = filling.pop()
                else:
                    victim, _ = pending.pop()
                victim.preempt()
                self.preemptions += 1
                self._waiting.append(victim)
                self._waiting.sort(key=lambda w: w.started)
        return pending


def _no_token_left(session: ReasonerSession) -> ParamError:
    """Why a chat cannot go on: its allowed_token_ids (or bad_words) leave no token that the structured
    output's grammar, min_tokens (holding the ends back) or its bad_words allow next. vLLM fails such a request
    mid-answer (its grammar rejects the token drawn: finish_reason "error"); the rules are not set aside."""
    rules = session.sampler
    param = "allowed_token_ids" if rules.allowed_token_ids is not None else "bad_words"
    if session.grammar is not None:
        where = "the structured output"
    elif session.completion_tokens < session.min_tokens:
        where = "min_tokens (which holds the ends back)"
    else:  # (allowed_token_ids all banned by bad_words: no other rule narrowed the row)
        where = "bad_words"
    return ParamError(param, f"{param} leave no token that {where} allows after {session.completion_tokens} "
                      "tokens of the answer: the answer cannot go on. Allow more tokens, or drop one of the rules.")  # fmt: skip
