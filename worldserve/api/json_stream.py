"""JSON text arriving in pieces -> its canonical text, emitted as soon as later text cannot change it.

Streamed tool calls send their arguments while the model writes them (vLLM's hermes parser does), and the
pieces must add up to what the finished answer says: `canonical_json(json.loads(text))`
(", " and ": " separators, strings re-escaped, numbers re-printed: 1.50 -> 1.5, 1e2 -> 100.0). `JsonStream`
scans one value character by character and emits that canonical text piece by piece: brackets, separators
and keys at once, a string's characters as they are decoded (an escape once complete), a number or literal
once a delimiter ends it. Each piece carries the path of the member or element it lies in (object keys and
array indices from the root; the separators between members belong to the container), so a caller can take
one member's value out of a larger object (a hermes call's "arguments") while it streams.

The pieces add up to the canonical text of any JSON value `json.loads` accepts, except an object with a
repeated key (json.loads keeps the last value; the stream has sent both). Text that is not JSON sets
`failed` at its first bad character (nothing after it is emitted), text that ends before its value does
at `close()`.
"""

from __future__ import annotations

import json
import re

_WS = " \t\n\r"
_HEX = "0123456789abcdefABCDEF"
_DELIMITERS = _WS + ',:[]{}"'
_CLOSERS = {"}": "{", "]": "["}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

Path = tuple[str | int, ...]


_SURROGATE = re.compile("[\ud800-\udfff]")


def canonical_json(value: object) -> str:
    """`json.dumps(value, ensure_ascii=False)`, except that a lone surrogate (which JSON text may escape, as
    "\\ud800") stays escaped: no UTF-8 answer can carry the character itself."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def _canonical_char(ch: str) -> str:
    """One decoded string character as canonical_json writes it inside quotes."""
    return canonical_json(ch)[1:-1]


class JsonStream:
    """One JSON value fed in pieces (`feed`, then `close` at the end of the text); `pieces` holds the
    canonical text emitted so far as (path, text), `strings` every complete string value by its path."""

    def __init__(self) -> None:
        self.pieces: list[tuple[Path, str]] = []
        self.strings: dict[Path, str] = {}
        self.failed = False
        self._stack: list[str] = []  # "{" / "[" of the open containers
        self._path: list[str | int | None] = []  # per open container: the member / element being read
        self._count: list[int] = []  # per open container: elements read (arrays)
        self._expect = "value"  # value | value_or_close | key | key_or_close | colon | sep | end
        self._string: list[str] | None = None  # the open string's decoded characters
        self._is_key = False
        self._escape = ""  # an open escape sequence, backslash included
        self._high = ""  # a decoded high surrogate waiting for its low half
        self._scalar = ""  # an open number or literal
        self._key = ""  # the last object key read

    @property
    def done(self) -> bool:
        """The value is complete (only whitespace may follow)."""
        return self._expect == "end" and not self._scalar

    def text(self, prefix: Path = ()) -> str:
        """The canonical text emitted so far under `prefix` (all of it for ())."""
        return "".join(t for p, t in self.pieces if p[: len(prefix)] == prefix)

    def feed(self, text: str) -> None:
        for ch in text:
            if self.failed:
                return
            if self._string is not None:
                self._string_char(ch)
            elif self._scalar and ch not in _DELIMITERS:
                self._scalar += ch
            else:
                if self._scalar:
                    self._end_scalar()
                if ch not in _WS and not self.failed:
                    self._structural(ch)

    def close(self) -> None:
        """The end of the text: a top-level number or literal ends here; a value still open fails."""
        if self._scalar and not self.failed:
            self._end_scalar()
        if not self.done:
            self._fail()

    # ------------------------------------------------------------------ scanning
    def _emit(self, text: str) -> None:
        self.pieces.append((tuple(p for p in self._path if p is not None), text))

    def _fail(self) -> None:
        self.failed = True

    def _structural(self, ch: str) -> None:
        expect = self._expect
        if ch in "{[" and expect in ("value", "value_or_close"):
            self._start_value()
            self._emit(ch)
            self._stack.append(ch)
            self._path.append(None)
            self._count.append(0)
            self._expect = "key_or_close" if ch == "{" else "value_or_close"
        elif ch == '"' and expect in ("value", "value_or_close", "key", "key_or_close"):
            self._is_key = expect.startswith("key")
            if not self._is_key:
                self._start_value()
                self._emit('"')
            self._string = []
        elif ch in _CLOSERS and self._stack and self._stack[-1] == _CLOSERS[ch] and expect in (
            "sep", "key_or_close" if ch == "}" else "value_or_close"
        ):  # fmt: skip
            self._stack.pop()
            self._path.pop()
            self._count.pop()
            self._emit(ch)
            self._end_value()
        elif ch == "," and expect == "sep":
            self._path[-1] = None
            self._emit(", ")
            self._count[-1] += 1
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif ch == ":" and expect == "colon":
            self._emit(": ")
            self._path[-1] = self._key
            self._expect = "value"
        elif expect in ("value", "value_or_close") and ch not in _DELIMITERS:
            self._start_value()
            self._scalar = ch
        else:
            self._fail()

    def _start_value(self) -> None:
        if self._stack and self._stack[-1] == "[":
            self._path[-1] = self._count[-1]

    def _end_value(self) -> None:
        self._expect = "sep" if self._stack else "end"

    def _end_scalar(self) -> None:
        scalar, self._scalar = self._scalar, ""
        try:
            value = json.loads(scalar)
        except ValueError:
            return self._fail()
        if isinstance(value, str | list | dict):  # (a delimiter would have ended it first)
            return self._fail()
        self._emit(json.dumps(value))
        self._end_value()

    def _string_char(self, ch: str) -> None:
        if self._escape:
            self._escape += ch
            esc = self._escape
            if esc[1] == "u":
                if len(esc) > 2 and ch not in _HEX:
                    return self._fail()
                if len(esc) < 6:
                    return
                decoded = chr(int(esc[2:], 16))
            elif esc[1] in _ESCAPES:
                decoded = _ESCAPES[esc[1]]
            else:
                return self._fail()
            self._escape = ""
            return self._decoded(decoded)
        if ch == "\\":
            self._escape = ch
        elif ch == '"':
            self._flush_high()
            assert self._string is not None  # feed() reads a string character only inside an open string
            text, self._string = "".join(self._string), None
            if self._is_key:
                self._key = text
                self._emit(canonical_json(text))
                self._expect = "colon"
            else:
                self._emit('"')
                self.strings[tuple(p for p in self._path if p is not None)] = text
                self._end_value()
        elif ord(ch) < 0x20:  # a raw control character: json.loads refuses it
            self._fail()
        else:
            self._decoded(ch, escaped=False)

    def _decoded(self, ch: str, escaped: bool = True) -> None:
        """A string character; an escaped high surrogate waits for an escaped low one (one character)."""
        if self._high and escaped and "\udc00" <= ch <= "\udfff":
            ch, self._high = (self._high + ch).encode("utf-16", "surrogatepass").decode("utf-16"), ""
        self._flush_high()
        if escaped and "\ud800" <= ch <= "\udbff":
            self._high = ch
            return
        assert self._string is not None  # (_string_char's: a string is open)
        self._string.append(ch)
        if not self._is_key:
            self._emit(_canonical_char(ch))

    def _flush_high(self) -> None:
        if self._high:
            ch, self._high = self._high, ""
            assert self._string is not None  # (_string_char's: a string is open)
            self._string.append(ch)
            if not self._is_key:
                self._emit(_canonical_char(ch))
