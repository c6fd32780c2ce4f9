"""Structured outputs over real HTTP (uvicorn, the tiny Reasoner, the openai client): `response_format`
json_schema / json_object, vLLM's `structured_outputs` (json, regex, choice, grammar) and its older
`guided_*` fields on chat and text completions, streamed or not, and the openai client's own
`chat.completions.parse` with a pydantic model; each malformed constraint is a 400 naming its field; with
allowed_token_ids and min_tokens they combine as vLLM combines them.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field
from test_structured_outputs import SCHEMA, conforms

MODEL = "test-model"
HI = [{"role": "user", "content": "Describe a thing."}]


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
COMPACT = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}


def test_response_format_json_schema_streamed_and_not(reasoner_oai):
    for seed in range(3):
        kw = {"model": MODEL, "messages": HI, "max_tokens": 400, "seed": seed}
        whole = reasoner_oai.chat.completions.create(response_format=JSON_SCHEMA, **kw)
        assert whole.choices[0].finish_reason == "stop"
        assert conforms(json.loads(whole.choices[0].message.content)), whole
        parts = reasoner_oai.chat.completions.create(response_format=JSON_SCHEMA, stream=True, **kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        assert streamed == whole.choices[0].message.content


class Thing(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)


def test_the_openai_clients_parse_with_a_pydantic_model(reasoner_oai):
    """openai's own structured-output helper: a strict json_schema from the model class, parsed back."""
    answer = reasoner_oai.chat.completions.parse(
        model=MODEL, messages=HI, response_format=Thing, max_tokens=300, seed=1
    )
    thing = answer.choices[0].message.parsed
    assert isinstance(thing, Thing) and 0 <= thing.count <= 99


@pytest.mark.parametrize(
    ("extra", "accepts"),
    [
        ({"response_format": {"type": "json_object"}},
         lambda t: isinstance(json.loads(t), dict)),
        (COMPACT, lambda t: conforms(json.loads(t)) and not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', "", t))),
        # structured_outputs' options alone shape response_format's schema (vLLM writes it into them)
        ({"response_format": JSON_SCHEMA, "structured_outputs": {"disable_any_whitespace": True}},
         lambda t: conforms(json.loads(t)) and not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', "", t))),
        ({"structured_outputs": {"regex": "[a-c]{2,4}-[0-9]{1,3}"}}, lambda t: re.fullmatch("[a-c]{2,4}-[0-9]{1,3}", t)),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ({"structured_outputs": {"grammar": 'root ::= "A" ("b" | "c")* "."'}}, lambda t: re.fullmatch(r"A[bc]*\.", t)),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": ""}, lambda t: conforms(json.loads(t))),
        ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ],
)  # fmt: skip
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_each_constraint_on_both_routes(reasoner_url, extra, accepts, route):
    """Every choice that ends on its own follows the constraint (a JSON object of random tokens may run to
    max_tokens: cut, not checked), and one at least does end."""
    if route == "chat":
        body = {"model": MODEL, "messages": HI, "max_tokens": 200, "seed": 4, "n": 3, **extra}
        r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        ends = [(c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]]
    else:
        body = {
            "model": MODEL,
            "prompt": ["A thing:", "Another:"],
            "max_tokens": 200,
            "seed": 4,
            "n": 2,
            **extra,
        }
        r = httpx.post(reasoner_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        ends = [(c["text"], c["finish_reason"]) for c in r.json()["choices"]]
    assert len(ends) in (3, 4)
    stopped = [text for text, finish in ends if finish == "stop"]
    assert stopped, ends
    for text in stopped:
        assert accepts(text), text


def test_top_logprobs_past_the_allowed_tokens_are_floored(reasoner_oai):
    """A token the grammar forbids has probability 0: listed at -9999.0, as vLLM lists it (JSON has no -inf)."""
    answer = reasoner_oai.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, seed=2, logprobs=True, top_logprobs=20,
        extra_body={"structured_outputs": {"choice": ["x", "y"]}},
    )  # fmt: skip
    first = answer.choices[0].logprobs.content[0]
    assert first.token in ("x", "y") and first.logprob > -9999.0
    values = [t.logprob for t in first.top_logprobs]
    assert values.count(-9999.0) == 18 and sorted(values, reverse=True) == values


BAD = [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex", "only one structured output constraint"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "2 are (regex, choice)"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "none is given"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed character class"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}}, "structured_outputs.json",
     "invalid json constraint"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice", "list of strings"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar", "nowhere"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace", "boolean"),
    ({"response_format": {"type": "xml"}}, "response_format", "'xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name", '"name"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON object"),
    ({"guided_choice": "red"}, "guided_choice", "list of strings"),
    ({"guided_grammar": 7}, "guided_grammar", "must be a string"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "needle"), BAD)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_constraints_are_400s_naming_the_field(reasoner_url, route, extra, param, needle):
    body = {"model": MODEL, "max_tokens": 2, "stream": route == "/v1/completions", **extra}
    body.update({"messages": HI} if route == "/v1/chat/completions" else {"prompt": "hi"})
    r = httpx.post(reasoner_url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def _ids(url: str, text: str) -> list[int]:
    """`text`'s token ids as the Reasoner tokenizes it (special tokens' texts as their ids)."""
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    return httpx.post(url + "/tokenize", json=body, timeout=30).json()["tokens"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_allowed_token_ids_and_a_grammar_apply_together_or_are_refused(reasoner_url, route):
    """vLLM masks each step with both: ids the grammar takes are sampled under both (the grammar's text
    comes out); ids none of which may start the grammar's text would leave no token (vLLM fails such a
    request mid-answer): a 400 naming allowed_token_ids before any model work (the grammar won before)."""
    ends = _ids(reasoner_url, "<|im_end|><|endoftext|>")
    base = {"model": MODEL, "max_tokens": 8, "seed": 0, "structured_outputs": {"choice": ["green", "blue"]}}
    base.update({"messages": HI} if route == "/v1/chat/completions" else {"prompt": "hi"})
    r = httpx.post(reasoner_url + route, json={**base, "allowed_token_ids": _ids(reasoner_url, "green") + ends},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice.get("text") or choice.get("message", {}).get("content")) == "green", choice
    r = httpx.post(
        reasoner_url + route, json={**base, "allowed_token_ids": _ids(reasoner_url, "zzz")}, timeout=60
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "allowed_token_ids" and "structured_outputs.choice" in err["message"], err


def test_min_tokens_gives_way_once_the_grammar_allows_only_the_end(reasoner_url):
    """vLLM's rule since its PR #54218: min_tokens holds the end back while the grammar allows other tokens;
    once it allows only the end (a choice written out), the end wins, short of min_tokens, with "stop"."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 20, "min_tokens": 15, "seed": 0,
            "structured_outputs": {"choice": ["ok"]}}  # fmt: skip
    r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert (
        answer["choices"][0]["message"]["content"] == "ok" and answer["choices"][0]["finish_reason"] == "stop"
    )
    assert answer["usage"]["completion_tokens"] < 15, answer


def test_rules_left_with_no_token_mid_answer_fail_the_request(reasoner_url):
    """allowed_token_ids "a" and "b" with the regex a[0-9]: "a" starts the answer under both, then neither id
    is a digit: vLLM fails the request; here a 400 naming allowed_token_ids, or in a stream already started
    an error event and [DONE] (the rules had been set aside, then it ended with finish_reason "error")."""
    ids = _ids(reasoner_url, "a") + _ids(reasoner_url, "b")
    body = {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0, "allowed_token_ids": ids,
            "structured_outputs": {"regex": "a[0-9]"}}  # fmt: skip
    errors = _finished_errors(reasoner_url)
    r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "allowed_token_ids" and "structured output" in err["message"], err
    with httpx.stream("POST", reasoner_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as s:  # fmt: skip
        assert s.status_code == 200
        events = [line[len("data: ") :] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["param"] == "allowed_token_ids" and error["code"] == 400, error
    # each a finished request, as vLLM counts one: request_success_total{finished_reason="error"}
    assert _finished_errors(reasoner_url) == errors + 2


def _finished_errors(url: str) -> float:
    """vllm:request_success_total{finished_reason="error"} of the server at `url`."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="error"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError('no vllm:request_success_total{finished_reason="error"} sample')
