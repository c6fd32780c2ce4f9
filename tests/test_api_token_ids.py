"""vLLM's token-id options on the tiny Reasoner over a real uvicorn: `return_token_ids` (the prompt's ids and
each choice's sampled ids beside the text; streamed: the prompt's in the first chunk, each chunk's own ids)
and `return_tokens_as_token_ids` (logprobs name their tokens "token_id:<id>"), on chat and text completions."""

from __future__ import annotations

import json

import httpx

MODEL = "test-model"
GREEDY = {"model": MODEL, "max_tokens": 6, "min_tokens": 6, "temperature": 0}


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def test_chat_returns_the_prompt_and_output_token_ids(reasoner_url, reasoner):
    chat = {**GREEDY, "messages": [{"role": "user", "content": "Name a color."}], "return_token_ids": True}
    answer = httpx.post(reasoner_url + "/v1/chat/completions", json=chat, timeout=60).json()
    rendered = httpx.post(
        reasoner_url + "/tokenize", json={"model": MODEL, "messages": chat["messages"]}
    ).json()
    assert answer["prompt_token_ids"] == rendered["tokens"]  # the rendered prompt, as /tokenize renders it
    [choice] = answer["choices"]
    ids = choice["token_ids"]
    assert len(ids) == answer["usage"]["completion_tokens"] == 6
    # (a character the last tokens leave unfinished stays out of the text)
    assert (
        reasoner.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        == choice["message"]["content"]
    )
    # streamed: the prompt's ids in the first chunk only, each chunk's ids; together the same tokens
    chunks = _sse(reasoner_url, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == rendered["tokens"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == ids
    # without the option none of these fields is set (nulls in the whole answer, left out of chunks)
    plain = httpx.post(reasoner_url + "/v1/chat/completions", json={**chat, "return_token_ids": None}).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    assert all("token_ids" not in c["choices"][0] for c in _sse(reasoner_url, "/v1/chat/completions",
               {**chat, "return_token_ids": False}))  # fmt: skip


def test_chat_logprobs_name_tokens_by_id(reasoner_url):
    chat = {**GREEDY, "messages": [{"role": "user", "content": "Name a color."}], "logprobs": True,
            "top_logprobs": 3, "return_token_ids": True}  # fmt: skip
    by_text = httpx.post(reasoner_url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    by_id = httpx.post(
        reasoner_url + "/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": True}, timeout=60
    ).json()["choices"][0]  # fmt: skip
    items = by_id["logprobs"]["content"]
    assert [it["token"] for it in items] == [f"token_id:{i}" for i in by_id["token_ids"]]
    assert all(it["bytes"] == list(it["token"].encode()) for it in items)
    assert all(t["token"].startswith("token_id:") for it in items for t in it["top_logprobs"])
    # the same numbers as under the tokens' texts
    assert [it["logprob"] for it in items] == [it["logprob"] for it in by_text["logprobs"]["content"]]
    streamed = _sse(reasoner_url, "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": True})
    tokens = [
        it["token"]
        for c in streamed
        if c["choices"][0].get("logprobs")
        for it in c["choices"][0]["logprobs"]["content"]
    ]
    assert tokens == [it["token"] for it in items]


def test_text_completions_return_token_ids_per_choice(reasoner_url, reasoner):
    body = {**GREEDY, "prompt": ["A red fox", "hello"], "return_token_ids": True, "logprobs": 2,
            "return_tokens_as_token_ids": True}  # fmt: skip
    answer = httpx.post(reasoner_url + "/v1/completions", json=body, timeout=60).json()
    for choice, prompt in zip(answer["choices"], body["prompt"], strict=True):
        assert choice["prompt_token_ids"] == list(reasoner.tokenizer(prompt)["input_ids"])
        assert len(choice["token_ids"]) == 6
        assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]
        assert all(all(k.startswith("token_id:") for k in top) for top in choice["logprobs"]["top_logprobs"])
    chunks = _sse(reasoner_url, "/v1/completions", body)
    for index, choice in enumerate(answer["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [i for c in mine for i in c["token_ids"]] == choice["token_ids"]
