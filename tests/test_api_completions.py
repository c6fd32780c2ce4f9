"""POST /v1/completions, /tokenize and /detokenize end to end on a real uvicorn (the tiny Reasoner) behind the
real `openai` client: raw prompts (text, token ids, lists of either) answer what the Reasoner answers for the
same ids, n choices per prompt, streaming, legacy logprobs, stop strings, echo; /tokenize counts a chat's
prompt (an image included) as a chat completion does; /detokenize round-trips; bad requests are 4xx envelopes
naming their field; a server without the Reasoner, or shutting down, answers as chat does.
"""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch
from reasoner_helpers import run_to_end
from serving_helpers import asgi_server, png_bytes, wait_until

from worldserve.chat_params import ChatParams

MODEL = "test-model"


def _ids(reasoner, text: str) -> tuple[int, ...]:
    return tuple(reasoner.tokenizer(text)["input_ids"])


def _direct(reasoner, ids, **kw):
    """(text, session) of the Reasoner continuing `ids` alone."""
    return run_to_end(reasoner, ChatParams(prompt_ids=tuple(ids), **kw))


def test_greedy_text_matches_the_reasoner_for_text_and_token_ids(reasoner_oai, reasoner):
    resp = reasoner_oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    ids = _ids(reasoner, "Once upon a time")
    text, session = _direct(reasoner, ids, max_tokens=6, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == MODEL
    assert choice.text == text and choice.index == 0 and choice.finish_reason == session.finish_reason
    assert choice.logprobs is None and session.completion_tokens > 0
    u = resp.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(ids), session.completion_tokens)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    by_ids = reasoner_oai.completions.create(model=MODEL, prompt=list(ids), max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == text and by_ids.usage.prompt_tokens == len(ids)
    default = reasoner_oai.completions.create(
        model=MODEL, prompt=list(ids), temperature=0
    )  # vLLM's max_tokens 16
    text, session = _direct(reasoner, ids, max_tokens=16, temperature=0)
    assert default.choices[0].text == text and default.usage.completion_tokens == session.completion_tokens


def test_a_list_of_prompts_gets_n_choices_each(reasoner_oai, reasoner):
    """Choice i * n + j is sample j (seed + j) of prompt i; usage sums every prompt and every choice."""
    prompts = ["The sky is", "A cat"]
    resp = reasoner_oai.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=7
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    expected, completion = [], 0
    for p in (_ids(reasoner, prompts[0]), _ids(reasoner, prompts[1])):
        for j in range(2):
            text, session = _direct(reasoner, p, max_tokens=5, temperature=1.0, seed=7 + j)
            expected.append(text)
            completion += session.completion_tokens
    assert [c.text for c in resp.choices] == expected and len(set(expected)) > 1
    assert resp.usage.prompt_tokens == sum(len(_ids(reasoner, p)) for p in prompts)
    assert resp.usage.completion_tokens == completion
    ids_lists = reasoner_oai.completions.create(
        model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3, temperature=0
    )
    assert [c.text for c in ids_lists.choices] == [
        _direct(reasoner, p, max_tokens=3, temperature=0)[0] for p in ([5, 6, 7, 8], [9, 10])
    ]


def test_stream_through_the_openai_client_and_on_the_wire(reasoner_oai, reasoner_url):
    kw = dict(model=MODEL, prompt=["Hello", "World"], n=2, max_tokens=6, temperature=0.8, seed=3)
    whole = reasoner_oai.completions.create(**kw)
    chunks = list(reasoner_oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = {
        i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(4)
    }
    assert texts == {c.index: c.text for c in whole.choices}
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1, 2, 3] and all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    # unseeded and sampled: the tiny model draws an end-of-sequence token within 3 tokens ~0.2 % of the time
    # (finish_reason "stop"); ignore_eos makes "length" certain
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", reasoner_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all("usage" not in p and p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length" and len({p["id"] for p in payloads}) == 1


def test_legacy_logprobs_stream_and_not(reasoner_oai, reasoner):
    """logprobs=k: each token's text, raw-logit log-probability (the first one checked against the prefill's
    logits), the sampled token plus the top k, and text_offset the running sum of the token texts."""
    ids = _ids(reasoner, "Count: one, two,")
    resp = reasoner_oai.completions.create(
        model=MODEL, prompt=list(ids), max_tokens=5, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    _, session = _direct(reasoner, ids, max_tokens=5, temperature=0)
    decoded = [reasoner.tokenizer.decode([t]) for t in session.token_ids]
    assert lp.tokens == decoded and len(lp.token_logprobs) == len(decoded) == len(lp.top_logprobs)
    offsets = [0]
    for token in decoded[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    hidden, seq, _ = reasoner.prefill(reasoner.build_prompt(ChatParams(prompt_ids=ids)))
    seq.release()
    first = torch.log_softmax(reasoner.transformer.compute_logits(hidden[-1:])[0].float(), -1)
    assert lp.token_logprobs[0] == pytest.approx(float(first[session.token_ids[0]]), abs=1e-4)
    session = reasoner.start(ChatParams(prompt_ids=tuple(ids), max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=3))  # fmt: skip
    expected_keys = []  # each position's distinct texts among the top 3 and the sampled token
    while session.finish_reason is None:
        expected_keys += [{e.token, *(t for t, _ in e.top)} for e in session.step().logprobs]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # the top 3 and the sampled token, keyed by text: tokens decoding alike ("\ufffd" for partial
        # characters) share a key, as in vLLM's legacy format
        assert top[token] == pytest.approx(logprob) and len(top) == len(expected_keys.pop(0))
        assert max(top.values()) == pytest.approx(logprob)  # greedy took the most likely token
    streamed = list(reasoner_oai.completions.create(model=MODEL, prompt=list(ids), max_tokens=5, temperature=0, logprobs=3,
                                           stream=True))  # fmt: skip
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs is not None]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset][0] == 0
    assert [x for p in parts for x in p.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_stop_string_and_echo(reasoner_oai, reasoner):
    kw = dict(model=MODEL, prompt="hello", max_tokens=30, temperature=1.0, seed=3)
    text = reasoner_oai.completions.create(**kw).choices[0].text
    assert len(text) > 4, text
    stop = text[2:4]
    cut = reasoner_oai.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert cut.text == text[: text.find(stop)]
    kept = reasoner_oai.completions.create(
        stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw
    ).choices[0]
    assert kept.text == text[: text.find(stop) + len(stop)] and kept.finish_reason == "stop"
    echoed = reasoner_oai.completions.create(echo=True, **{**kw, "max_tokens": 4})
    assert echoed.choices[0].text == "hello" + text[: len(echoed.choices[0].text) - 5]
    chunks = list(reasoner_oai.completions.create(echo=True, stream=True, **{**kw, "max_tokens": 4}))
    assert chunks[0].choices[0].text.startswith("hello")
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    by_ids = reasoner_oai.completions.create(echo=True, **{**kw, "prompt": [5, 6], "max_tokens": 1})
    assert by_ids.choices[0].text.startswith(reasoner.tokenizer.decode([5, 6]))
    # echo with max_tokens 0: the prompts' text alone, n choices each, streamed or not; as vLLM, one token is
    # generated (and counted in usage) but left out of the text
    only = reasoner_oai.completions.create(
        echo=True, n=2, **{**kw, "prompt": ["hello", "a fox"], "max_tokens": 0}
    )
    assert [c.text for c in only.choices] == ["hello", "hello", "a fox", "a fox"]
    prompt_tokens = len(_ids(reasoner, "hello")) + len(_ids(reasoner, "a fox"))
    assert only.usage.completion_tokens <= 4 and only.usage.prompt_tokens == prompt_tokens
    chunks = list(reasoner_oai.completions.create(echo=True, stream=True, stream_options={"include_usage": True},
                                         **{**kw, "max_tokens": 0}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello"
    assert chunks[-1].usage.completion_tokens <= 1


def test_tokenize_prompt_form_and_detokenize_round_trip(reasoner_url, reasoner):
    text = "Hello world, how are you?"
    r = httpx.post(
        reasoner_url + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == list(_ids(reasoner, text)) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 4096
    assert out["token_strs"] == reasoner.tokenizer.convert_ids_to_tokens(out["tokens"])
    assert httpx.post(reasoner_url + "/tokenize", json={"prompt": text}).json()["token_strs"] is None
    back = httpx.post(reasoner_url + "/detokenize", json={"model": MODEL, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    special = httpx.post(
        reasoner_url + "/detokenize",
        json={"tokens": [reasoner.tokenizer.convert_tokens_to_ids("<|im_end|>")]},
    )
    assert special.json() == {"prompt": "<|im_end|>"}  # kept, as vLLM's /detokenize


def test_tokenize_chat_form_counts_like_a_chat_completion(reasoner_url, reasoner):
    """The chat form's count, an image included, is a chat completion's prompt_tokens for the same messages."""
    image = "data:image/png;base64," + base64.b64encode(png_bytes(56, 40)).decode()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    r = httpx.post(reasoner_url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    count = r.json()["count"]
    chat = httpx.post(reasoner_url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1},
                      timeout=60).json()  # fmt: skip
    assert count == chat["usage"]["prompt_tokens"] > 60 and r.json()["max_model_len"] == 4096
    bare = httpx.post(
        reasoner_url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    assert bare["tokens"] == r.json()["tokens"][: bare["count"]] and bare["count"] < count
    tail = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    cont = httpx.post(reasoner_url + "/tokenize", json={"messages": tail, "add_generation_prompt": False,
                                               "continue_final_message": True}).json()  # fmt: skip
    assert reasoner.tokenizer.decode(cont["tokens"]).endswith("Hello the")


DROP = object()
"""A patch value that removes the field from the request body."""


def test_echo_with_logprobs_scores_the_prompt(reasoner_oai, reasoner):
    """lm-eval's loglikelihood request (echo, max_tokens 0, logprobs): every prompt token's log-probability
    under the tokens before it (the first: None), equal to the Reasoner's own prefill logits; with tokens
    generated, the prompt's entries come first, streamed the same."""
    ids = list(_ids(reasoner, "The quick brown fox jumps"))
    r = reasoner_oai.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [reasoner.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    hidden, seq, _ = reasoner.prefill(reasoner.build_prompt(ChatParams(prompt_ids=tuple(ids))))
    seq.release()
    ref = torch.log_softmax(reasoner.transformer.compute_logits(hidden).float(), dim=-1)  # [N, V]
    assert lp.token_logprobs[1:] == pytest.approx(
        [float(ref[k, ids[k + 1]]) for k in range(len(ids) - 1)], abs=1e-4
    )
    for k, top in enumerate(lp.top_logprobs[1:]):  # keyed by text: two tokens decoding alike share one key
        if len({reasoner.tokenizer.decode([int(i)]) for i in ref[k].topk(2).indices}) == 2:
            assert len(top) >= 2 and max(top.values()) == pytest.approx(float(ref[k].max()), abs=1e-4)
    kw = dict(model=MODEL, prompt=ids, echo=True, max_tokens=3, logprobs=1, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    full = reasoner_oai.completions.create(**kw).choices[0].logprobs
    assert len(full.tokens) == len(ids) + 3 and full.token_logprobs[: len(ids)] == lp.token_logprobs
    chunks = list(reasoner_oai.completions.create(stream=True, **kw))
    streamed = [
        x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None and streamed[1:] == pytest.approx(full.token_logprobs[1:], abs=1e-5)


def test_vllm_prompt_logprobs_field(reasoner_url, reasoner):
    """vLLM's `prompt_logprobs: k`: choices[i].prompt_logprobs lists, per prompt token after the first, its
    own log-probability and rank and the k most likely tokens, keyed by id (as vLLM's Logprob objects);
    out of [0, 20] a 400 naming it. Chat completions take the field too (the answer's top-level
    prompt_logprobs). On both routes, as in vLLM, above 0 not with stream (a 400 naming it); 0 streams, and
    no chunk carries prompt logprobs."""
    ids = list(_ids(reasoner, "The quick brown fox jumps"))
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2}
    r = httpx.post(reasoner_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    hidden, seq, _ = reasoner.prefill(reasoner.build_prompt(ChatParams(prompt_ids=tuple(ids))))
    seq.release()
    ref = torch.log_softmax(reasoner.transformer.compute_logits(hidden).float(), dim=-1)  # [N, V]
    for k, row in enumerate(plp[1:]):
        assert next(iter(row)) == str(ids[k + 1])  # the prompt's own token first, as vLLM orders them
        own = row[str(ids[k + 1])]
        assert own["logprob"] == pytest.approx(float(ref[k, ids[k + 1]]), abs=1e-4)
        assert own["rank"] == int((ref[k] > ref[k, ids[k + 1]]).sum()) + 1
        assert own["decoded_token"] == reasoner.tokenizer.decode([ids[k + 1]])
        best = row[str(int(ref[k].argmax()))]
        assert best["rank"] == 1 and len(row) in (
            2,
            3,
        )  # the top 2, and the prompt's own token if not in them
    r = httpx.post(reasoner_url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert r.json()["error"]["message"] == "`prompt_logprobs` are not available when `stream=True`."
    for route, extra in (("/v1/completions", {"prompt": ids}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]})):  # fmt: skip
        zero = {"model": MODEL, "max_tokens": 2, "prompt_logprobs": 0, "stream": True, **extra}
        with httpx.stream("POST", reasoner_url + route, json=zero, timeout=60) as resp:
            assert resp.status_code == 200
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert events and all("prompt_logprobs" not in e["choices"][0] for e in events if e["choices"])
    r = httpx.post(reasoner_url + "/v1/completions", json={**body, "prompt_logprobs": 21}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    # a chat completion: the same field, the rendered chat prompt's tokens, at the top of the answer
    chat = {
        "model": MODEL,
        "max_tokens": 1,
        "prompt_logprobs": 1,
        "messages": [{"role": "user", "content": "hi"}],
    }
    r = httpx.post(reasoner_url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    rows = r.json()["prompt_logprobs"]
    assert rows[0] is None and len(rows) == r.json()["usage"]["prompt_tokens"]
    assert all(any(e["rank"] == 1 for e in row.values()) for row in rows[1:])
    r = httpx.post(reasoner_url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_tokenize_counts_past_the_context(reasoner_url):
    """Both /tokenize forms count a text longer than the context, as vLLM's /tokenize does (a chat or a
    completion of it is refused; counting is what /tokenize is for)."""
    text = "hello " * 5000  # ~10k tokens: past the 4096-token context
    for body in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
        r = httpx.post(reasoner_url + "/tokenize", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["count"] > r.json()["max_model_len"] == 4096, r.text
    # a text whose byte size alone shows it cannot fit the context however it tokenizes: a 400 before the
    # tokenizer runs (megabytes took minutes and gigabytes)
    huge = "hello " * 2_000_000  # 12 MB
    for body, param in (
        ({"prompt": huge}, "prompt"),
        ({"messages": [{"role": "user", "content": huge}]}, "messages"),
    ):
        r = httpx.post(reasoner_url + "/tokenize", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]


def test_vllm_end_controls_ignore_eos_min_tokens_stop_token_ids(reasoner_url, reasoner):
    """ignore_eos runs past the end of sequence to max_tokens; min_tokens holds the end back; a request's
    stop_token_ids end it, with the id as stop_reason (here: every id, so the first token ends it)."""
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 300, "temperature": 1.0}

    def run(**extra) -> dict:
        r = httpx.post(reasoner_url + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0] | {"tokens": r.json()["usage"]["completion_tokens"]}

    seed, natural = next(
        (s, c["tokens"]) for s in range(50) if (c := run(seed=s))["finish_reason"] == "stop" and c["tokens"] < 250
    )  # fmt: skip
    forced = run(seed=seed, ignore_eos=True)
    assert (forced["finish_reason"], forced["tokens"]) == ("length", 300)
    held = run(seed=seed, min_tokens=natural + 20)
    assert held["tokens"] >= natural + 20
    every = list(range(reasoner.prompts.vocab_size))
    first = run(seed=seed, stop_token_ids=every)
    # the stop token counts as a completion token, as vLLM counts it
    assert first["finish_reason"] == "stop" and first["tokens"] == 1 and isinstance(first["stop_reason"], int)
    assert first["text"] == ""
    r = httpx.post(reasoner_url + "/v1/completions", json={**body, "stop_token_ids": [10**9]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    r = httpx.post(reasoner_url + "/v1/completions", json={**body, "min_tokens": 301}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize(
    ("route", "patch", "status", "param", "needle"),
    [
        ("/v1/completions", {"suffix": "!"}, 400, "suffix", "not supported"),
        ("/v1/completions", {"best_of": 2}, 400, "best_of", "must equal n"),
        ("/v1/completions", {"prompt_embeds": "AAAA"}, 400, "prompt_embeds", "not supported"),  # (was ignored)
        ("/v1/completions", {"prompt": DROP, "prompt_embeds": ["AAAA"]}, 400, "prompt_embeds", "not supported"),
        ("/v1/completions", {"max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ("/v1/completions", {"n": 2, "temperature": 0}, 400, "n", "n must be 1 when using greedy sampling"),
        # (echo alone generates one token, which counts)
        ("/v1/completions", {"echo": True, "max_tokens": 0, "prompt": [5] * 4096}, 400, "input_tokens",
         "requested 1 output tokens and your prompt contains 4096 input tokens"),
        ("/v1/completions", {"echo": True, "max_tokens": 0, "min_tokens": 3}, 400, "min_tokens", "max_tokens"),
        ("/v1/completions", {"echo": True, "max_tokens": 0, "prompt": "<|image_pad|> hi"}, 400, "prompt",
         "cannot carry images"),
        ("/v1/completions", {"logprobs": 21}, 400, "logprobs", "validation error"),
        ("/v1/completions", {"prompt": [99999]}, 400, "prompt", "out of vocabulary"),
        ("/v1/completions", {"prompt": [[1, 2], [-3]]}, 400, "prompt", "out of vocabulary"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", "at least one token"),
        ("/v1/completions", {"prompt": []}, 400, "prompt", "must not be empty"),
        ("/v1/completions", {"prompt": None}, 400, "prompt", "validation error"),
        ("/v1/completions", {"prompt": [5] * 4096}, 400, "input_tokens", "maximum context length is 4096"),
        ("/v1/completions", {"max_tokens": 5000}, 400, "max_tokens", "max_tokens=5000 cannot be greater than"),
        ("/v1/completions", {"max_tokens": 4096}, 400, "input_tokens", "requested 4096 output tokens"),
        ("/v1/completions", {"max_tokens": int("9" * 4300)}, 400, "max_tokens", "cannot be greater"),  # (was a 500)
        ("/v1/completions", {"prompt": "x" * 3_000_000}, 400, "prompt", "bytes in the prompt (more than"),
        ("/v1/completions", {"prompt": "<|image_pad|> hi"}, 400, "prompt", "cannot carry images"),
        ("/v1/completions", {"n": 17}, 400, "n", "n must be between 1 and 16"),
        ("/v1/completions", {"prompt": ["a"] * 1025}, 400, "prompt", "prompt list length 1025 exceeds the maximum "
         "allowed count of 1024"),  # (VLLM_MAX_COMPLETION_PROMPTS: one request held all others back)
        ("/v1/completions", {"prompt": [[5]] * 1025}, 400, "prompt", "VLLM_MAX_COMPLETION_PROMPTS"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, 400, "stream_options", "stream=True"),
        ("/v1/completions", {"temperature": -1}, 400, "temperature", "validation error"),
        ("/v1/completions", {"response_format": {"type": "yaml"}}, 400, "response_format", "must be text, json_object"),
        ("/v1/completions", {"model": "nope"}, 404, "model", "The model `nope` does not exist."),
        ("/v1/completions", {"model": "", "max_tokens": 0}, 400, "max_tokens", "at least 1"),  # ("": the served one)
        ("/tokenize", {"model": "nope"}, 404, "model", "does not exist"),
        ("/tokenize", {"prompt": 3}, 400, "prompt", "validation error"),
        ("/tokenize", {"prompt": DROP, "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
         400, "continue_final_message", "Cannot set both"),
        ("/tokenize", {"prompt": DROP, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
         400, "messages[0].content[0].image_url", "image"),
        ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens", "Token id 99999 is out of vocabulary"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens", "validation error"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", "does not exist"),
    ],
)  # fmt: skip
def test_bad_requests(reasoner_url, route, patch, status, param, needle):
    body = (
        {"model": MODEL, "prompt": "hi", "max_tokens": 2} if route == "/v1/completions" else {"prompt": "hi"}
    )
    body = {k: v for k, v in {**body, **patch}.items() if v is not DROP}
    r = httpx.post(reasoner_url + route, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and needle in err["message"], err
    if status == 404:
        assert err["type"] == "NotFoundError"


def test_a_client_that_disconnects_stops_its_completion(reasoner_url):
    """A completion whose client leaves is aborted (the chat metrics count it), not decoded on. The seed is
    one whose completion runs 50+ tokens before its end of sequence, so the client leaves mid-way."""

    def aborted() -> float:
        lines = httpx.get(reasoner_url + "/metrics").text.splitlines()
        hits = [
            ln for ln in lines if ln.startswith("worldserve:chat_request_success_total{") and "abort" in ln
        ]
        return float(hits[0].rsplit(" ", 1)[1]) if hits else 0.0

    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 4000, "temperature": 1.0}
    seed = next(
        s for s in range(50)
        if httpx.post(reasoner_url + "/v1/completions", json={**body, "seed": s}, timeout=60).json()["usage"][
            "completion_tokens"] >= 50
    )  # fmt: skip
    before = aborted()
    with httpx.stream(
        "POST", reasoner_url + "/v1/completions", json={**body, "seed": seed, "stream": True}, timeout=60
    ) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert '"text_completion"' in first
    wait_until(lambda: aborted() == before + 1, timeout=10)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_no_reasoner_and_shutting_down_answer_as_chat(tmp_path, reasoner, anyio_backend):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with asgi_server(tmp_path / "plain", model_name=MODEL) as http:  # no chat backend
        expected = (await http.post("/v1/chat/completions", json=chat)).json()["error"]
        assert expected["code"] == 400
        for route, body in (("/v1/completions", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"}),
                            ("/detokenize", {"tokens": [1]})):  # fmt: skip
            r = await http.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["message"] == expected["message"], r.text
    async with asgi_server(tmp_path / "stopping", model_name=MODEL, chat_backend=reasoner) as http:
        http.engine_client.begin_shutdown(0.3)
        r = await http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text


def test_null_n_stream_and_echo_take_their_defaults_on_every_text_route(reasoner_url):
    """OpenAI and vLLM declare `n`, `stream`, `echo` and the stream options nullable: null is the default (one
    choice, no stream), as wrappers passing every argument send them; they were 400s."""
    greedy = {"model": "test-model", "max_tokens": 2, "temperature": 0}
    nulls = {
        "n": None,
        "stream": None,
        "stream_options": {"include_usage": None, "continuous_usage_stats": None},
    }
    chat = {**greedy, "messages": [{"role": "user", "content": "x"}]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {**greedy, "prompt": "x", "echo": None}),
                       ("/v1/responses", {"model": "test-model", "input": "x", "stream": None, "max_output_tokens": 2})):  # fmt: skip
        r = httpx.post(
            reasoner_url + path, json={**body, **(nulls if path != "/v1/responses" else {})}, timeout=60
        )
        assert r.status_code == 200, (path, r.text)
        plain = httpx.post(reasoner_url + path, json=body if path == "/v1/responses" else {
            k: v for k, v in body.items() if k != "echo"}, timeout=60).json()  # fmt: skip
        if path != "/v1/responses":
            assert len(r.json()["choices"]) == 1 and r.json()["choices"] == plain["choices"]


def test_invocations_answers_a_chat_or_a_completion_by_its_body(reasoner_url):
    """vLLM's SageMaker route: `messages` is a chat completion, `prompt` a text completion (streamed too), each
    the same answer as its own route; anything else a 400 naming the types it could have been."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "seed": 1}
    text = {"prompt": "hello", "max_tokens": 5, "temperature": 0, "seed": 1}
    for body, route, kind in ((chat, "/v1/chat/completions", "chat.completion"),
                              (text, "/v1/completions", "text_completion")):  # fmt: skip
        via, direct = (
            httpx.post(reasoner_url + path, json=body, timeout=60) for path in ("/invocations", route)
        )
        assert via.status_code == 200 and via.json()["object"] == kind, via.text
        assert via.json()["choices"] == direct.json()["choices"]
    with httpx.stream("POST", reasoner_url + "/invocations", json={**text, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.read().decode().rstrip().endswith("data: [DONE]")
    r = httpx.post(reasoner_url + "/invocations", json={"input": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert "Expected one of: ['ChatCompletionRequest', 'CompletionRequest']" in r.json()["error"]["message"]
    r = httpx.post(
        reasoner_url + "/invocations", json={"messages": []}, timeout=60
    )  # the chat route's own 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
