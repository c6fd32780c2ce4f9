"""The token that ends a chat, over HTTP (the tiny Reasoner behind the real `openai` client), as vLLM answers it:
it has the last logprobs entry (chat `logprobs.content`, the completions' legacy logprobs: vLLM's logprobs
are parallel to its output token ids, the ending token kept), streamed (in the choice's last chunks, with
its finish_reason) as not; its text is in the output only with `include_stop_str_in_output`
(vllm/v1/engine/detokenizer.py: a stop-terminated request skips the last token's detokenization unless the
request includes the stop string). The ending token here is a request's stop token id: the greedy answer's
4th token.
"""

from __future__ import annotations

import pytest
from reasoner_helpers import run_to_end

from worldserve.chat_params import ChatMessage, ChatParams

MODEL = "test-model"
QUESTION = "Tell me a story."


@pytest.fixture(scope="module")
def ending(reasoner):
    """(the stop token id, the greedy answer's first 4 token ids, the Reasoner's own logprobs entries of a
    chat that this id ends at its 4th token, top 2)."""
    msgs = (ChatMessage(role="user", content=QUESTION),)
    _, free = run_to_end(reasoner, ChatParams(messages=msgs, temperature=0.0, max_tokens=6))
    tokens = free.token_ids[:4]
    assert tokens[3] not in tokens[:3], "pick another question: the stop id comes earlier"
    session = reasoner.start(ChatParams(messages=msgs, temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=2,
                                        stop_token_ids=(tokens[3],)))  # fmt: skip
    entries = []
    while session.finish_reason is None:
        entries += session.step().logprobs
    assert session.stop_reason == tokens[3]
    return tokens[3], tokens, entries


def _chat(oai, stop_id, **kw):
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"stop_token_ids": [stop_id], **kw.pop("extra", {})}, **kw)  # fmt: skip


def test_chat_answers_the_ending_tokens_logprob_streamed_and_not(reasoner_oai, reasoner, ending):
    stop_id, tokens, entries = ending
    decode = reasoner.tokenizer.decode
    resp = _chat(reasoner_oai, stop_id)
    (choice,) = resp.choices
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop_id)
    assert choice.message.content == decode(tokens[:3])
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens == 4
    assert [e.token for e in content] == [decode([t]) for t in tokens] == [e.token for e in entries]
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert [t.logprob for e in content for t in e.top_logprobs] == pytest.approx(
        [v for e in entries for _, v in e.top], abs=1e-5
    )
    chunks = [c for c in _chat(reasoner_oai, stop_id, stream=True) if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [
        (e.token, e.logprob, e.top_logprobs) for e in content
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    # the ending token's entry (no text) goes out in the choice's last chunks, the last with the finish_reason
    *_, lp_chunk, last = chunks
    assert [e.token for e in lp_chunk.choices[0].logprobs.content] == [content[-1].token]
    assert lp_chunk.choices[0].delta.content == ""
    assert (last.choices[0].finish_reason, last.choices[0].model_extra["stop_reason"]) == ("stop", stop_id)


def test_chat_include_stop_str_in_output_keeps_the_stop_tokens_text(reasoner_oai, reasoner, ending):
    stop_id, tokens, _ = ending
    extra = {"include_stop_str_in_output": True}
    resp = _chat(reasoner_oai, stop_id, extra=extra)
    assert resp.choices[0].message.content == reasoner.tokenizer.decode(tokens)
    assert len(resp.choices[0].logprobs.content) == resp.usage.completion_tokens == 4
    chunks = [c for c in _chat(reasoner_oai, stop_id, stream=True, extra=extra) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == resp.choices[0].message.content


def test_completions_answer_the_ending_tokens_logprob_and_text(reasoner_oai, reasoner, ending):
    """Legacy logprobs: the ending token's text, log-probability and top dict last, at text_offset the running
    sum of the token texts (the streamed chunk's: the text sent before it); include_stop_str_in_output adds
    its text to the choice's."""
    stop_id, tokens, entries = ending
    decode = reasoner.tokenizer.decode
    ids = reasoner.build_prompt(ChatParams(messages=(ChatMessage(role="user", content=QUESTION),))).input_ids
    kw = dict(model=MODEL, prompt=list(ids), max_tokens=6, temperature=0, logprobs=2)
    extra = {"stop_token_ids": [stop_id]}
    resp = reasoner_oai.completions.create(extra_body=extra, **kw)
    (choice,) = resp.choices
    assert choice.text == decode(tokens[:3]) and choice.finish_reason == "stop"
    lp = choice.logprobs
    assert lp.tokens == [e.token for e in entries] and len(lp.tokens) == resp.usage.completion_tokens == 4
    assert lp.token_logprobs == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert lp.top_logprobs[-1][lp.tokens[-1]] == pytest.approx(lp.token_logprobs[-1])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    chunks = list(reasoner_oai.completions.create(stream=True, extra_body=extra, **kw))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [x for p in parts for x in p.token_logprobs] == pytest.approx(lp.token_logprobs)
    last = chunks[-1].choices[0]
    assert (last.text, last.logprobs.tokens, last.finish_reason) == ("", [lp.tokens[-1]], "stop")
    assert last.logprobs.text_offset == [len(choice.text)]
    extra["include_stop_str_in_output"] = True
    kept = reasoner_oai.completions.create(extra_body=extra, **kw).choices[0]
    assert kept.text == decode(tokens) and kept.logprobs.tokens == lp.tokens
    chunks = list(reasoner_oai.completions.create(stream=True, extra_body=extra, **kw))
    assert "".join(c.choices[0].text for c in chunks) == kept.text
