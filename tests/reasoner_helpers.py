"""Test helper: run greedy Reasoner chats to the end, the way the chat worker steps them (all in one batch)."""

from __future__ import annotations

from worldserve.params import ChatMessage, ChatParams


def greedy_chats(reasoner, prompts, max_tokens: int, *, close: bool = False) -> list[list[int]]:
    """Start one greedy chat per prompt, step them together until all finish: each chat's token ids.
    `close`: close the sessions afterwards (frees their K/V and leaves the Reasoner's live count)."""
    sessions = [
        reasoner.start(ChatParams(messages=(ChatMessage(role="user", content=p),), max_tokens=max_tokens,
                                  temperature=0.0))
        for p in prompts
    ]  # fmt: skip
    live = list(sessions)
    while live:
        deltas = reasoner.step_all(live)
        live = [s for s, d in zip(live, deltas, strict=True) if d.finish_reason is None]
    if close:
        for s in sessions:
            s.close()
    return [s.token_ids for s in sessions]
