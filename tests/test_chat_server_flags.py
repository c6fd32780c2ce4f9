"""vLLM's chat server flags over real HTTP (the tiny Reasoner behind a real uvicorn and the `openai` client):
`--response-role` (the answer's role after a generation prompt; the last message's without one),
`--return-tokens-as-token-ids` (logprobs name tokens "token_id:<id>" unless a request says otherwise) and
`--enable-force-include-usage` (every streamed chunk carries usage, and a final usage chunk comes, whatever
stream_options say); the flags reach build_app from `serve`."""

from __future__ import annotations

import pytest
from serving_helpers import serve_reasoner
from test_serve_compat_flags import config

from worldserve.commands import serve

HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def oai(reasoner, tmp_path_factory):
    from openai import OpenAI

    folder = tmp_path_factory.mktemp("flags")
    with serve_reasoner(reasoner, folder, model="m", name="flags-uvicorn", response_role="bot", tokens_as_ids=True,
                        force_include_usage=True) as url:  # fmt: skip
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_flags_reach_the_app():
    options = serve.app_settings(config("--response-role", "bot", "--return-tokens-as-token-ids",
                                       "--enable-force-include-usage"))  # fmt: skip
    assert (options.response_role, options.tokens_as_ids, options.force_include_usage) == (
        "bot",
        True,
        True,
    )
    defaults = serve.app_settings(config())
    assert (defaults.response_role, defaults.tokens_as_ids, defaults.force_include_usage) == (
        "assistant",
        False,
        False,
    )


def test_answers_take_the_response_role_after_a_generation_prompt(oai):
    answer = oai.chat.completions.create(model="m", messages=HELLO, max_tokens=2, temperature=0)
    assert answer.choices[0].message.role == "bot"
    first = next(iter(oai.chat.completions.create(model="m", messages=HELLO, max_tokens=2, stream=True)))
    assert first.choices[0].delta.role == "bot"
    continued = oai.chat.completions.create(  # no generation prompt: the last message's role (vLLM's rule)
        model="m", messages=[*HELLO, {"role": "assistant", "content": "Hi"}], max_tokens=2,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )  # fmt: skip
    assert continued.choices[0].message.role == "assistant"


def test_logprobs_name_tokens_by_id_unless_a_request_says_otherwise(oai):
    kw = dict(model="m", messages=HELLO, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    named = oai.chat.completions.create(**kw).choices[0].logprobs.content
    assert all(
        e.token.startswith("token_id:") and e.top_logprobs[0].token.startswith("token_id:") for e in named
    )
    texts = oai.chat.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False})
    assert [e.token for e in texts.choices[0].logprobs.content] != [e.token for e in named]
    assert not any(e.token.startswith("token_id:") for e in texts.choices[0].logprobs.content)
    legacy = oai.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0, logprobs=1)
    assert all(t.startswith("token_id:") for t in legacy.choices[0].logprobs.tokens)


def test_streams_carry_usage_without_asking(oai):
    chunks = list(oai.chat.completions.create(model="m", messages=HELLO, max_tokens=3, stream=True))
    assert all(c.usage is not None for c in chunks)  # every chunk (continuous usage) ...
    assert (
        chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    )  # ... and the final usage chunk
    told_not_to = list(oai.chat.completions.create(model="m", messages=HELLO, max_tokens=3, stream=True,
                                                   stream_options={"include_usage": False}))  # fmt: skip
    assert told_not_to[-1].choices == [] and told_not_to[-1].usage is not None  # forced, as vLLM forces it
    text = list(oai.completions.create(model="m", prompt="Hello", max_tokens=3, stream=True))
    assert all(c.usage is not None for c in text) and text[-1].choices == []


def test_seed_makes_unseeded_requests_repeat_across_restarts(reasoner, tmp_path):
    """--seed: requests without a seed take the next seed of one sequence, so a fresh server (a restart)
    answers the same requests, in the same order, the same way; a request's own seed still wins."""
    from openai import OpenAI

    def run(folder, seeds):
        with serve_reasoner(reasoner, folder, model="m", name="seed-uvicorn", seed=seeds) as url:
            oai = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            kw = dict(model="m", max_tokens=6, temperature=1.0)
            chats = [
                oai.chat.completions.create(messages=HELLO, **kw).choices[0].message.content for _ in range(2)
            ]
            texts = [c.text for c in oai.completions.create(prompt=["Hello", "World"], **kw).choices]
            own = oai.chat.completions.create(messages=HELLO, seed=11, **kw).choices[0].message.content
            return chats, texts, own

    first = run(tmp_path / "a", 7)
    assert run(tmp_path / "b", 7) == first  # the restart answers alike
    assert first[0][0] != first[0][1]  # one sequence: each request its own seed
    other = run(tmp_path / "c", 8)
    assert other[:2] != first[:2] and other[2] == first[2]  # another sequence; a request's seed wins
    assert serve.app_settings(config("--seed", "5")).seed == 5 and serve.app_settings(config()).seed is None
    with pytest.raises(ValueError, match="--seed must be in"):
        config("--seed", str(2**63))
