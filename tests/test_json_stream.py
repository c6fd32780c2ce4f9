"""`JsonStream` (api/json_stream.py): JSON text cut anywhere adds up, piece by piece, to the canonical text the
finished answer gives (`canonical_json(json.loads(text))`: lone surrogates escaped), whatever the formatting; one
member's value can be taken out while it streams; text that is not JSON stops the stream at its first bad
character."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldserve.api.json_stream import JsonStream, canonical_json

TEXT = st.text() | st.text(st.sampled_from("a\u00e9\ud800\udc00\ud83d\ude00"), max_size=6)
"""Any text, and text dense in surrogates (lone ones escape in the canonical text, pairs join)."""
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def _streamed(text: str, cuts: list[int]) -> JsonStream:
    js = JsonStream()
    bounds = sorted({c % (len(text) + 1) for c in cuts})
    for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True):
        js.feed(text[a:b])
    js.close()
    return js


@settings(max_examples=300, deadline=None)
@given(
    value=VALUES,
    indent=st.sampled_from([None, 0, 2]),
    ascii_only=st.booleans(),
    compact=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_pieces_add_up_to_the_canonical_text(value, indent, ascii_only, compact, cuts):
    separators = (",", ":") if compact else None
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only, separators=separators)
    js = _streamed(text, cuts)
    assert not js.failed and js.done
    assert js.text() == canonical_json(json.loads(text))
    js.text().encode("utf-8")  # (a lone surrogate stays escaped: the text can be sent)


def test_a_members_value_streams_on_its_own():
    text = '{ "name" : "get_weather",\n "arguments":{"city":"Oslo","days":[1, 2.50]} }'
    js = JsonStream()
    seen = []
    for ch in text:
        js.feed(ch)
        seen.append(js.text(("arguments",)))
    assert js.strings[("name",)] == "get_weather" and js.strings[("arguments", "city")] == "Oslo"
    assert seen[-1] == '{"city": "Oslo", "days": [1, 2.5]}'
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))  # only ever appended to
    assert '{"city": "Os' in seen  # a string's characters come as they are written
    assert '{"city": "Oslo", "days": [1, 2' not in seen  # a number only once a delimiter ends it
    js = JsonStream()
    js.feed('{"s": "\\ud83d')  # an escaped high surrogate waits for its low half
    assert js.text() == '{"s": "'
    js.feed('\\ude00 \\u00e9\\n"}')
    assert js.text() == '{"s": "😀 é\\n"}'


@pytest.mark.parametrize(
    ("text", "sent"),
    [('{"a" 1}', '{"a"'), ('{"a": tru}', '{"a": '), ("[1,,2]", "[1, "), ('{"a": "\\x"}', '{"a": "'),
     ('{"a": 1}}', '{"a": 1}'), ("x", ""), ('{"a": "b\n"}', '{"a": "b'), ("[1 2]", "[1"), ("{,}", "{"),
     ('"\\u+041"', '"'), ('"\\u0x41"', '"'), ('"\\u 041"', '"'), ('"\\u００４１"', '"'),  # int() would take these
     ("[1, 2", "[1, 2"), ('"abc', '"abc'), ("{", "{"), ("tru", "")],  # cut: fails at close()
)  # fmt: skip
def test_text_that_is_not_json_stops_the_stream(text, sent):
    js = _streamed(text, [])
    assert js.failed and js.text() == sent
