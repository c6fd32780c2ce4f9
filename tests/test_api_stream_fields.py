"""Which fields streamed chat and text completion chunks carry, read off the raw SSE lines (httpx), against what
vLLM writes: it dumps a chunk with exclude_unset (what its serving code does not set is left out, what it sets
to None is null) and the final usage chunk with exclude_none too (vllm/entrypoints/openai/chat_completion/
serving.py, completion/serving.py). So: stop_reason only on a chat choice's final chunk (a text completion sets
it on every chunk); `usage` only with continuous_usage_stats or on the final usage chunk; a chunk's own usage
without prompt_tokens_details, even with --enable-prompt-tokens-details (a chat's with completion_tokens_details
null without --reasoning-parser); the final usage chunk without null fields (prompt_tokens_details only with
the flag, completion_tokens_details only with a reasoning parser); no prompt_logprobs on text completion chunks
(vLLM refuses them above 0 with stream). vLLM's token-id tracing fields (`prompt_token_ids`, `token_ids`, null unless
`return_token_ids`), which this server does not serve, are not written.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serving_helpers import serve_reasoner

MODEL = "test-model"
TOP = {"id", "object", "created", "model", "choices"}
COUNTS = {"prompt_tokens", "total_tokens", "completion_tokens"}
CHAT_CHOICE = {"index", "delta", "logprobs", "finish_reason"}
TEXT_CHOICE = {"index", "text", "logprobs", "finish_reason", "stop_reason"}
BOTH = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def urls(reasoner, tmp_path_factory):
    """{"plain", "details" (--enable-prompt-tokens-details), "thinking" (--reasoning-parser qwen3)}: URLs of
    servers over one tiny Reasoner."""
    with (
        serve_reasoner(reasoner, tmp_path_factory.mktemp("plain"), model=MODEL, name="fields-plain") as plain,
        serve_reasoner(reasoner, tmp_path_factory.mktemp("details"), model=MODEL, name="fields-details",
                       prompt_tokens_details=True) as details,
        serve_reasoner(reasoner, tmp_path_factory.mktemp("thinking"), model=MODEL, name="fields-thinking",
                       reasoning_parser="qwen3") as thinking,
    ):  # fmt: skip
        yield {"plain": plain, "details": details, "thinking": thinking}


def _chunks(url: str, path: str, **body) -> list[dict]:
    """The JSON payloads of a streamed request's raw SSE lines (its `data: [DONE]` checked). Every choice gets
    exactly 3 tokens (min_tokens: the random tiny model, sampling unseeded, may draw a stop token first)."""
    body = {"model": MODEL, "max_tokens": 3, "min_tokens": 3, "stream": True, **body}
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def _chat(url: str, **body) -> list[dict]:
    return _chunks(
        url, "/v1/chat/completions", messages=[{"role": "user", "content": "Name a color."}], **body
    )


def _nulls(value, path: str = "") -> list[str]:
    """The paths of the null values in `value`."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nulls(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _nulls(v, f"{path}[{i}]")]
    return [path] if value is None else []


@pytest.mark.parametrize("server", ["plain", "details", "thinking"])
def test_chat_chunks(urls, server):
    """Choice chunks: no stop_reason before the final one, no usage; the final usage chunk: its counts, the
    prompt's details with the flag, the thoughts with a parser, nothing null."""
    *chunks, final = _chat(urls[server], stream_options={"include_usage": True}, logprobs=True)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *middle, last = chunks
    for chunk in middle:
        assert set(chunk) == TOP and set(chunk["choices"][0]) == CHAT_CHOICE, chunk
    assert set(last) == TOP and set(last["choices"][0]) == CHAT_CHOICE | {"stop_reason"}, last
    assert last["choices"][0]["finish_reason"] == "length"
    assert any(c["choices"][0]["logprobs"] for c in middle)  # set when there are some, null on the role chunk
    assert set(final) == TOP | {"usage"} and final["choices"] == [] and not _nulls(final), final
    details = {"details": {"prompt_tokens_details"}, "thinking": {"completion_tokens_details"}}.get(
        server, set()
    )
    assert set(final["usage"]) == COUNTS | details, final
    if server == "details":
        assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("server", ["plain", "details", "thinking"])
def test_chat_chunks_with_continuous_usage(urls, server):
    """Each choice chunk's usage: its counts and completion_tokens_details (null without a reasoning parser; with
    one vLLM counts the thoughts so far, which come at the answer's end here: left out), never the prompt's
    details; the final usage chunk as without continuous_usage_stats."""
    *chunks, final = _chat(urls[server], stream_options=BOTH, n=2)
    thoughts = set() if server == "thinking" else {"completion_tokens_details"}
    for chunk in chunks:
        assert set(chunk) == TOP | {"usage"} and set(chunk["usage"]) == COUNTS | thoughts, chunk
        finished = chunk["choices"][0]["finish_reason"] is not None
        assert set(chunk["choices"][0]) == CHAT_CHOICE | ({"stop_reason"} if finished else set())
        assert _nulls(chunk["usage"]) == [".completion_tokens_details"] * bool(thoughts)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert not _nulls(final) and set(final["usage"]) >= COUNTS
    assert final["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("server", ["plain", "details"])
def test_text_completion_chunks(urls, server):
    """Text completions: every chunk's choice has stop_reason (vLLM sets it on each) and no prompt_logprobs;
    a chunk's own usage has the counts only; the final usage chunk has no null field."""
    for options in ({"include_usage": True}, BOTH):
        *chunks, final = _chunks(urls[server], "/v1/completions", prompt="A red fox", stream_options=options)
        assert chunks, final
        for chunk in chunks:
            assert set(chunk) == TOP | ({"usage"} if options is BOTH else set()), chunk
            assert set(chunk["choices"][0]) == TEXT_CHOICE, chunk
            assert options is not BOTH or set(chunk["usage"]) == COUNTS
        assert set(final) == TOP | {"usage"} and final["choices"] == [] and not _nulls(final), final
        assert set(final["usage"]) == COUNTS | ({"prompt_tokens_details"} if server == "details" else set())


def test_text_completion_chunks_never_carry_prompt_logprobs(urls):
    """vLLM's prompt_logprobs with stream: 0 is taken and no chunk carries prompt logprobs (vLLM's chunks have
    none); above 0 it is refused, as vLLM's request validator does (test_api_completions)."""
    *chunks, _ = _chunks(urls["plain"], "/v1/completions", prompt="A red fox", prompt_logprobs=0,
                         stream_options={"include_usage": True})  # fmt: skip
    assert chunks and all(set(c["choices"][0]) == TEXT_CHOICE for c in chunks)
