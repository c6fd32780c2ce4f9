"""The Reasoner's admission of new chats (ChatAdmission, a base of runner/reasoner.py's Reasoner).

`start_many(batch)`: per chat, validate and build the prompt (or reuse the one built for the same messages,
or for its last refused start), check the context, and admit it while the pool keeps a block free for each
running chat's next token and the pass's uncached prompt tokens fit the iteration's token budget: with chunked
prefill what the next step's running sessions leave of max_num_batched_tokens (step_budget.py: a decode each,
the oldest prefilling session's next chunk; the last admitted prompt chunked to the rest, vLLM's), without it
max_num_batched_tokens (a longer prompt goes alone); later chats are refused with ChatBackpressure, in order,
and retried by the chat worker. The admitted chats' prompts are prefilled in ONE und pass (chats with the very
same messages, the n choices of one request, share one prompt, one prefill and its full K/V blocks: a fork
each), a chunked one's first chunk only (its session `prefilling` until Reasoner.step_all computes the rest);
the tokens it computed count against the next step's budget. A pass that fails is retried chat by chat, so
that one chat's failure is not every chat's. Then each chat's ReasonerSession: sampler, grammar, first logits,
cached tokens, prompt logprobs.

The Reasoner provides the state it reads: pool, prefiller, prompts, grammars, transformer, tokenizer, share,
max_model_len, max_num_batched_tokens, chunked_prefill, budget, _waiting, _open, _live, _started, _deferred.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from torch import Tensor

from worldserve.chat_params import ChatParams
from worldserve.engine.outputs import ChatBackpressure
from worldserve.failures import release_frames
from worldserve.models.layers.paged_kv import PagedSequence, PoolExhausted
from worldserve.runner.chat_logprobs import prompt_logprobs
from worldserve.runner.chat_prompt import ChatPrompt, completion_budget
from worldserve.runner.prefix_hashes import block_hashes, shared_blocks
from worldserve.runner.reasoner_session import ReasonerSession
from worldserve.sampling.tokens import TokenSampler

log = logging.getLogger("worldserve.reasoner")

if TYPE_CHECKING:
    from typing import Any

    from worldserve.runner.reasoner import Reasoner

DEFERRED_PROMPTS = 256
"""Built prompts kept for chats refused for lack of room (their retry skips the preprocessing)."""


class ChatAdmission:
    """start() / start_many() of the Reasoner (module docstring)."""

    if TYPE_CHECKING:  # the Reasoner's state this reads (runner/reasoner.py)
        pool: Any
        prefiller: Any
        prompts: Any
        grammars: Any
        transformer: Any
        tokenizer: Any
        token_texts: Any
        share: Any
        max_model_len: int
        max_num_batched_tokens: int
        chunked_prefill: bool
        budget: Any
        _waiting: list
        _open: list
        _started: int
        _deferred: dict

        @property
        def _live(self) -> int: ...

        def prefill_batch(
            self, items: Sequence[tuple[ChatPrompt, Sequence[int]]], whole: Sequence[bool] = (),
            budget: int | None = None, resumed: Sequence[bool] = (),
        ) -> list[tuple[Tensor, PagedSequence, int]]: ...  # fmt: skip

        def build_prompt(self, params: ChatParams) -> ChatPrompt: ...

    def start(self, params: ChatParams) -> ReasonerSession:
        """Validate, build the prompt, prefill (all of it: a chunked one to its end); the session's step()
        yields the completion. An iteration of its own: it does not count against the next step's budget."""
        (result,) = self._admit([params], shared=False)
        if isinstance(result, Exception):
            raise result
        while result.prefilling:
            result.prefill_next(self.max_num_batched_tokens)
        return result

    def start_many(self, batch: Sequence[ChatParams]) -> list[ReasonerSession | Exception]:
        """start() of several chats, their prefills in one und pass (up to max_num_batched_tokens tokens; with
        chunked prefill a longer prompt's first chunk, its session `prefilling` until step_all ends it). Per
        chat: its session, or the exception it raised (ParamError for a bad request; ChatBackpressure when
        the pool has no room for it now, leaving a block for each running chat's next token, or the pass is
        full: then every later one is refused too, which keeps the chats in order). Chats with the very same
        messages (the n choices of one request) share one prompt, one prefill and its full K/V blocks."""
        return self._admit(batch)

    def _admit(self, batch: Sequence[ChatParams], shared: bool = True) -> list[ReasonerSession | Exception]:
        """start_many(); `shared`: the pass takes its tokens from the iteration's budget (step_budget.py)."""
        self.share.chats_live(self._live + len(batch))  # the margin up before the prefill, not after it
        try:
            with self.share.context():
                return self._start_many(batch, shared)
        finally:
            self.share.chats_live(self._live)

    def _start_many(self, batch: Sequence[ChatParams], shared: bool) -> list[ReasonerSession | Exception]:
        out: list[ReasonerSession | Exception | None] = []
        ready: list[tuple[int, ChatParams, ChatPrompt, int]] = []
        free = 0 if self._waiting else self.pool.num_free - self._live
        plan = self.budget.admission(self._open if shared else None)
        whole = False  # a ready chat forks another's K/V or wants prompt logprobs: the pass prefills whole
        built: dict[int, ChatPrompt] = {}  # prompt_key -> its prompt (the batch holds the params alive)
        computed: list[list[bytes]] = []  # block keys of the chats admitted so far (computed in the pass)
        for params in batch:
            key = params.prompt_key
            try:
                prompt, budget = self._plan(params, built.get(key))
                built[key] = prompt
            except Exception as exc:  # ParamError: a bad request; anything else fails this chat alone
                out.append(exc)
                continue
            n = len(prompt.input_ids)
            need = self.pool.blocks_for(n + 1)
            new = self._uncached(params, prompt, computed)
            uncut = any(r[2] is prompt for r in ready) or params.prompt_logprobs is not None
            if need > free or not plan.admit(new, chunkable=not (uncut or whole), first=not ready):
                short = f"{need} K/V blocks" if need > free else f"{new} prompt tokens of the step's budget"
                free = 0  # the later chats wait too, in order
                self._remember(params, prompt)  # the retry reuses it: no new preprocessing
                out.append(ChatBackpressure(f"no room now for {short}"))
                continue
            free -= need
            whole = whole or uncut
            ready.append((len(out), params, prompt, budget))
            out.append(None)
        leaders: dict[int, tuple] = {}  # id(prompt) -> the first ready chat with that prompt
        for r in ready:
            leaders.setdefault(id(r[2]), r)
        # a prompt whose later choices fork its K/V is prefilled whole (a fork needs all of it)
        limit = plan.limit if self.chunked_prefill and not whole else None
        before = self.prefiller.computed
        prefilled = {id(row[2]): row[4] for row in self._prefill_each(list(leaders.values()), limit)}
        if shared:
            self.budget.admitted += self.prefiller.computed - before
        started = {
            i: self._start_one(i, params, prompt, budget, prefilled, leaders[id(prompt)][0] == i)
            for i, params, prompt, budget in ready
        }
        return [started[i] if o is None else o for i, o in enumerate(out)]  # (None: a ready chat's place)

    def _start_one(self, i: int, params: ChatParams, prompt: ChatPrompt, budget: int, prefilled: dict,
                   leader: bool) -> ReasonerSession | Exception:  # fmt: skip
        """The session of ready chat i from its prompt's prefill (a later choice of the same messages forks
        the leader's K/V), or the exception that fails this chat alone, its blocks given back."""
        done = prefilled[id(prompt)]
        if isinstance(done, Exception):
            return done
        try:
            seq = done[1] if leader else self.prefiller.fork(done[1], prompt, params)
        except PoolExhausted as exc:
            return ChatBackpressure(str(exc))
        except Exception as exc:
            return exc
        try:
            return self._session(params, prompt, budget, done[0], seq, done[2])
        except Exception as exc:  # e.g. out of memory for its logits
            seq.release()
            if leader:
                prefilled[id(prompt)] = exc  # its other choices have nothing to fork now
            return exc

    def _prefill_each(self, ready: list, budget: int | None) -> list:
        """prefill_batch over the ready chats (at most `budget` tokens: chunked prefill; None: whole); when the
        pass fails (e.g. out of memory), each chat once more on its own, so that one chat's failure is not
        every chat's. [(*item, result or exception)]."""
        if not ready:  # (every chat of the batch was refused before its prefill)
            return []
        items = [(prompt, ()) for _, _, prompt, _ in ready]
        whole = [params.prompt_logprobs is not None for _, params, _, _ in ready]  # every prompt row's logits
        try:
            done = self.prefill_batch(items, whole, budget)
            return [(*r, d) for r, d in zip(ready, done, strict=True)]
        except Exception as exc:
            if len(ready) == 1:
                return [(*ready[0], exc)]
            log.warning("a prefill of %d chats failed (%r): each is prefilled alone", len(ready), exc,
                        exc_info=exc)  # fmt: skip
            release_frames(exc)  # (the record keeps no pass's activations: failures.py)
        return [row for r in ready for row in self._prefill_each([r], budget)]

    def _uncached(self, params: ChatParams, prompt: ChatPrompt, computed: list[list[bytes]]) -> int:
        """Prompt tokens the pass will compute for this chat, as UndPrefill will find its prefix: past the
        longest run of its blocks cached or computed by a chat admitted before it (whose keys are in
        `computed`; this chat's are added), so a burst of chats with a common prefix fits in one pass as in
        vLLM, whose step budget counts the tokens scheduled, not those found cached."""
        n = len(prompt.input_ids)
        if not self.prefiller.caching or params.prompt_logprobs is not None:
            return n
        bs = self.pool.block_size
        keys = block_hashes(prompt, (), bs, n)[: (n - 1) // bs]  # (the last token is always computed)
        hit = self.pool.cached_prefix(keys)
        for other in computed:
            hit = shared_blocks(keys, other, hit)
        computed.append(keys)
        return n - hit * bs

    def _remember(self, params: ChatParams, prompt: ChatPrompt) -> None:
        """Keep the prompt of a chat refused for lack of room (the most recent DEFERRED_PROMPTS of them)."""
        self._deferred[id(params)] = (params, prompt)
        while len(self._deferred) > DEFERRED_PROMPTS:
            self._deferred.pop(next(iter(self._deferred)))

    def _plan(self, params: ChatParams, prompt: ChatPrompt | None = None) -> tuple[ChatPrompt, int]:
        """Validate, build the prompt (or take `prompt`, built for the same messages, or the one of its last
        refused start), check the context: (prompt, completion token budget). ParamError for a bad request."""
        params.validate()
        self.prompts.check_ids(list(params.stop_token_ids), "stop_token_ids")
        self.prompts.check_ids(list(params.allowed_token_ids or ()), "allowed_token_ids")
        self.prompts.check_ids([token for token, _ in params.logit_bias], "logit_bias")
        deferred = self._deferred.pop(id(params), None)
        if prompt is None and params.prebuilt is not None:
            prompt = params.prebuilt
        if prompt is None:
            prompt = (
                deferred[1] if deferred is not None and deferred[0] is params else self.build_prompt(params)
            )
        if params.truncate_prompt_tokens is not None:
            prompt = self.prompts.truncated(
                prompt, params.truncate_prompt_tokens, self.max_model_len, params.max_tokens
            )
        return prompt, completion_budget(params, len(prompt.input_ids), self.max_model_len)

    def _session(
        self,
        params: ChatParams,
        prompt: ChatPrompt,
        budget: int,
        hidden: Tensor,
        seq: PagedSequence,
        pos: int,
    ) -> ReasonerSession:
        complete = seq.length == len(prompt.input_ids)  # else chunked: step_all computes the rest
        logits = self.transformer.compute_logits(hidden[-1:])[0] if complete else None
        bad_words = params.bad_word_ids
        if bad_words is None:  # (not tokenized by the API)
            bad_words = self.prompts.bad_word_ids(params.bad_words)
        sampler = TokenSampler.of(params, prompt.input_ids, bad_words)
        grammar = (
            None
            if params.structured is None
            else self.grammars.grammar(params.structured, params.think_first)
        )
        # (cast: ChatAdmission is only ever the Reasoner's base, whose sessions these are)
        session = ReasonerSession(cast("Reasoner", self), sampler, seq, logits, pos, prompt=prompt, started=self._started + 1,
                                  max_tokens=budget, stop=params.stop, ends=(params.ignore_eos, params.min_tokens,
                                  params.stop_token_ids, params.include_stop_str_in_output),
                                  top_logprobs=params.top_logprobs if params.logprobs else None,
                                  grammar=grammar, skip_special_tokens=params.skip_special_tokens)  # fmt: skip
        session.cached_tokens = seq.length - hidden.shape[0]  # (hidden: the rows computed)
        session.prefill_left = len(prompt.input_ids) - seq.length
        session.defer_stops_past_thoughts(params.stops_after_thoughts)
        if params.prompt_logprobs is not None:
            session.prompt_logprobs = prompt_logprobs(
                self.transformer, self.token_texts, prompt.input_ids, hidden, params.prompt_logprobs
            )
        self._started += 1
        self._open.append(session)  # counted once it exists: its close() takes it back (forget)
        return session
