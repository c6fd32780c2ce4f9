"""The bytes each token id stands for, as a grammar engine must see them (llguidance, sampling/token_grammar.py).

Qwen's tokenizer is byte-level BPE: its vocabulary spells bytes with GPT-2's printable stand-ins
(`bytes_to_unicode`), and its added tokens are plain text, some special (<|im_end|>, <|image_pad|>, ...),
some not (<tool_call>, </tool_call>, <think>, </think>). llguidance, given the tokenizer's JSON, takes every
added token for a special one, which a grammar may only name, never spell: a regex or a tool block that
writes "<tool_call>" then has its only allowed token refused (the tokenizer turns the forced text into that
one id). `token_bytes` gives llguidance each id's real bytes and the truly special ids instead, so such a
token is text like any other.
"""

from __future__ import annotations

from typing import Any


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def token_bytes(tokenizer: Any, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """([vocab_size] the bytes of each id, the special ids) of a byte-level HF tokenizer. Ids past the
    tokenizer's (an LM head padded past the vocabulary) are special placeholders no grammar allows.
    ValueError for a tokenizer that is not byte-level."""
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = tokenizer.added_tokens_decoder
    special = sorted(i for i, t in added.items() if t.special)
    tokens: list[bytes] = []
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in added:
            tokens.append(added[i].content.encode())
        elif piece is None or any(c not in to_byte for c in piece):
            raise ValueError(f"token {i} ({piece!r}) is not byte-level BPE")
        else:
            tokens.append(bytes(to_byte[c] for c in piece))
    for i in range(len(tokens), vocab_size):
        tokens.append(f"<|unused_{i}|>".encode())
        special.append(i)
    return tokens, special
