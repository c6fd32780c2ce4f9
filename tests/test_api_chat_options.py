"""POST /v1/chat/completions request options on a real uvicorn (tiny Reasoner): constrained decoding fields
are refused with a 400 naming the field (never silently unconstrained output), and
`stream_options.continuous_usage_stats` puts the running usage on every streamed chunk, as vLLM does.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from serving_helpers import serve_app

MODEL = "test-model"
HI = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def url(tiny_ckpt, tmp_path_factory):
    """A uvicorn serving the tiny Reasoner (chat) over a FakeBackend engine; yields its base URL."""
    from transformers import AutoTokenizer

    from worldserve.api.app import build_app
    from worldserve.config import SchedulerConfig
    from worldserve.engine.client import EngineClient
    from worldserve.engine.engine import Engine
    from worldserve.engine.fake_backend import FakeBackend
    from worldserve.engine.jobs import JobStore
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    reasoner = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=4096)
    store = JobStore(tmp_path_factory.mktemp("chat-options") / "store")
    engine = Engine(FakeBackend(), store, SchedulerConfig(max_batch_size=1), encoder=lambda *a, **k: b"")
    client = EngineClient(engine, store, model_name=MODEL, max_queued_requests=16, chat_backend=reasoner)
    with serve_app(build_app(client, shutdown_timeout_s=1.0), name="test-chat-options-uvicorn") as base:
        yield base


def _stream(url: str, **body) -> list[dict]:
    """POST a streaming chat request -> the JSON payloads of its SSE events (checks the `[DONE]` ending)."""
    body = {"model": MODEL, "messages": HI, "stream": True, **body}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("structured_outputs", {"json": {"type": "object"}}),
        ("structured_outputs", {"regex": "[a-z]+"}),
        ("guided_json", {"type": "object", "properties": {"color": {"type": "string"}}}),
        ("guided_json", '{"type": "object"}'),
        ("guided_regex", "[a-z]+"),
        ("guided_choice", ["red", "blue"]),
        ("guided_grammar", 'root ::= "red" | "blue"'),
        ("structural_tag", '{"type": "structural_tag"}'),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_constrained_decoding_fields_are_refused(url, field, value, stream):
    """Each vLLM guided-decoding field, when set, is a 400 envelope naming it, streaming or not."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "stream": stream, field: value}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "Bad Request" and err["param"] == field, err
    assert field in err["message"] and "not supported" in err["message"], err


def test_constrained_decoding_through_the_openai_client(url):
    """The openai client's `extra_body` route (how users send vLLM extensions) gets the same 400."""
    import openai

    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, extra_body={"structured_outputs": {"choice": ["a", "b"]}}
        )
    assert info.value.status_code == 400 and info.value.body["param"] == "structured_outputs"


@pytest.mark.parametrize(
    "unset",
    [{"guided_json": None}, {"guided_choice": []}, {"guided_regex": ""}, {"structured_outputs": {}},
     {"structured_outputs": None, "guided_decoding_backend": None},
     {"guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": "[ ]*"}],
)  # fmt: skip
def test_null_or_empty_constrained_fields_are_ignored(url, unset):
    """Null or empty values ask for nothing, nor do the guided-decoding options without a constraint (vLLM
    ignores them then): the request is answered as without them."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, **unset}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"


def test_continuous_usage_stats_on_every_chunk(url):
    """include_usage + continuous_usage_stats: every chunk carries {prompt, completion, total} so far; the
    counts grow to the final usage chunk's, which matches the non-streaming answer's usage."""
    kw = {"max_tokens": 6, "temperature": 1.0, "seed": 5}
    payloads = _stream(url, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
    assert all("usage" in p and p["usage"] is not None for p in payloads), payloads
    usages = [p["usage"] for p in payloads]
    prompt = usages[0]["prompt_tokens"]
    assert prompt > 0 and usages[0]["completion_tokens"] == 0 and usages[0]["total_tokens"] == prompt
    for u in usages:
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"], u
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] > 0
    # content chunks count the tokens decoded so far: at least one token per chunk with text
    content = [p for p in payloads if p["choices"] and p["choices"][0]["delta"].get("content")]
    assert all(p["usage"]["completion_tokens"] >= 1 for p in content)
    finish = [p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and payloads[-1]["choices"] == []
    assert finish[0]["usage"] == payloads[-1]["usage"]
    full = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, **kw}, timeout=60)
    assert {k: v for k, v in full.json()["usage"].items() if v is not None} == {
        k: v for k, v in payloads[-1]["usage"].items() if v is not None
    }


def test_continuous_usage_stats_with_n_choices(url):
    """n > 1, as vLLM: a choice's chunk carries the prompt (counted once) and that choice's tokens so far;
    the final usage chunk sums the choices."""
    kw = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3}
    payloads = _stream(url, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
    assert all(p.get("usage") for p in payloads)
    *chunks, final = payloads
    assert final["choices"] == []
    prompt = final["usage"]["prompt_tokens"]
    last: dict[int, int] = {}
    for p in chunks:
        (choice,) = p["choices"]
        u = p["usage"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
        assert u["completion_tokens"] >= last.get(choice["index"], 0)  # each choice's own running count
        last[choice["index"]] = u["completion_tokens"]
    assert sorted(last) == [0, 1, 2]
    assert final["usage"]["completion_tokens"] == sum(last.values())
    assert final["usage"]["total_tokens"] == prompt + sum(last.values())


@pytest.mark.parametrize(
    ("options", "usage_chunks"),
    [
        ({"continuous_usage_stats": True}, 0),  # vLLM: continuous usage needs include_usage
        ({"include_usage": False, "continuous_usage_stats": True}, 0),
        ({"include_usage": True}, 1),  # only the final, choice-less chunk
        ({"include_usage": True, "continuous_usage_stats": False}, 1),
    ],
)
def test_usage_chunks_without_continuous_stats(url, options, usage_chunks):
    """Without include_usage no chunk carries usage; with it but not continuous, only the last chunk."""
    payloads = _stream(url, stream_options=options, max_tokens=3, seed=2)
    with_usage = [p for p in payloads if "usage" in p]
    assert len(with_usage) == usage_chunks
    if usage_chunks:
        assert with_usage[0] is payloads[-1] and payloads[-1]["choices"] == []


def test_stream_options_without_stream_is_a_400(url):
    """vLLM refuses stream_options on a non-streaming request; so does this server."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "Stream options can only be defined when `stream=True`." in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "stream_options"


def test_empty_stream_options_without_stream_is_accepted(url):
    """vLLM's rule tests stream_options for truthiness: an empty object on a non-streaming request is fine."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, "stream_options": {}}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
