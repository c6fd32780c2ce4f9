"""POST /v1/responses (api/responses.py) over real HTTP on the tiny Reasoner, with the official `openai` client:
the answer equals the chat completion of the same conversation (greedy), every streamed event and the final
object validate as the SDK's own types, the events add up to the object; instructions, message items with
images, function_call / function_call_output items, function tools (auto, named, required), text.format
json_schema, logprobs, max_output_tokens (incomplete), --reasoning-parser (a reasoning item); errors name the
Responses field.
"""

from __future__ import annotations

import base64
import io
import json
import re
from typing import get_args

import httpx
import pytest
from PIL import Image
from reasoner_helpers import tiny_reasoner
from serving_helpers import serve_reasoner

openai = pytest.importorskip("openai")  # a test dependency (the GPU machine's image has none)
NotFoundError = openai.NotFoundError
BadRequestError = openai.BadRequestError
Response, ResponseStreamEvent = openai.types.responses.Response, openai.types.responses.ResponseStreamEvent

MODEL = "test-model"
EVENTS = {
    get_args(c.model_fields["type"].annotation)[0]: c for c in get_args(get_args(ResponseStreamEvent)[0])
}
"""Each stream event's SDK type by its `type`."""
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}  # fmt: skip


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _stream(oai, **kw) -> tuple[list, Response]:
    """Every event (validated as the SDK's types) and the final response they announce."""
    events = [
        EVENTS[e.type].model_validate(e.model_dump(by_alias=True))
        for e in oai.responses.create(model=MODEL, stream=True, **kw)
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type == "response.completed"  # (vLLM's end, also for a response cut short)
    return events, events[-1].response


def test_a_text_answer_equals_the_chat_completion(reasoner_oai):
    kw = {"temperature": 0, "max_output_tokens": 12}
    r = reasoner_oai.responses.create(model=MODEL, input="Describe a fox.", instructions="Be brief.", **kw)
    Response.model_validate(r.model_dump(by_alias=True))
    chat = reasoner_oai.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe a fox."}])  # fmt: skip
    assert r.output_text == chat.choices[0].message.content and r.id.startswith("resp_")
    assert (
        r.usage.input_tokens == chat.usage.prompt_tokens
        and r.usage.output_tokens == chat.usage.completion_tokens
    )
    finished = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finished == "length" else "completed")
    assert (r.incomplete_details is not None) == (finished == "length") and r.store is True
    # OpenAI's completed_at: a completed response's time, else null
    assert (r.completed_at is None) == (finished == "length") and (
        r.completed_at or r.created_at
    ) >= r.created_at
    events, final = _stream(reasoner_oai, input="Describe a fox.", instructions="Be brief.", **kw)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == r.output_text
    assert r.tool_choice == "auto"  # (OpenAI's default, with no tools too)
    # the client's stream helper needs response.completed, also when max_output_tokens cut the answer
    cut = {"model": MODEL, "input": "Describe a fox.", "max_output_tokens": 2, "temperature": 0}
    with reasoner_oai.responses.stream(**cut) as stream:
        short = stream.get_final_response()
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.completed_at is None
    kinds = [e.type for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_a_stored_response_lists_its_input_items(reasoner_oai):
    """OpenAI's GET /v1/responses/{id}/input_items (the SDK's input_items.list; vLLM serves none): the input as
    items with ids, newest first by default, paged by limit / after; an unknown or unstored
    response a 404, a bad limit a 400."""
    import openai

    given = [{"role": "user", "content": "First."}, {"role": "assistant", "content": "Noted."},
             {"type": "message", "role": "user", "id": "msg_mine", "content": [{"type": "input_text", "text": "Then?"}]}]  # fmt: skip
    r = reasoner_oai.responses.create(model=MODEL, input=given, max_output_tokens=2, temperature=0)
    listed = reasoner_oai.responses.input_items.list(r.id)
    items = list(listed)  # (newest first)
    assert [i.role for i in items] == ["user", "assistant", "user"] and items[0].id == "msg_mine"
    assert items[1].content[0].type == "output_text" and items[2].content[0].text == "First."
    assert all(i.id.startswith("msg_") and i.status == "completed" and i.type == "message" for i in items)
    asc = reasoner_oai.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.id for i in asc.data] == [items[2].id, items[1].id] and asc.has_more
    assert [i.id for i in asc.data] == [asc.first_id, asc.last_id]
    rest = reasoner_oai.responses.input_items.list(r.id, order="asc", after=asc.last_id)
    assert [i.id for i in rest.data] == ["msg_mine"] and not rest.has_more
    one = reasoner_oai.responses.create(model=MODEL, input="Hi.", max_output_tokens=1)
    [item] = reasoner_oai.responses.input_items.list(one.id).data
    assert item.content[0].type == "input_text" and item.content[0].text == "Hi."
    unstored = reasoner_oai.responses.create(model=MODEL, input="Hi.", max_output_tokens=1, store=False)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            reasoner_oai.responses.input_items.list(missing)
    with pytest.raises(openai.BadRequestError):
        reasoner_oai.responses.input_items.list(r.id, limit=101)


def test_items_images_and_a_tool_turn_render_as_the_chat(reasoner_oai):
    image = _png()
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": image}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # the call's turn's thoughts ("": this template shows none)
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
    ]  # fmt: skip
    r = reasoner_oai.responses.create(
        model=MODEL, input=items, tools=[WEATHER], temperature=0, max_output_tokens=6
    )
    chat = reasoner_oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=6, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": image}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}])  # fmt: skip
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


def test_named_and_required_tool_calls(reasoner_oai):
    named = reasoner_oai.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], extra_body={"seed": 1},
                                          tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (call,) = named.output
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and call.call_id.startswith("chatcmpl-tool-")
    )
    assert set(json.loads(call.arguments)) == {"city"}
    events, final = _stream(reasoner_oai, input="Weather in Oslo?", tools=[WEATHER], extra_body={"seed": 1},
                            tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == final.output[0].arguments == call.arguments
    required = reasoner_oai.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], extra_body={"seed": 2},
                                             tool_choice="required")  # fmt: skip
    assert required.output and all(
        o.type == "function_call" and o.name == "get_weather" for o in required.output
    )


def test_parallel_tool_calls_false_keeps_the_first_call(reasoner_oai):
    forced = (
        '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Oslo|Rome)"\\}\\}\\n</tool_call>'
    )
    kw = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "max_output_tokens": 200,
          "extra_body": {"seed": 3, "structured_outputs": {"regex": forced + "\\n" + forced}}}  # fmt: skip
    assert [o.type for o in reasoner_oai.responses.create(**kw).output] == ["function_call"] * 2
    assert [o.type for o in reasoner_oai.responses.create(parallel_tool_calls=False, **kw).output] == [
        "function_call"
    ]


def test_an_auto_call_streams_its_arguments_as_events(reasoner_oai):
    """An auto-mode call the model writes (forced by a regex): the function_call item opens once its name is
    written, its arguments come in several function_call_arguments.delta events (validated as the SDK's
    types) that add up to the done event's and the final item's, equal to the unstreamed answer's."""
    forced = 'I will check\\.\\n<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Oslo|Rome)"\\}\\}\\n</tool_call>'
    kw = {"input": "Weather?", "tools": [WEATHER], "max_output_tokens": 200,
          "extra_body": {"seed": 3, "structured_outputs": {"regex": forced}}}  # fmt: skip
    whole = reasoner_oai.responses.create(model=MODEL, **kw)
    events, final = _stream(reasoner_oai, **kw)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and len(deltas) > 3
    assert "".join(deltas) == done.arguments == call.arguments == whole.output[-1].arguments
    assert final.output[0].type == "message" and final.output_text == whole.output_text == "I will check.\n"


def test_an_unstreamed_call_whose_body_fails_to_parse_is_text_with_logprobs_too(reasoner_oai):
    """A finished answer's tool call is what the chat route parses from its whole text: a call body that is
    not JSON stays the message's text whether or not logprobs are asked for (with them the tokens come one by
    one, and the streaming parser, which announces a call by its name, had made a function_call of broken
    arguments)."""
    broken = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": [a-z]{1,8}\\}\\}\\n</tool_call>'
    kw = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "max_output_tokens": 100,
          "extra_body": {"seed": 1, "structured_outputs": {"regex": broken}}}  # fmt: skip
    plain = reasoner_oai.responses.create(**kw)
    with_logprobs = reasoner_oai.responses.create(include=["message.output_text.logprobs"], **kw)
    assert [o.type for o in plain.output] == [o.type for o in with_logprobs.output] == ["message"]
    assert with_logprobs.output_text == plain.output_text and plain.output_text.startswith("<tool_call>")
    assert len(with_logprobs.output[0].content[0].logprobs) == with_logprobs.usage.output_tokens


def test_json_schema_format_and_logprobs(reasoner_oai):
    fmt = {"type": "json_schema", "name": "city", "schema": WEATHER["parameters"], "strict": True}
    r = reasoner_oai.responses.create(model=MODEL, input="A city?", text={"format": fmt}, extra_body={"seed": 3},
                                      include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    assert set(json.loads(r.output_text)) == {"city"} and r.text.format.type == "json_schema"
    (part,) = r.output[0].content
    *text, end = part.logprobs  # the grammar's end: an end-of-sequence token, its entry last (as vLLM's)
    assert "".join(lp.token for lp in text) == r.output_text and end.token in ("<|im_end|>", "<|endoftext|>")
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs) and r.top_logprobs == 2  # (echoed)
    events, final = _stream(reasoner_oai, input="A city?", text={"format": fmt}, extra_body={"seed": 3},
                            include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [
        lp.token for lp in part.logprobs
    ] and final.output_text == r.output_text
    last = [e for e in events if e.type == "response.output_text.delta"][-1]  # the ending token's: no text
    assert (last.delta, [lp.token for lp in last.logprobs]) == ("", [end.token])
    assert final.output[0].content[0].logprobs == part.logprobs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f1"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,", "detail": "ultra"}]}]},
         "input[0].content[0].detail"),  # (as the chat route's image_url.detail)
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": int("9" * 4300)}, "max_output_tokens"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "input[1].content[0].image_url"),
        ({"input": "hi", "instructions": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}},
         "tool_choice"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),  # (the chat's shape)
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_blah", "text": "x"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": "hi"}, {"type": "foo"}]}, "input[1].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": []}, "input"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "s"}]}, "tools[0].parameters"),
        ({"input": "hi", "tools": [{"type": "function", "name": ""}]}, "tools[0].name"),  # (had been "0")
        ({"input": "hi", "tools": [{"type": "function", "name": 5}]}, "tools[0].name"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "description": 7}]}, "tools[0].description"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
         "text.format.schema"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
        # two constraints: the message names text.format, not the chat's response_format
        ({"input": "hi", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
         "structured_outputs.regex"),
        ({"input": "hi", "reasoning": {"effort": "bogus"}}, "reasoning"),
        # the chat's field here was dropped unsaid (free text where JSON was asked)
        ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format"),
        # a function_call item's own field, the second of two calls that make one assistant turn
        ({"input": [{"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "[" * 200 + "]" * 200},
                    {"type": "function_call_output", "call_id": "c1", "output": "x"},
                    {"type": "function_call_output", "call_id": "c2", "output": "y"}]}, "input[2].arguments"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_responses_field(reasoner_url, body, param):
    r = httpx.post(reasoner_url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert "response_format" not in r.json()["error"]["message"] or param == "response_format", r.text
    # vLLM's typed name on its own routes, but its request validation's reason phrase for a request the
    # model's types or validators refuse
    message = r.json()["error"]["message"]
    validation = re.match(r"\d+ validation errors?:", message) or "`tools` must be set" in message
    assert r.json()["error"]["type"] == ("Bad Request" if validation else "BadRequestError"), r.text


@pytest.mark.parametrize("long_field", ["instructions", "input"])
def test_a_prompt_too_long_for_the_context_names_what_it_holds(reasoner_url, long_field):
    """The whole prompt's length is OpenAI's `input` error (context_length_exceeded names it); its message names
    the instructions too when they are part of it, so an overlong system text is not blamed on the input."""
    body = {"input": "hi", "instructions": "Be brief.", long_field: "fox " * 300_000}
    r = httpx.post(reasoner_url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and "maximum context length" in error["message"], r.text
    assert "the instructions and input" in error["message"] and "messages" not in error["message"], r.text


@pytest.fixture(scope="module")
def thinking_url(tiny_ckpt, tmp_path_factory):
    with serve_reasoner(tiny_reasoner(tiny_ckpt), tmp_path_factory.mktemp("responses-think"), model=MODEL,
                        name="test-responses-think", reasoning_parser="qwen3") as base:  # fmt: skip
        yield base


def test_thoughts_become_a_reasoning_item(thinking_url):
    from openai import OpenAI

    oai = OpenAI(base_url=thinking_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    regex = "<think>\\nLook at it\\.\\n</think>\\n\\nA fox\\."
    kw = {"input": "What is it?", "extra_body": {"structured_outputs": {"regex": regex}}}
    r = oai.responses.create(model=MODEL, **kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "\nLook at it.\n" and r.output_text == "\n\nA fox."
    events, final = _stream(oai, **kw)
    thoughts = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thoughts == r.output[0].content[0].text and final.output_text == r.output_text
    hidden = oai.responses.create(
        model=MODEL, **{**kw, "extra_body": {**kw["extra_body"], "include_reasoning": False}}
    )
    assert [o.type for o in hidden.output] == ["message"]
    hidden = oai.responses.create(model=MODEL, include=["message.output_text.logprobs"],
                                  **{**kw, "extra_body": {**kw["extra_body"], "include_reasoning": False}})  # fmt: skip
    *text, end = hidden.output[0].content[0].logprobs  # the ending token's entry last
    tokens = "".join(lp.token for lp in text)  # the thoughts' tokens are not text
    assert tokens.endswith(hidden.output_text) and "Look" not in tokens
    assert end.token in ("<|im_end|>", "<|endoftext|>")
    # cut in its message: the reasoning item before it is complete, streamed or not (it said "incomplete"
    # when the whole answer came in one piece, the finish reason known as the item closed)
    cut = {**kw, "max_output_tokens": r.usage.output_tokens - 1}
    whole = oai.responses.create(model=MODEL, **cut)
    _, streamed = _stream(oai, **cut)
    for answer in (whole, streamed):
        assert [(o.type, o.status) for o in answer.output] == [
            ("reasoning", "completed"),
            ("message", "incomplete"),
        ]


def test_an_answer_without_text_still_has_its_message():
    """A chat whose tokens decode to nothing (e.g. ids past the tokenizer) answers an empty message item,
    opened and closed in the stream, not an empty output."""
    from worldserve.api.chat_stream import TextParsing
    from worldserve.api.responses_output import ResponseBuilder
    from worldserve.api.responses_protocol import ResponsesRequest
    from worldserve.engine.client import ChatDelta

    builder = ResponseBuilder({"output": []}, TextParsing(), logprobs=False, prompt_tokens=5)
    assert builder.feed(ChatDelta(text="", finish_reason=None, completion_tokens=1)) == []
    events = [json.loads(e.split("data: ", 1)[1]) for e in builder.feed(
        ChatDelta(text="", finish_reason="length", completion_tokens=2))]  # fmt: skip
    assert [e["type"] for e in events] == ["response.output_item.added", "response.content_part.added",
                                           "response.output_text.done", "response.content_part.done",
                                           "response.output_item.done"]  # fmt: skip
    body = builder.response()
    assert body["status"] == "incomplete" and body["output"][0]["content"][0]["text"] == ""
    assert body["usage"]["output_tokens"] == 2 and ResponsesRequest(input="x").logprobs is False


def test_prompt_templates_are_refused_and_the_service_tier_echoed(reasoner_oai, reasoner_url):
    """vLLM's Responses request: a `prompt` template is a 400 in its words (its request validator: typed
    "Bad Request"); `service_tier` takes OpenAI's tiers and the response echoes it ("auto" by default); another
    value is a 400 naming it (both had been ignored)."""
    url = reasoner_url + "/v1/responses"
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2}
    r = httpx.post(url, json={**body, "prompt": {"id": "pmpt_1", "variables": {"x": "y"}}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "prompt template is not supported",
        "type": "Bad Request",
        "param": "prompt",
        "code": 400,
    }, r.text
    r = httpx.post(url, json={**body, "service_tier": "gold"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier", r.text
    assert reasoner_oai.responses.create(**body).service_tier == "auto"
    flex = reasoner_oai.responses.create(**body, service_tier="flex")
    assert flex.service_tier == "flex" and reasoner_oai.responses.retrieve(flex.id).service_tier == "flex"


def test_stored_responses_continue_a_conversation(reasoner_oai, reasoner_url):
    """store (the default) keeps a response: previous_response_id continues its conversation (instructions not
    carried over, as OpenAI's), which answers as the chat of the whole conversation; GET finds it, DELETE
    removes it; store=false keeps nothing; an unknown id is a 404 naming the field."""
    first = reasoner_oai.responses.create(model=MODEL, input="Name a fox.", instructions="Be brief.",
                                          temperature=0, max_output_tokens=8)  # fmt: skip
    assert first.store is True
    second = reasoner_oai.responses.create(model=MODEL, input="And a bird?", previous_response_id=first.id,
                                           temperature=0, max_output_tokens=8)  # fmt: skip
    chat = reasoner_oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "Name a fox."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And a bird?"}])  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert reasoner_oai.responses.retrieve(first.id).output_text == first.output_text
    # vLLM's stream replays a background response's events; none here: a 400, not JSON read as no events
    r = httpx.get(f"{reasoner_url}/v1/responses/{first.id}", params={"stream": "true", "starting_after": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    with pytest.raises(BadRequestError, match="Cannot cancel a synchronous response"):  # (vLLM's cancel)
        reasoner_oai.responses.cancel(first.id)
    reasoner_oai.responses.delete(first.id)
    with pytest.raises(NotFoundError):
        reasoner_oai.responses.cancel(first.id)
    for call in (lambda: reasoner_oai.responses.retrieve(first.id),
                 lambda: reasoner_oai.responses.create(model=MODEL, input="x", previous_response_id=first.id)):  # fmt: skip
        with pytest.raises(NotFoundError):
            call()
    unstored = reasoner_oai.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(NotFoundError):
        reasoner_oai.responses.retrieve(unstored.id)
    r = httpx.post(reasoner_url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_gone"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_item_references_name_stored_output_items(reasoner_oai, reasoner_url):
    """A client replaying a conversation may name an earlier output item by id (an item_reference, as Codex
    does for its function calls): the same answer as the item sent in full; a reference to no stored item
    (never made, or its response deleted) is a 404 naming it, one without an id a 400."""
    first = reasoner_oai.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], extra_body={"seed": 1},
                                          tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (call,) = first.output
    turn = [{"role": "user", "content": "Weather in Oslo?"}, None,
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}]  # fmt: skip
    kw = {"model": MODEL, "tools": [WEATHER], "temperature": 0, "max_output_tokens": 6}
    full = reasoner_oai.responses.create(input=[turn[0], call.model_dump(), turn[2]], **kw)
    named = reasoner_oai.responses.create(
        input=[turn[0], {"type": "item_reference", "id": call.id}, turn[2]], **kw
    )
    assert named.output_text == full.output_text and named.usage.input_tokens == full.usage.input_tokens
    for item, status in (
        ({"type": "item_reference", "id": "fc_none"}, 404),
        ({"type": "item_reference"}, 400),
    ):
        r = httpx.post(
            reasoner_url + "/v1/responses", json={"model": MODEL, "input": [turn[0], item, turn[2]]}
        )
        assert r.status_code == status and r.json()["error"]["param"] == "input[1].id", r.text
    for bare in ({"id": call.id}, {"type": None, "id": call.id}):  # the SDK's ItemReference: type optional
        same = reasoner_oai.responses.create(input=[turn[0], bare, turn[2]], **kw)
        assert same.output_text == full.output_text and same.usage.input_tokens == full.usage.input_tokens
    # an input item by the id input_items listed (it was a 404: only output items were found), or its own
    asked = next(i for i in reasoner_oai.responses.input_items.list(full.id).data if i.type == "message")
    mine = reasoner_oai.responses.create(input=[{**turn[0], "id": "msg_mine", "type": "message"}, call.model_dump(),
                                                turn[2]], **kw)  # fmt: skip
    for item_id in (asked.id, "msg_mine"):
        by_id = reasoner_oai.responses.create(
            input=[{"type": "item_reference", "id": item_id}, call.model_dump(), turn[2]], **kw
        )
        assert by_id.output_text == full.output_text and by_id.usage.input_tokens == full.usage.input_tokens
    assert mine.output_text == full.output_text
    r = httpx.post(
        reasoner_url + "/v1/responses",
        json={"model": MODEL, "input": [{"role": "system", "content": "Be brief."}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text  # nothing to answer
    # an item of a deleted response is gone (the call above lives on in the inputs of the later responses)
    other = reasoner_oai.responses.create(model=MODEL, input="x", max_output_tokens=2)
    reasoner_oai.responses.delete(other.id)
    r = httpx.post(reasoner_url + "/v1/responses",
                   json={"model": MODEL, "input": [{"type": "item_reference", "id": other.output[0].id}]})  # fmt: skip
    assert r.status_code == 404 and r.json()["error"]["param"] == "input[0].id"


def test_the_store_keeps_the_most_recent_within_its_budget():
    from worldserve.api.responses_store import ResponseStore

    def response(i: int) -> dict:
        return {
            "id": f"resp_{i}",
            "output": [
                {"type": "message", "id": f"msg_{i}", "content": [{"type": "output_text", "text": "x" * 100}]}
            ],
        }

    store = ResponseStore(max_bytes=2000)  # (two entries: ~330 bytes of JSON and the overhead each)
    for i in range(8):
        store.put(response(i), [{"role": "user", "content": "hi"}])
        store.get("resp_0")  # used: kept
    assert store.get("resp_0") is not None and store.get("resp_7") is not None and store.get("resp_1") is None
    history, body = store.get("resp_7")
    assert history == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 100}]
    assert (
        store.item("msg_7")["id"] == "msg_7" and store.item("msg_1") is None
    )  # items go with their response
    assert store.delete("resp_7") and store.item("msg_7") is None and store.item("msg_0") is not None


def test_an_item_stays_found_while_any_stored_response_holds_it():
    """A client that sends an earlier response's output back as input lists the same item id again: deleting
    (or evicting) the later response had left the earlier, still stored one's item a 404."""
    from worldserve.api.responses_store import ResponseStore

    item = {
        "type": "message",
        "id": "msg_a",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "x"}],
    }
    store = ResponseStore()
    store.put({"id": "resp_a", "output": [item]}, [{"role": "user", "content": "hi"}])
    store.put({"id": "resp_b", "output": []}, [{"role": "user", "content": "more"}], inputs=[item])
    assert store.delete("resp_b") and store.item("msg_a") == item
    store.put({"id": "resp_c", "output": []}, [{"role": "user", "content": "more"}], inputs=[item])
    assert store.delete("resp_a") and store.item("msg_a") == item  # (resp_c holds it still)
    assert store.delete("resp_c") and store.item("msg_a") is None and store._items == {}


def test_empty_instructions_add_no_system_turn(reasoner_oai):
    """`instructions: ""` is no instructions (vLLM's construct_input_messages skips it): it had rendered an
    empty system turn, a different prompt."""
    kw = {"model": MODEL, "input": "hi", "max_output_tokens": 1, "store": False}
    plain, empty = reasoner_oai.responses.create(**kw), reasoner_oai.responses.create(instructions="", **kw)
    assert empty.usage.input_tokens == plain.usage.input_tokens and empty.instructions == ""


def test_the_store_s_budget_is_the_memory_its_entries_take():
    """--responses-store-mb bounds memory: 200 responses of ~8 KB of JSON take about their accounted bytes
    (kept as dict trees they had taken 4-7x: a 256 MiB budget held 1-2 GB of RSS in an audit's soak); what a
    caller gets is its own copy, which cannot change the stored entry."""
    import tracemalloc

    from worldserve.api.responses_store import ResponseStore

    def response(i: int) -> dict:
        words = [
            {"type": "output_text", "text": f"w{j}", "annotations": [], "logprobs": []} for j in range(60)
        ]
        return {"id": f"resp_{i}", "object": "response", "status": "completed", "tools": [],
                "output": [{"type": "message", "id": f"msg_{i}", "role": "assistant", "content": words}]}  # fmt: skip

    store = ResponseStore(max_bytes=2**30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            store.put(
                response(i),
                [{"role": "user", "content": [{"type": "text", "text": f"t{j}"} for j in range(40)]}],
            )
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert taken < 1.3 * store._bytes, (taken, store._bytes)
    _, body = store.get("resp_3")
    body["output"].clear()
    assert store.get("resp_3")[1]["output"] and store.item("msg_3")["id"] == "msg_3"


def test_logprobs_cover_every_token_and_output_items_round_trip(reasoner_oai, reasoner_url):
    """Found by fuzzing: tokens whose text comes out with a later token (a partial character) kept no logprob;
    a message's added event carried its part, which the SDK's stream accumulator then added twice; the
    server's own reasoning items, sent back as input, were refused; truncation "auto" left no room (it drops
    whole items now, as OpenAI's does, and cut tokens off the prompt's start before, the instructions too)."""
    for seed in range(3):
        r = reasoner_oai.responses.create(model=MODEL, input="hi", max_output_tokens=30, extra_body={"seed": seed},
                                          include=["message.output_text.logprobs"])  # fmt: skip
        assert (
            r.status == "incomplete" and len(r.output[0].content[0].logprobs) == r.usage.output_tokens == 30
        )
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "string", "enum": ["fox"]}}
    with reasoner_oai.responses.stream(model=MODEL, input="hi", text={"format": fmt}) as stream:
        final = stream.get_final_response()
    assert [len(o.content) for o in final.output] == [1] and final.output_text == '"fox"'
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "t"}],
    }
    again = reasoner_oai.responses.create(model=MODEL, input=[thought, {"role": "user", "content": "hi"}],
                                          max_output_tokens=2)  # fmt: skip
    assert again.status in ("completed", "incomplete")
    # truncation "auto", as OpenAI's: whole items dropped from the start, the instructions kept
    # (~1,200 tokens an item on the tiny tokenizer: four do not fit 4,096 - 4, three do)
    items = [{"role": "user", "content": "hello " * 300} for _ in range(4)]
    items.append({"role": "user", "content": "hi"})
    sure = {"instructions": "Answer briefly.", "max_output_tokens": 4}

    def input_tokens(**body) -> int:
        r = httpx.post(reasoner_url + "/v1/responses", timeout=60, json={**sure, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    cut = input_tokens(input=items, truncation="auto")
    assert cut == input_tokens(input=items[1:]) <= 4096 - 4  # one item dropped: the fewest that fit
    assert input_tokens(input=items[2:], truncation="auto") == input_tokens(input=items[2:])  # fits: whole
    no_room = httpx.post(reasoner_url + "/v1/responses", timeout=60, json={
        "input": "hi", "truncation": "auto", "max_output_tokens": 4096})  # fmt: skip
    # (the budget fills the context: no prompt fits beside it, and truncation cannot cut the last item)
    assert no_room.status_code == 400 and no_room.json()["error"]["param"] == "input", no_room.text
    for body in ({"input": "hello " * 6000}, {"input": items, "max_output_tokens": 4090}):
        long = httpx.post(
            reasoner_url + "/v1/responses", timeout=60, json={**sure, **body, "truncation": "auto"}
        )
        assert long.status_code == 400 and long.json()["error"]["param"] == "input", (
            long.text
        )  # its last item
    wordy = httpx.post(reasoner_url + "/v1/responses", timeout=60, json={  # the instructions take the room
        "instructions": "hello " * 6000, "input": "hi", "truncation": "auto", "max_output_tokens": 4})  # fmt: skip
    assert wordy.status_code == 400 and wordy.json()["error"]["param"] == "instructions", wordy.text
    pictured = httpx.post(reasoner_url + "/v1/responses", timeout=60, json={
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello " * 6000},
                                               {"type": "input_image", "image_url": _png()}]}],
        "truncation": "auto", "max_output_tokens": 4})  # fmt: skip
    assert pictured.status_code == 400 and pictured.json()["error"]["param"] == "input", pictured.text
    own = httpx.post(reasoner_url + "/v1/responses", timeout=60, json={  # the client's own field keeps its name
        "input": "hi", "truncate_prompt_tokens": 0, "max_output_tokens": 4})  # fmt: skip
    assert own.status_code == 400 and own.json()["error"]["param"] == "truncate_prompt_tokens", own.text


def test_a_server_that_stores_nothing(reasoner, tmp_path):
    """--responses-store-mb 0: answers say store false and nothing can be found or continued; a negative
    budget is refused at startup."""
    from worldserve.cli import build_parser
    from worldserve.commands import serve

    argv = ["serve", "--responses-store-mb", "0"]
    assert (
        serve.app_settings(serve.engine_config(build_parser(argv).parse_args(argv))).responses_store_bytes
        == 0
    )
    with pytest.raises(ValueError, match="--responses-store-mb must be >= 0"):  # serve logs it and exits 2
        bad = ["serve", "--responses-store-mb", "-1"]
        serve.engine_config(build_parser(bad).parse_args(bad))
    with serve_reasoner(reasoner, tmp_path, model=MODEL, name="test-responses-nostore",
                        responses_store_bytes=0) as url:  # fmt: skip
        r = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=60).json()
        assert r["store"] is False
        assert httpx.get(f"{url}/v1/responses/{r['id']}", timeout=60).status_code == 404
        again = httpx.post(
            url + "/v1/responses", json={"input": "hi", "previous_response_id": r["id"]}, timeout=60
        )
        assert again.status_code == 404 and again.json()["error"]["param"] == "previous_response_id"


def test_a_tool_schema_with_nan_is_a_400_naming_it(reasoner_url):
    """A NaN literal (Python's json takes it) echoed into the answer's tools made it unserialisable: a 500, and
    every GET of the stored answer after; it is refused as the body is read."""
    body = (
        '{"model": "test-model", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": '
        '{"type": "object", "properties": {"n": {"type": "number", "maximum": NaN}}}}]}'
    )
    r = httpx.post(reasoner_url + "/v1/responses", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters.properties.n.maximum"
