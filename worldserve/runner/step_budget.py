"""One token budget per iteration of the Reasoner: vLLM's --max-num-batched-tokens, shared by everything an
iteration of the chat worker computes (an admission pass, Reasoner.start_many, then a step, Reasoner.step_all).

vLLM fills each engine step from one budget of max_num_batched_tokens: the running requests first (a decode
takes a token, a chunked prefill under way its next chunk), then the waiting ones (preempted requests, then new
ones; with chunked prefill the last new prompt is cut to what is left). The chat worker admits new chats before
it steps the running ones, so the Reasoner splits the budget ahead, in vLLM's order of priority:
- an admission pass (`admission` -> PassBudget) gets what the next step's running sessions leave: the budget
  less a token for each decoding session, less the next chunks of the prefilling ones (oldest first; with its
  decode when a chunk is the last), less the tokens earlier passes computed since the last step. It admits chats
  in order while their uncached prompt tokens and a decode each fit; the first that does not fit is chunked to
  the rest, unless it must prefill whole (a choice forking an earlier chat's K/V, one asking for prompt
  logprobs) or the pass already does (it holds such a chat), and the later ones wait. With nothing running,
  the first chat always goes (chunked to the budget when longer); one that must prefill whole goes whole when
  it is the first of its pass (over the budget for that iteration: waiting for room it could starve behind
  steady decodes), else waits for the next pass.
- a step (`begin`, `chunk`, `resume_budget`, `spend`): each decoding session takes a token; the prefilling
  sessions' chunks (oldest first: a younger one gets what the older ones' chunks leave, as vLLM's running
  prefills do), then the resumes of preempted sessions (oldest first), share what the decodes and the
  admission passes left; what does not fit waits for a later step (a resume stays on the wait list).
A prefill that completes in a step also decodes its first token there (step_all samples it at once), so a chunk
or resume ends only where a token is left for that decode. Progress: in a step that follows no admission, the
chunk gets at least a token, and so does the first resume when nothing else but decodes computed, so a prefill
advances even when the decodes take the whole budget.
Without chunked prefill, prompts and resumes prefill whole, as before: a pass admits whole prompts up to the
budget (a longer one alone), whatever runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def grant(todo: int, left: int) -> int:
    """Tokens of a prefill with `todo` tokens to go that fit in `left`: all of them when its first decode fits
    too, else as many as fit short of its last token (which waits for a step with room for the decode)."""
    return todo if todo < left else max(0, min(todo - 1, left))


def decoding(sessions: Sequence[Any]) -> int:
    """The sessions that decode a token in a step (neither preempted, nor prefilling, nor finished)."""
    return sum(not (s.preempted or s.prefilling) and s.finish_reason is None for s in sessions)


class StepBudget:
    """The Reasoner's token budget of one iteration (module docstring)."""

    def __init__(self, tokens: int, chunked: bool) -> None:
        self.tokens = tokens  # max_num_batched_tokens
        self.chunked = chunked
        self.admitted = 0  # prompt tokens admission passes computed since the last step
        self.left = tokens  # in a step: tokens not taken yet
        self.force = False  # in a step: nothing but decodes computed so far (a prefill gets at least a token)

    # ------------------------------------------------------------------ admission
    def admission(self, sessions: Sequence[Any] | None) -> PassBudget:
        """The budget of an admission pass beside the open `sessions` (None: a pass of its own, start(), which
        prefills to the end anyway: the whole budget)."""
        if sessions is None:
            return PassBudget(self.tokens, chunked=self.chunked, alone=True)
        if not sessions:  # nothing runs: an earlier pass's chats are gone (failed), and no step follows it
            self.admitted = 0
        reserved = decoding(sessions)
        # the prefilling sessions' next chunks, oldest first, as the step will compute them (the oldest gets at
        # least a token)
        for i, s in enumerate(sorted((s for s in sessions if s.prefilling), key=lambda s: s.started)):
            n = grant(s.prefill_left, self.tokens - reserved)
            if i == 0:
                n = max(1, n)
            elif not n:
                break
            reserved += n + (n == s.prefill_left)
        room = self.tokens - reserved - self.admitted
        return PassBudget(room, chunked=self.chunked, alone=not reserved and not self.admitted)

    # ------------------------------------------------------------------ step
    def begin(self, decodes: int) -> None:
        """A step with `decodes` decoding sessions starts: what is left for its chunk and resumes."""
        self.left = self.tokens - decodes - self.admitted
        self.force = not self.admitted

    def chunk(self, todo: int) -> int:
        """Tokens of a prefilling session's next chunk (`todo` to go; the oldest asks first); 0: none this
        step."""
        n = grant(todo, self.left)
        return max(n, 1) if self.force else n

    def resume_budget(self) -> int | None:
        """Tokens a resume may prefill now, one kept for its decode (0: it waits; None: whole, no chunking)."""
        if not self.chunked:
            return None
        return max(1, self.left - 1) if self.force else max(0, self.left - 1)

    def spend(self, tokens: int) -> None:
        """A chunk or resume computed `tokens` (its decode included when it completed)."""
        self.left -= tokens
        self.force = False

    def end(self) -> None:
        """The step is over: the next iteration's admissions start from nothing."""
        self.admitted = 0


class PassBudget:
    """One admission pass's share of the iteration's budget: which chats it admits, and its prefill's budget."""

    def __init__(self, room: int, *, chunked: bool, alone: bool) -> None:
        self.room = room  # tokens the pass may take (its chats' first decodes included)
        self.chunked = chunked
        self.alone = alone  # nothing runs: the first chat goes whatever its length
        self.tokens = 0  # prompt tokens its chats compute
        self.decodes = 0  # chats prefilled to their end: each decodes its first token in the step
        self.cut = False  # its last chat is chunked (or over the room, alone): no more chats

    def admit(self, new: int, *, chunkable: bool, first: bool) -> bool:
        """Whether a chat with `new` uncached prompt tokens is admitted (counted if so). `chunkable`: it may be
        cut, and the pass prefilled in chunks; `first`: no chat is admitted yet."""
        if not self.chunked:  # whole prompts up to the budget, a longer one alone
            if first or self.tokens + new <= self.room:
                self.tokens += new
                return True
            return False
        if self.cut:
            return False
        if self.tokens + self.decodes + new + 1 <= self.room:
            self.tokens += new
            self.decodes += 1
            return True
        take = grant(new, self.room - self.tokens - self.decodes)
        if chunkable and take >= 1:  # vLLM's new request chunked to the budget left
            self.tokens += take
            self.cut = True
            return True
        if first and (self.alone or not chunkable):
            # prefilled whole although over the budget: nothing else runs, or it cannot be chunked (prompt
            # logprobs) and would otherwise wait for every running chat to end: starved under steady load
            self.tokens += new
            self.cut = True
            return True
        return False

    @property
    def limit(self) -> int:
        """The budget of the pass's prefill (UndPrefill's), when it may be chunked."""
        return self.tokens if self.cut else self.room - self.decodes
