"""The thought tokens in usage, as vLLM reports them with a reasoning parser: chat completions'
`usage.completion_tokens_details.reasoning_tokens` (summed over the choices; streamed, on the final usage chunk
only; null without --reasoning-parser, and then absent from the final usage chunk) and the Responses API's
`usage.output_tokens_details.reasoning_tokens`. Over real HTTP with the `openai` client on the tiny Reasoner
(answers forced by a regex, as a random model writes no <think> of its own); the expected counts are read off
the answers' own tokens (their logprobs entries): those between <think> and </think>, the tags not counted.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from serving_helpers import serve_reasoner

MODEL = "test-model"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
THOUGHT = "<think>\\nBecause of Rayleigh scattering\\.\\n</think>\\n\\n(Blue|Azure)\\."
FORCED = {"structured_outputs": {"regex": THOUGHT}}


@pytest.fixture(scope="module")
def urls(reasoner, tmp_path_factory):
    """(with --reasoning-parser qwen3, without it): two servers over one Reasoner."""
    with (
        serve_reasoner(reasoner, tmp_path_factory.mktemp("parser"), model=MODEL, name="thoughts-parser",
                       reasoning_parser="qwen3") as on,
        serve_reasoner(reasoner, tmp_path_factory.mktemp("plain"), model=MODEL, name="thoughts-plain") as off,
    ):  # fmt: skip
        yield on, off


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _thoughts(choice) -> int:
    """The tokens between the answer's <think> and its </think> (to its end when it never closes)."""
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[0] == "<think>", tokens
    return (tokens.index("</think>") if "</think>" in tokens else len(tokens)) - 1


def _chat(url: str, **kw):
    extra = {**FORCED, **kw.pop("extra_body", {})}
    kw = {"max_tokens": 60, **kw}
    return _client(url).chat.completions.create(
        model=MODEL, messages=ASK, logprobs=True, extra_body=extra, **kw
    )


def test_chat_usage_counts_the_thought_tokens(urls, reasoner):
    """The thoughts' own tokens, every choice's summed; dropped thoughts (include_reasoning false) still count,
    as vLLM counts them; an answer without <think> has none; one cut by max_tokens inside its thoughts has all
    its tokens after <think>."""
    on, _ = urls
    one = _chat(on, temperature=0)
    expected = _thoughts(one.choices[0])
    assert one.choices[0].message.content in ("\n\nBlue.", "\n\nAzure.") and expected > 0
    assert one.usage.completion_tokens_details.reasoning_tokens == expected
    two = _chat(on, n=2, seed=5)
    assert two.usage.completion_tokens_details.reasoning_tokens == sum(_thoughts(c) for c in two.choices)
    hidden = _chat(on, temperature=0, extra_body={"include_reasoning": False})
    assert hidden.usage.completion_tokens_details.reasoning_tokens == expected
    cut = _chat(on, temperature=0, max_tokens=4)
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens_details.reasoning_tokens == 3 == _thoughts(cut.choices[0])
    no_think = {str(reasoner.grammars.think_ids[0]): -100}  # a grammar's answer could open with <think>
    plain = _chat(on, extra_body={"structured_outputs": {"regex": "(Blue|Azure)\\."}}, logit_bias=no_think)
    assert plain.choices[0].message.content in ("Blue.", "Azure.")
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_streamed_usage_counts_them_on_the_final_chunk(urls):
    """Streamed: the final usage chunk has the count (the unstreamed answer's); the per-chunk usage of
    continuous_usage_stats leaves it out (vLLM's has the thoughts so far: here they are counted at the answer's
    end)."""
    on, _ = urls
    expected = _thoughts(_chat(on, temperature=0).choices[0])
    body = {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, "stream": True, **FORCED,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", on + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    *per_chunk, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": expected
    }
    assert per_chunk and all("completion_tokens_details" not in c["usage"] for c in per_chunk)
    streamed = list(_client(on).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=FORCED,
    ))  # fmt: skip
    assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == expected


def test_no_details_without_a_reasoning_parser(urls):
    """Without --reasoning-parser, vLLM reports no completion_tokens_details: null in the answer, absent from
    the streamed usage chunk."""
    _, off = urls
    assert _chat(off, temperature=0).usage.completion_tokens_details is None
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **FORCED}
    answer = httpx.post(off + "/v1/chat/completions", json=body, timeout=60).json()
    assert (
        "completion_tokens_details" in answer["usage"]
        and answer["usage"]["completion_tokens_details"] is None
    )
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", off + "/v1/chat/completions", json=body, timeout=60) as r:
        final = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert final["usage"]["completion_tokens"] > 0 and "completion_tokens_details" not in final["usage"]


def test_responses_usage_counts_the_same_tokens(urls):
    """The Responses API's output_tokens_details.reasoning_tokens: the chat's count of the same answer (0
    without a reasoning parser)."""
    on, off = urls
    expected = _thoughts(_chat(on, temperature=0).choices[0])
    for url, count in ((on, expected), (off, 0)):
        for stream in (False, True):
            kw = {"model": MODEL, "input": ASK[0]["content"], "max_output_tokens": 60, "temperature": 0,
                  "extra_body": FORCED}  # fmt: skip
            if stream:
                events = list(_client(url).responses.create(stream=True, **kw))
                response = events[-1].response
            else:
                response = _client(url).responses.create(**kw)
            assert response.usage.output_tokens_details.reasoning_tokens == count, (url, stream)


def test_thought_tokens_follow_the_parsers_split(reasoner):
    """The count the runner puts on the last delta: the thoughts of an answer that opens with <think> (after
    whitespace, or special tokens its text leaves out), to </think> or the end; 0 for any other answer."""
    from worldserve.runner.reasoner_session import thought_tokens

    tok = reasoner.tokenizer

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    thought = ids("Because of Rayleigh scattering.")
    assert thought_tokens(ids("<think>") + thought + ids("</think>Blue."), tok) == len(thought)
    assert thought_tokens(ids("\n\n<think>") + thought + ids("</think>"), tok) == len(thought)
    assert thought_tokens(ids("<think>") + thought, tok) == len(thought)  # cut by max_tokens
    assert thought_tokens(ids("Blue. <think>") + thought + ids("</think>"), tok) == 0
    special = ids("<|vision_start|><think>") + thought + ids("</think>")
    assert thought_tokens(special, tok) == len(thought)
    assert thought_tokens(special, tok, skip_special_tokens=False) == 0
    assert thought_tokens([], tok) == 0
