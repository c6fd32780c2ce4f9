"""The prompt tokens found in the Reasoner's prefix cache, reported as vLLM reports them: chat and text
completions' `usage.prompt_tokens_details.cached_tokens` with `--enable-prompt-tokens-details` (null without
it), the Responses API's `usage.input_tokens_details.cached_tokens` always; over real HTTP, streamed and not,
with the `openai` client. The first request of a prompt finds nothing; the same prompt again finds its full
64-token blocks (its last token is always computed)."""

from __future__ import annotations

import pytest
from openai import OpenAI
from serving_helpers import serve_reasoner

MODEL = "test-model"
LONG = "Tell me about the snowy forest at dawn, the fox, the hare and the light on the frozen river. " * 3


@pytest.fixture(scope="module")
def clients(reasoner, tmp_path_factory):
    """(with --enable-prompt-tokens-details, without it): openai clients of two servers over one Reasoner."""
    with (
        serve_reasoner(reasoner, tmp_path_factory.mktemp("on"), model=MODEL, name="details-on",
                       prompt_tokens_details=True) as on,
        serve_reasoner(reasoner, tmp_path_factory.mktemp("off"), model=MODEL, name="details-off") as off,
    ):  # fmt: skip
        yield tuple(OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) for url in (on, off))


def full_blocks(reasoner, tokens: int) -> int:
    return (tokens - 1) // reasoner.pool.block_size * reasoner.pool.block_size


def test_chat_usage_names_the_cached_prompt_tokens(clients, reasoner):
    on, off = clients
    messages = [{"role": "user", "content": LONG + " (chat)"}]
    first = on.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = on.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    cached = full_blocks(reasoner, again.usage.prompt_tokens)
    assert cached >= 64 and again.usage.prompt_tokens_details.cached_tokens == cached
    chunks = list(on.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                             stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert (
        off.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).usage.prompt_tokens_details
        is None
    )


def test_completions_and_responses_usage(clients, reasoner):
    on, off = clients
    prompt = LONG + " (completion)"
    on.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = on.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks(reasoner, again.usage.prompt_tokens)
    text = LONG + " (responses)"
    off.responses.create(model=MODEL, input=text, max_output_tokens=2)
    answer = off.responses.create(model=MODEL, input=text, max_output_tokens=2)
    cached = answer.usage.input_tokens_details.cached_tokens
    assert cached == full_blocks(reasoner, answer.usage.input_tokens) and cached >= 64
