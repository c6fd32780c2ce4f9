"""A chat whose token rules and structured output leave no token allowed mid-answer fails (tiny Reasoner):
`sample_tokens` reports the row, and the Reasoner ends that chat with finish_reason "error" and a ParamError
naming the rule (vLLM fails such a request: its grammar rejects the token drawn), never setting the rules
aside; the rows beside it keep sampling.
"""

from __future__ import annotations

import logging

import torch

from worldserve.chat_params import ChatMessage, ChatParams, StructuredOutput
from worldserve.sampling.tokens import TokenSampler, sample_tokens

HI = (ChatMessage(role="user", content="hi"),)


def _id(reasoner, text: str) -> int:
    ids = reasoner.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_rules_and_a_grammar_that_leave_no_second_token_fail_the_chat(reasoner):
    """allowed_token_ids "a" and "b" with the grammar a[0-9]: "a" starts the answer under both, then the
    grammar wants a digit and the ids allow none: the chat ends with "error", its failure naming
    allowed_token_ids (the rules used to step aside and a digit came out); a chat beside it is untouched."""
    allowed = (_id(reasoner, "a"), _id(reasoner, "b"))
    so = StructuredOutput(kind="regex", spec="a[0-9]")
    stuck = reasoner.start(ChatParams(messages=HI, structured=so, allowed_token_ids=allowed, max_tokens=8,
                                      temperature=0.0))  # fmt: skip
    free = reasoner.start(ChatParams(messages=HI, structured=so, max_tokens=8, temperature=0.0))
    first, _ = reasoner.step_all([stuck, free])
    assert first.finish_reason is None and stuck.token_ids == [allowed[0]], stuck.token_ids
    second, other = reasoner.step_all([stuck, free])
    assert second.finish_reason == "error" and second.text == "", second
    assert stuck.failure is not None and stuck.failure.param == "allowed_token_ids", stuck.failure
    assert "structured output" in stuck.failure.message and "after 1 tokens" in stuck.failure.message
    assert other.finish_reason is None or other.finish_reason == "stop"
    while free.finish_reason is None:
        free.step()
    assert free.finish_reason == "stop" and free.failure is None


def test_sample_tokens_reports_the_rows_left_with_no_token_to_a_caller_that_asks():
    """Given `conflicts`, the rows whose rules empty them are listed there and no warning is logged; the
    other rows keep their rules."""
    logits = torch.randn(3, 64)
    logits[0, :32] = float("-inf")  # e.g. a grammar allowing only ids 32..63
    samplers = [TokenSampler(temperature=0, allowed_token_ids=(3, 5)), TokenSampler(temperature=0,
                allowed_token_ids=(40, 41), bad_words=((40,),)), TokenSampler(temperature=0)]  # fmt: skip
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("worldserve.sampling.tokens")
    logger.addHandler(handler)
    conflicts: list[int] = []
    try:
        tokens = sample_tokens(samplers, logits, conflicts=conflicts)
    finally:
        logger.removeHandler(handler)
    assert conflicts == [0] and warnings == []
    assert tokens[1:] == [41, int(logits[2].argmax())]


def test_allowed_ids_all_banned_by_bad_words_name_bad_words_not_min_tokens(reasoner):
    """allowed_token_ids ("a" alone) that bad_words bans, with no grammar and no min_tokens: the failure
    names the two rules that conflict (it had blamed min_tokens, which the request never set)."""
    only_a = (_id(reasoner, "a"),)
    stuck = reasoner.start(ChatParams(messages=HI, allowed_token_ids=only_a, bad_words=("a",), max_tokens=4,
                                      temperature=0.0))  # fmt: skip
    (delta,) = reasoner.step_all([stuck])
    assert delta.finish_reason == "error" and stuck.failure is not None
    assert stuck.failure.param == "allowed_token_ids"
    assert "that bad_words allows" in stuck.failure.message and "min_tokens" not in stuck.failure.message
