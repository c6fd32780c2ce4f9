"""Tool calling without a server (api/tool_calls.py): the tool choice's validation, the hermes parse of a
finished text, the constraint of a required or named choice, and the streamed deltas, which add up to the
finished answer however the text is cut into pieces.
"""

from __future__ import annotations

import json
import random

import pytest

from worldserve.api.tool_calls import ToolIn, message_calls, tool_constraint, tool_mode
from worldserve.api.tool_stream import ToolStream, final_message, hermes_calls
from worldserve.params import ParamError
from worldserve.sampling.grammar import check

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [ToolIn.model_validate(t) for t in (WEATHER, TIME)]


def test_tool_choice_defaults_and_refusals():
    assert tool_mode(None, None) is None and tool_mode(None, "none") is None and tool_mode([], "auto") is None
    auto = tool_mode(TOOLS, None)
    assert auto.choice == "auto" and auto.parsed and auto.tools[0] == WEATHER
    assert not tool_mode(TOOLS, "none").parsed and tool_mode(TOOLS, "none").tools  # still shown to the model
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "named" and named.name == "get_time"
    for tools, choice, needle in [
        (None, "required", "`tools` must be set"),
        (None, "auto", "`tools` must be set"),  # (vLLM's check_tool_usage; it had been taken as "none")
        (None, {"type": "function", "function": {"name": "f"}}, "`tools` must be set"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "Tool 'nope' has not been passed"),
        (TOOLS, "sometimes", "must be"),
        (TOOLS, {"type": "function"}, "named tool_choice"),
    ]:
        with pytest.raises(ParamError) as info:
            tool_mode(tools, choice)
        assert info.value.param == "tool_choice" and needle in str(info.value), str(info.value)


def test_required_and_named_constraints_compile_and_describe_the_calls():
    named = tool_constraint(tool_mode(TOOLS, {"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(named.spec) == WEATHER["function"]["parameters"] and named.field == "tools"
    required = json.loads(tool_constraint(tool_mode(TOOLS, "required")).spec)
    assert required["type"] == "array" and required["minItems"] == 1
    names = [alt["properties"]["name"]["enum"] for alt in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert json.loads(tool_constraint(tool_mode(TOOLS, {"type": "function", "function": {"name": "get_time"}})).spec) == {
        "type": "object"}  # a tool without parameters takes any object  # fmt: skip
    for mode in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        check(tool_constraint(tool_mode(TOOLS, mode)))
    assert tool_constraint(tool_mode(TOOLS, "auto")) is None


def test_hermes_parse_of_a_finished_text():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'  # fmt: skip
    content, calls = hermes_calls(text)
    assert content == "Let me look.\n" and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"} and calls[0].id.startswith(
        "chatcmpl-tool-"
    )
    assert calls[0].id != calls[1].id
    assert (
        hermes_calls('<tool_call>{"name": "get_time", "arguments": {}}')[0] is None
    )  # unterminated, no text
    assert hermes_calls("no calls here") is None
    assert hermes_calls("<tool_call>{not json</tool_call>") is None  # then it is all content
    # a block that is not a call, before or after good ones (a second call cut by max_tokens): all text with
    # the chat's own finish reason, as vLLM's hermes parser answers (the cut had been hidden behind the calls)
    cut = text + '\n<tool_call>\n{"name": "get_time", "argu'
    assert hermes_calls(cut) is None and final_message(cut, mode := tool_mode(TOOLS, "auto"), "length") == (
        cut, [], "length")  # fmt: skip
    broken = "<tool_call>nope</tool_call>" + text
    assert final_message(broken, mode, "stop") == (broken, [], "stop")
    mode = tool_mode(TOOLS, "auto")
    assert final_message(text, mode, "stop")[2] == "tool_calls"
    assert final_message("plain", mode, "length") == ("plain", [], "length")
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    content, calls, finish = final_message('{"city": "Rome"}', named, "stop")
    assert content == "" and calls[0].function.arguments == '{"city": "Rome"}' and finish == "stop"
    content, calls, finish = final_message(
        '[{"name": "get_time", "parameters": {"tz": "é"}}]', tool_mode(TOOLS, "required"), "stop"
    )
    assert (
        content == ""
        and calls[0].function.name == "get_time"
        and calls[0].function.arguments == '{"tz": "é"}'
    )
    assert finish == "tool_calls"  # vLLM's (OpenAI's rule): "tool_calls" for required calls, "stop" for named
    assert final_message('[{"name": "get_ti', tool_mode(TOOLS, "required"), "length") == (
        '[{"name": "get_ti',
        [],
        "length",
    )


def test_required_keeps_each_tools_schema_whole_under_its_own_name():
    """Each tool's parameters are one of the list schema's $defs, their own references rewritten to point
    into them: two tools may define the same $defs name differently (it was a 400: "all tools share one set
    of $defs"), a recursive "#" names the tool's parameters, not the list of calls."""
    item = {"type": "object", "properties": {"n": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}, "next": {"$ref": "#"}},
        "$defs": {"Item": item}}}}  # fmt: skip
    other = json.loads(json.dumps(tool))
    other["function"]["name"] = "sub"
    other["function"]["parameters"]["$defs"]["Item"] = {"type": "string"}
    so = tool_constraint(tool_mode([ToolIn.model_validate(tool), ToolIn.model_validate(other)], "required"))
    schema = json.loads(so.spec)
    assert [alt["properties"]["parameters"] for alt in schema["items"]["anyOf"]] == [
        {"$ref": "#/$defs/tool0"}, {"$ref": "#/$defs/tool1"}]  # fmt: skip
    add = schema["$defs"]["tool0"]
    assert add["properties"] == {
        "item": {"$ref": "#/$defs/tool0/$defs/Item"},
        "next": {"$ref": "#/$defs/tool0"},
    }
    assert add["$defs"] == {"Item": item} and schema["$defs"]["tool1"]["$defs"]["Item"] == {"type": "string"}
    check(so)
    # data is no schema (a {"$ref"} in const / enum stays as it is), a property may be named "default", and
    # an $id goes (the rewritten pointers resolved against it: "Pointer ... does not exist")
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "$id": "https://x.example/q.json", "type": "object", "$defs": {"A": {"type": "integer"}},
        "properties": {"ptr": {"const": {"$ref": "#/a"}}, "default": {"$ref": "#/$defs/A"},
                       "e": {"enum": [{"$ref": "#"}]}}}}}  # fmt: skip
    so = tool_constraint(tool_mode([ToolIn.model_validate(odd)], "required"))
    rooted = json.loads(so.spec)["$defs"]["tool0"]
    assert "$id" not in rooted and rooted["properties"] == {
        "ptr": {"const": {"$ref": "#/a"}}, "default": {"$ref": "#/$defs/tool0/$defs/A"},
        "e": {"enum": [{"$ref": "#"}]}}  # fmt: skip
    check(so)


def test_message_calls_hand_json_arguments_to_the_template_as_objects():
    from worldserve.api.tool_calls import ToolCallIn

    calls = [ToolCallIn.model_validate({"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}),
             ToolCallIn.model_validate({"function": {"name": "get_time", "arguments": "not json"}})]  # fmt: skip
    out = message_calls(calls)
    # JSON escaping a lone surrogate (as this server writes such answers, so clients send them back): the text
    surrogate = ToolCallIn.model_validate({"function": {"name": "f", "arguments": '{"x": "\\ud800"}'}})
    assert message_calls([surrogate])[0]["function"]["arguments"] == '{"x": "\\ud800"}'
    # a call sent back without arguments (missing, null, "" or blank) renders {} (vLLM's rule), not nothing
    for empty in ({}, {"arguments": None}, {"arguments": ""}, {"arguments": " "}):
        bare = ToolCallIn.model_validate({"function": {"name": "get_time", **empty}})
        assert message_calls([bare])[0]["function"]["arguments"] == {}
    assert out[0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    assert out[1]["function"]["arguments"] == "not json"


def _streamed(mode, pieces: list[str]) -> tuple[str, list[dict], bool]:
    """(content, merged tool calls by index, whether a call was sent) of a ToolStream fed `pieces`."""
    stream, content, calls = ToolStream(mode), "", {}
    for i, piece in enumerate(pieces):
        for delta in stream.feed(piece, i == len(pieces) - 1):
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                merged = calls.setdefault(call["index"], {"name": "", "arguments": "", "id": None})
                merged["id"] = call.get("id") or merged["id"]
                merged["name"] += call.get("function", {}).get("name", "")
                merged["arguments"] += call.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], stream.called


def _cuts(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(
    "text",
    [
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
        "A plain answer with < and <tool in it, but no call.",
        '<tool_call>{"name": "get_time", "arguments": {}}',  # unterminated: parsed at the end
    ],
)
def test_auto_stream_adds_up_to_the_finished_answer(text):
    mode = tool_mode(TOOLS, "auto")
    content, calls, _ = final_message(text, mode, "stop")
    rng = random.Random(text)
    for _ in range(20):
        s_content, s_calls, called = _streamed(mode, _cuts(text, rng))
        assert s_content == (content or "") and called == bool(calls)
        assert [(c["name"], c["arguments"]) for c in s_calls] == [
            (c.function.name, c.function.arguments) for c in calls]  # fmt: skip
        assert all(c["id"].startswith("chatcmpl-tool-") for c in s_calls)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>not json</tool_call>',
        'Hm <tool_call>not json</tool_call> then <tool_call>{"name": "get_time", "arguments": {}}</tool_call> x',
    ],
)
def test_a_block_that_is_no_call_makes_the_finished_answer_text_but_streamed_calls_stand(text):
    """With a <tool_call> block that does not parse the unstreamed answer is all text with the chat's own
    finish reason (vLLM's hermes parser); the stream cannot take back the good call it sent: it has the
    call, and the text before the first call as content."""
    mode = tool_mode(TOOLS, "auto")
    assert final_message(text, mode, "stop") == (text, [], "stop")
    s_content, s_calls, called = _streamed(mode, _cuts(text, random.Random(text)))
    assert (
        called
        and [c["name"] for c in s_calls] == ["get_time"]
        and s_content == text[: text.index('<tool_call>{"')]
    )


def test_auto_calls_stream_their_arguments_as_they_are_written():
    """One character at a time: the call is announced (id, name, arguments "") as soon as its name string
    closes, long before its block ends; then its arguments come in many deltas, each the canonical JSON
    text settled so far (a number only once it ends), adding up to the finished answer's."""
    text = (
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 12}}\n</tool_call>'
    )
    stream = ToolStream(tool_mode(TOOLS, "auto"))
    deltas = []
    for i, ch in enumerate(text):
        deltas += [(i, d) for d in stream.feed(ch, i == len(text) - 1)]
    calls = [(i, d["tool_calls"][0]) for i, d in deltas if "tool_calls" in d]
    (at, head), args = calls[0], [c["function"]["arguments"] for _, c in calls[1:]]
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["id"].startswith(
        "chatcmpl-tool-"
    )
    assert at == text.index('", "arguments"')  # announced when the name's closing quote arrived
    assert len(args) > 10 and "".join(args) == '{"city": "Oslo", "days": 12}'
    assert "12}" in args and "1" not in args  # the number whole, once "}" ended it
    assert stream.calls[0].function.arguments == '{"city": "Oslo", "days": 12}' and stream.called
    assert "".join(d.get("content", "") for _, d in deltas) == "Sure."


def test_an_announced_call_stands_when_its_block_is_cut():
    """max_tokens cuts a call mid-arguments: streamed, it was announced and keeps the arguments sent (as
    vLLM's streaming does); unstreamed, the block does not parse and is the answer's text."""
    text = '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Os'
    content, calls, called = _streamed(tool_mode(TOOLS, "auto"), list(text))
    assert called and content == "" and calls[0]["name"] == "get_time"
    assert calls[0]["arguments"] == '{"tz": "Europe/Os'
    assert final_message(text, tool_mode(TOOLS, "auto"), "length") == (text, [], "length")
    # a call without arguments gets "{}" when its block ends, as unstreamed
    content, calls, _ = _streamed(
        tool_mode(TOOLS, "auto"), list('<tool_call>{"name": "get_time"}</tool_call>')
    )
    assert calls[0]["arguments"] == "{}"


def test_named_and_required_streams():
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    content, calls, _ = _streamed(named, ['{"ci', 'ty": "Os', 'lo"}'])
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Oslo"}'
    content, calls, called = _streamed(named, ["", ""])  # no argument text (the answer only thought): no call
    assert not calls and not called
    required = tool_mode(TOOLS, "required")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    content, calls, called = _streamed(required, _cuts(text, random.Random(0)))
    assert called and [c["name"] for c in calls] == ["get_weather", "get_time"] and content == ""
    stream = ToolStream(required)
    stream.feed(text, True)
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"
    stream = ToolStream(named)
    stream.feed('{"city": "Oslo"}', True)
    assert stream.finish_reason("stop") == "stop"  # a named call keeps the chat's own, as vLLM's
    content, calls, called = _streamed(required, ['[{"name": "get_w'])  # cut by max_tokens: the text itself
    assert content == '[{"name": "get_w' and not calls and not called


def test_required_calls_stream_item_by_item():
    """The required answer's JSON list: each call announced once its name is written, its parameters
    streamed as they settle, in order; a list cut after a name keeps the calls announced."""
    required = tool_mode(TOOLS, "required")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    stream = ToolStream(required)
    deltas = [
        (i, d["tool_calls"][0]) for i, ch in enumerate(text) for d in stream.feed(ch, i == len(text) - 1)
    ]
    heads = [(i, d["function"]["name"], d["index"]) for i, d in deltas if "id" in d]
    assert heads == [(text.index('", "parameters"'), "get_weather", 0),
                     (text.rindex('", "parameters"'), "get_time", 1)]  # fmt: skip
    args = [
        "".join(d["function"]["arguments"] for _, d in deltas if d["index"] == k and "id" not in d)
        for k in (0, 1)
    ]
    assert args == ['{"city": "Oslo"}', "{}"] and len([d for _, d in deltas if d["index"] == 0]) > 5
    assert [c.function.arguments for c in stream.calls] == args
    _, calls, called = _streamed(required, list('[{"name": "get_weather", "parameters": {"ci'))  # cut
    assert called and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == "{"


def test_streams_found_by_fuzzing():
    """A fuzzing review's finds: a required list that breaks as its first name closes is the text (it
    raised); "parameters" before "arguments" streams what the finished answer takes (the first); a required
    item without parameters completes ("{}") before the next call's deltas; nesting past the JSON decoder's
    recursion limit is text, not an exception; a named answer with no text makes no call either way."""
    required, auto = tool_mode(TOOLS, "required"), tool_mode(TOOLS, "auto")
    for pieces in (['[{"name":"a"]'], ['[{"name":"a"]', ""]):
        stream = ToolStream(required)
        deltas = [d for i, p in enumerate(pieces) for d in stream.feed(p, i == len(pieces) - 1)]
        assert deltas == [{"content": '[{"name":"a"]'}] and not stream.called
    text = '<tool_call>{"name": "f", "parameters": {"p": 1}, "arguments": {"a": 2}}</tool_call>'
    _, calls, _ = _streamed(auto, list(text))
    assert calls[0]["arguments"] == final_message(text, auto, "stop")[1][0].function.arguments == '{"p": 1}'
    text = '[{"name": "a"}, {"name": "b", "parameters": {"y": 2}}]'
    stream = ToolStream(required)
    indices = [c["index"] for i, ch in enumerate(text) for d in stream.feed(ch, i == len(text) - 1)
               for c in d["tool_calls"]]  # fmt: skip
    assert indices == sorted(indices) and [c.function.arguments for c in stream.calls] == ["{}", '{"y": 2}']
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>"
    assert final_message(deep, auto, "stop") == (deep, [], "stop")
    assert final_message("[" * 1000 + "]" * 1000, required, "stop")[1] == []
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert final_message("", named, "stop") == ("", [], "stop")


def test_a_call_written_whole_in_one_piece_is_announced_then_its_arguments():
    """Every call's first delta carries its id and name with arguments "", as when it streams."""
    stream = ToolStream(tool_mode(TOOLS, "auto"))
    deltas = stream.feed('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>', True)
    assert [d["tool_calls"][0]["function"] for d in deltas] == [
        {"name": "get_time", "arguments": ""},
        {"arguments": '{"tz": "UTC"}'},
    ]
    assert stream.calls[0].function.arguments == '{"tz": "UTC"}' and "id" in deltas[0]["tool_calls"][0]


def test_parallel_tool_calls_false_answers_the_first_call_only():
    """vLLM's rule: parallel_tool_calls false keeps the first call, streamed or not (later ones' deltas are
    dropped); a required choice's grammar then allows one call at most."""
    two = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')  # fmt: skip
    one = tool_mode(TOOLS, "auto", parallel=False)
    assert [c.function.name for c in final_message(two, one, "stop")[1]] == ["get_time"]
    assert len(final_message(two, tool_mode(TOOLS, "auto"), "stop")[1]) == 2
    for pieces in (list(two), [two]):
        _, calls, called = _streamed(one, pieces)
        assert called and [(c["name"], c["arguments"]) for c in calls] == [("get_time", "{}")]
    required = (
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    )
    one_required = tool_mode(TOOLS, "required", parallel=False)
    assert [c.function.name for c in final_message(required, one_required, "stop")[1]] == ["get_time"]
    assert [c["name"] for c in _streamed(one_required, list(required))[1]] == ["get_time"]
    schema = json.loads(tool_constraint(one_required).spec)
    assert schema["maxItems"] == 1 and "maxItems" not in json.loads(
        tool_constraint(tool_mode(TOOLS, "required")).spec
    )
