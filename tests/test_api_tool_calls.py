"""Tool calling over real HTTP (uvicorn, the tiny Reasoner whose chat template has Qwen3's tool format, the
openai client): tools reach the prompt, a named or required choice answers calls constrained to the tools'
schemas, "auto" parses the model's <tool_call> blocks (here forced by a regex, as a random model writes
none of its own), streamed or not, multi-turn conversations with calls and tool answers render, /tokenize
counts tools as the chat does, and each bad tool or choice is a 400 naming its field.
"""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "test-model"
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                          "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _weather_ok(args: dict) -> bool:
    return set(args) == {"city", "days"} and args["city"] in ("Oslo", "Rome") and 1 <= args["days"] <= 7


def test_tools_reach_the_prompt_and_tokenize_counts_them(reasoner_url, reasoner_oai):
    plain = reasoner_oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).usage.prompt_tokens
    with_tools = reasoner_oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, tools=TOOLS, tool_choice="none"
    )
    assert with_tools.usage.prompt_tokens > plain + 50
    assert with_tools.choices[0].message.tool_calls is None or with_tools.choices[0].message.tool_calls == []
    r = httpx.post(
        reasoner_url + "/tokenize", json={"model": MODEL, "messages": ASK, "tools": TOOLS}, timeout=30
    )
    assert r.status_code == 200 and r.json()["count"] == with_tools.usage.prompt_tokens, r.text


def test_a_named_choice_calls_that_function_streamed_or_not(reasoner_oai):
    for seed in range(3):
        kw = {
            "model": MODEL,
            "messages": ASK,
            "max_tokens": 200,
            "seed": seed,
            "tools": TOOLS,
            "tool_choice": NAMED,
        }
        answer = reasoner_oai.chat.completions.create(**kw)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == ""
        (call,) = choice.message.tool_calls
        assert (
            call.type == "function"
            and call.function.name == "get_weather"
            and call.id.startswith("chatcmpl-tool-")
        )
        assert _weather_ok(json.loads(call.function.arguments)), call
        args, names, finish = "", set(), None
        for chunk in reasoner_oai.chat.completions.create(stream=True, **kw):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                names.add(delta_call.function.name)
                args += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert args == call.function.arguments and names - {None} == {"get_weather"} and finish == "stop"


def test_a_required_choice_answers_one_call_or_more(reasoner_oai):
    """Every choice that ends is a list of calls of the given tools, finish_reason "tool_calls" (vLLM's, streamed
    or not); one cut by max_tokens (the random model may go on listing calls) is answered as its text, without
    calls."""
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 400, "seed": 1, "tools": TOOLS,
          "tool_choice": "required"}  # fmt: skip
    answer = reasoner_oai.chat.completions.create(n=4, **kw)
    assert {c.finish_reason for c in answer.choices} <= {"tool_calls", "length"}
    ended = [c for c in answer.choices if c.finish_reason == "tool_calls"]
    assert ended, answer
    finishes = {}
    for chunk in reasoner_oai.chat.completions.create(stream=True, n=4, **kw):
        for c in chunk.choices:
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert finishes == {c.index: c.finish_reason for c in answer.choices}
    for choice in ended:
        assert choice.message.content == "" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert _weather_ok(args) if call.function.name == "get_weather" else args["tz"] in ("UTC", "CET")
    for choice in answer.choices:
        if choice.finish_reason == "length":
            assert choice.message.content.startswith("[") and not choice.message.tool_calls


FORCED = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Oslo|Rome)", "days": [1-7]\\}\\}\\n</tool_call>'
"""A regex that makes the random model write one hermes call (auto parsing is what is tested)."""


def test_auto_parses_the_models_tool_call_blocks(reasoner_oai):
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 200, "seed": 3, "tools": TOOLS,
          "extra_body": {"structured_outputs": {"regex": "I will check\\.\\n" + FORCED}}}  # fmt: skip
    answer = reasoner_oai.chat.completions.create(**kw)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check.\n"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and _weather_ok(json.loads(call.function.arguments))
    content, deltas, finish = "", [], None
    for chunk in reasoner_oai.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "I will check.\n" and finish == "tool_calls"
    # the call is announced whole (id, name) once its name is written, then its arguments stream as the
    # model writes them (vLLM's hermes streaming) and add up to the unstreamed answer's
    head, *more = deltas
    assert head.id and head.function.name == "get_weather" and head.function.arguments == ""
    assert len(more) > 3 and all(d.index == 0 and d.id is None and d.function.name is None for d in more)
    assert "".join(d.function.arguments for d in more) == call.function.arguments


def test_parallel_tool_calls_false_answers_one_call(reasoner_oai):
    """The model writes two calls (forced by a regex); with parallel_tool_calls false the answer holds the
    first, streamed or not (vLLM's rule), with it both."""
    two = FORCED + "\\n" + FORCED
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 200, "seed": 3, "tools": TOOLS,
          "extra_body": {"structured_outputs": {"regex": two}}}  # fmt: skip
    both = reasoner_oai.chat.completions.create(**kw).choices[0].message.tool_calls
    one = reasoner_oai.chat.completions.create(parallel_tool_calls=False, **kw).choices[0].message.tool_calls
    assert len(both) == 2 and len(one) == 1
    assert (one[0].function.name, one[0].function.arguments) == (
        both[0].function.name,
        both[0].function.arguments,
    )
    deltas = [d for chunk in reasoner_oai.chat.completions.create(stream=True, parallel_tool_calls=False, **kw)
              for d in chunk.choices[0].delta.tool_calls or []]  # fmt: skip
    assert {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == one[0].function.arguments


def test_a_conversation_with_calls_and_tool_answers(reasoner_oai):
    first = reasoner_oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, seed=0, tools=TOOLS,
                                        tool_choice=NAMED).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]  # fmt: skip
    answer = reasoner_oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, seed=0, tools=TOOLS
    )
    short = reasoner_oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, seed=0, tools=TOOLS)
    assert answer.usage.prompt_tokens > short.usage.prompt_tokens + len(call.function.arguments) // 4


def _nested(depth: int) -> dict:
    """{"a": {"a": ... {}}} `depth` objects deep."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def _nested_text(depth: int) -> str:
    """_nested(depth) as JSON text (deeper than json.dumps can write)."""
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "'name'"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "'type'"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    ({"function_call": {"name": "f"}}, "function_call", "send tools"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format",
     "only one structured output constraint"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "nonsense"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": [1]}}}],
      "tool_choice": "required"}, "tools", "$defs must be an object"),
    # nesting the chat template (recursive) or json.loads would overflow on: a 400 before either runs
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(200)}}]}, "tools",
     "nested deeper than 128"),
    ({"chat_template_kwargs": {"x": _nested(500)}}, "chat_template_kwargs", "nested deeper than 128"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": _nested_text(990)}}]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
     "messages[1].tool_calls[0].function.arguments", "nested"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": json.dumps(_nested(200))}}]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
     "messages[1].tool_calls[0].function.arguments", "nested deeper than 128"),
    ({"structured_outputs": {"json": _nested_text(990)}}, "structured_outputs.json", "nested deeper than 128"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _nested(200)}}},
     "response_format", "nested deeper than 128"),
    # vLLM checks min_tokens against the max_tokens it defaults to the context's room
    ({"max_tokens": None, "min_tokens": 100_000}, "min_tokens", "min_tokens must be at most max_tokens"),
    ({"messages": [{"role": "user", "content": "look <|video_pad|>"}]}, "messages", "<|video_pad|>"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "needle"), BAD)
def test_bad_tools_and_choices_are_400s_naming_the_field(reasoner_url, extra, param, needle):
    r = httpx.post(reasoner_url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2, **extra},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_the_model_escapes_in_arguments_stays_escaped(reasoner_url, stream):
    """The model's hermes block escapes a lone surrogate ("\\ud800"): no UTF-8 answer can carry the character
    itself, so the call's arguments keep the escape (a 500, or a stream cut mid-body, before)."""
    forced = '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'
    body = {"model": MODEL, "messages": ASK, "max_tokens": 60, "stream": stream,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "structured_outputs": {"choice": [forced]}}  # fmt: skip
    r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        calls = [c for e in events[:-1] for ch in json.loads(e)["choices"]
                 for c in ch["delta"].get("tool_calls") or ()]  # fmt: skip
        arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    else:
        [call] = r.json()["choices"][0]["message"]["tool_calls"]
        arguments = call["function"]["arguments"]
    assert json.loads(arguments) == {"a": "\ud800"}
    replay = {"model": MODEL, "max_tokens": 2, "tools": body["tools"], "messages": [  # the next turn sends it back
        *ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                   "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]}  # fmt: skip
    again = httpx.post(reasoner_url + "/v1/chat/completions", json=replay, timeout=60)
    assert again.status_code == 200, again.text


NODE = {"type": "function", "function": {"name": "node", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["name", "child"],
    "properties": {"name": {"type": "string", "maxLength": 3}, "child": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}}}}  # fmt: skip
PLACE = {"type": "function", "function": {"name": "place", "parameters": {  # (draft-07 `definitions`)
    "type": "object", "additionalProperties": False, "required": ["loc"], "properties": {"loc": {"$ref": "#/definitions/Loc"}},
    "definitions": {"Loc": {"type": "object", "additionalProperties": False, "required": ["x"],
                            "properties": {"x": {"type": "integer"}}}}}}}  # fmt: skip


def _node_ok(args: object) -> bool:
    return (isinstance(args, dict) and set(args) == {"name", "child"} and isinstance(args["name"], str)
            and len(args["name"]) <= 3 and (args["child"] is None or _node_ok(args["child"])))  # fmt: skip


def test_required_keeps_each_tools_own_references(reasoner_url):
    """tool_choice "required" nests each tool's parameters in a list of calls: a recursive "#" had pointed at
    that list (a tool's argument became a list of calls), and draft-07 `definitions` were a 400 ("Pointer
    '/definitions/Loc' does not exist"), where a named choice took both. Every finished call now satisfies
    its tool's own schema."""
    finished = 0
    for seed in range(4):
        r = httpx.post(reasoner_url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": ASK, "max_tokens": 1500, "seed": seed, "tools": [NODE, PLACE],
            "tool_choice": "required", "structured_outputs": {"disable_any_whitespace": True}})  # fmt: skip
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] != "tool_calls":
            continue
        finished += 1
        for call in choice["message"]["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "node":
                assert _node_ok(args), args
            else:
                assert (
                    set(args) == {"loc"} and set(args["loc"]) == {"x"} and isinstance(args["loc"]["x"], int)
                ), args
    assert finished, "no seed finished its calls within max_tokens"
