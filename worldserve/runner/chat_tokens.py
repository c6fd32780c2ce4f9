"""The Reasoner's tokenizer as the HTTP routes use it on its own: ChatTokenizer, the base of ChatPromptBuilder.

`encode` / `decode` / `check_ids` / `token_strs` are the tokenizer as /tokenize, /detokenize and /v1/completions
use it, `bad_word_ids` tokenizes vLLM's bad_words, and `check_size` refuses a text whose byte count alone is more
than the room the completion budget leaves in the context can hold (models/cosmos3/prompt.py's TextSizeBound),
in the shape of vLLM's character-based check (worldserve/context_limits.py), before tokenizing it (megabytes
take tens of seconds). None of this needs the chat template, the vision preprocessing or the placeholder token
ids, which is why it lives apart from the prompt building of runner/chat_prompt.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from worldserve.context_limits import text_size_refusal
from worldserve.models.cosmos3.prompt import TextSizeBound
from worldserve.param_errors import ParamError, TextTooLong


class ChatTokenizer:
    """The checkpoint tokenizer's encode / decode / vocabulary checks, with the context's text-size bound."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (added special tokens included): valid ids are [0, vocab_size)."""
        return len(self.tokenizer)

    def encode(
        self, text: str, *, add_special_tokens: bool = True, max_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> list[int]:  # fmt: skip
        """A raw text's token ids (`add_special_tokens`: the tokenizer's BOS / EOS rules, as vLLM's default).
        With `max_tokens` (the context), a text with more bytes than the room `output_tokens` (None: not known,
        the whole context) leaves can hold is a ParamError("prompt") before tokenizing (megabytes take seconds
        to tokenize, only to be refused for the context)."""
        if max_tokens is not None:
            self.check_size(text, max_tokens, "prompt", output_tokens)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def check_size(self, text: str, max_tokens: int, where: str, output_tokens: int | None = None) -> None:
        """TextTooLong(where) when `text` has more UTF-8 bytes than the room `output_tokens` (None: not known
        here, 0) leaves in a `max_tokens`-token context can hold (TextSizeBound), in the shape of vLLM's
        character-based check (worldserve/context_limits.py)."""
        room = max(0, max_tokens - (output_tokens or 0))
        bound = self.text_bound
        if bound.bytes_per_token is None or (size := bound.size_over(text, room)) is None:
            return
        # (TextSizeBound's own limit: its 64-token margin for a template over the room)
        limit = (room + 64) * bound.bytes_per_token
        refusal = text_size_refusal(size, limit, room, output_tokens, max_tokens, where)
        raise TextTooLong(refusal.param, refusal.message)

    @functools.cached_property
    def text_bound(self) -> TextSizeBound:
        """Refuses a text too long for the context before it is tokenized (models/cosmos3/prompt.py)."""
        return TextSizeBound(self.tokenizer)

    def decode(self, ids: list[int], *, param: str = "tokens") -> str:
        """The text of token ids (special tokens kept, as vLLM's /detokenize); ParamError(param) for a bad id."""
        self.check_ids(ids, param)
        return self.tokenizer.decode(ids)

    def bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word as it starts a text and, when that tokenizes to a
        different first token but as many tokens, after a space (mid-text)."""
        stripped = [word.lstrip() for word in words]
        if not stripped:
            return ()
        encode = self.tokenizer  # (one batched call: 60,000 words take 2.8 s, 5.0 s one by one, on a dev CPU)
        alones = encode(stripped, add_special_tokens=False)["input_ids"]
        spaceds = encode([" " + word for word in stripped], add_special_tokens=False)["input_ids"]
        out: list[tuple[int, ...]] = []
        for alone, spaced in zip(alones, spaceds, strict=True):
            if not alone:
                continue
            out.append(tuple(alone))
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(tuple(spaced))
        return tuple(out)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary string (byte-level pieces, e.g. "Ġworld"), as vLLM's `return_token_strs`."""
        return list(self.tokenizer.convert_ids_to_tokens(ids))

    def check_ids(self, ids: Iterable[int], param: str) -> None:
        """ParamError(param) unless every id is in the vocabulary."""
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ParamError(
                param, f"Token id {bad} is out of vocabulary (valid ids: 0 to {self.vocab_size - 1})"
            )
