"""A structured output's grammar applied to the Reasoner's logits, token by token (llguidance's matcher).

`GrammarCompiler` (one per Reasoner: the tokenizer's byte-level vocabulary, built once) makes a
`TokenGrammar` per chat: `constrain(logits [V])` sets every token the grammar forbids next to -inf (the end
ids only once the grammar is complete), `accept(token)` advances it; `allows_first` says whether a set of ids
(a request's allowed_token_ids) holds a token the grammar takes first. The mask is computed on the host (a
bit per token, ~19 KB on Qwen's 151,936-id vocabulary) and unpacked on the logits' device.
`constrain_rows(logits [B, V], grammars)` masks a batch at once (one copy to the device, one pass); the
Reasoner calls it right after it launches a decode step, so that the host's share of the work (the masks:
~15 us a chat) runs while the GPU decodes.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
import tokenizers
import torch
from llguidance import TokenizerWrapper
from torch import Tensor

from worldserve.chat_params import THINK_END, THINK_START, StructuredOutput
from worldserve.params import ParamError
from worldserve.sampling.grammar import grammar_text, on_big_stack
from worldserve.sampling.token_bytes import token_bytes

log = logging.getLogger(__name__)

COMPILED_GRAMMARS = 64
"""Compiled grammars kept per Reasoner (the same schema in request after request compiles once)."""


class GrammarCompiler:
    """A Reasoner's grammars: its tokenizer as llguidance sees it (built on first use: about a second for
    Qwen's vocabulary) and the most recently compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: Sequence[int]) -> None:
        """`vocab_size`: the logits' width (the LM head may have more rows than the tokenizer has ids: those
        are never allowed); `end_ids`: the ids that end a completion, allowed once a grammar is complete."""
        self.hf_tokenizer, self.vocab_size, self.end_ids = tokenizer, vocab_size, sorted(end_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the API's threads compile ahead (`compile`), the chat worker reads
        vocab = tokenizer.get_vocab()
        self.think_ids = (
            (vocab[THINK_START], vocab[THINK_END]) if THINK_START in vocab and THINK_END in vocab else None
        )
        """(<think>, </think>) ids, each one token in Qwen3's vocabulary (None where they are not)."""

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _ll_tokenizer(self.hf_tokenizer, self.vocab_size, self.end_ids)
            return self._tokenizer

    def compile(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """`so`'s compiled grammar (kept, by its StructuredOutput, for the chats that use it), its first mask
        computed once. The API calls this (api/structured_fields.py) while it reads the request, on
        the request's thread, which waits for the compile on a big-stack thread (grammar.on_big_stack): a
        costly or broken grammar costs that request, not the chat worker, which every running chat shares
        and which then finds it here (unless COMPILED_GRAMMARS others came in between). ParamError naming the
        field when the grammar is invalid or fails at its first two tokens."""
        with self._lock:
            template = self._compiled.get(so)
        if template is None:
            template = on_big_stack(_compiled_and_tried, self.tokenizer, grammar_text(so))
            if template.is_error():
                raise ParamError(so.field, f"invalid {so.kind} constraint: {_short(template.get_error())}")
        with self._lock:
            self._compiled[so] = template
            self._compiled.move_to_end(so)
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        return template

    def grammar(self, so: StructuredOutput, think: bool = False) -> TokenGrammar:
        """A fresh TokenGrammar for one chat (ParamError naming the field when the grammar is invalid); with
        `think` the answer may think (<think> ... </think>) before the grammar starts, where the vocabulary
        has those two tokens."""
        return TokenGrammar(self.compile(so).deep_copy(), self.vocab_size, self.end_ids,
                            self.think_ids if think else None)  # fmt: skip

    def allows_first(self, so: StructuredOutput, token_ids: Sequence[int], think: bool = False) -> bool:
        """Whether any of `token_ids` may be an answer's first token under `so`'s grammar (with `think`, as
        `grammar` has it, <think> too); ids outside the logits' width never may."""
        # [W]: bit j of word w allows token 32 w + j
        bits = self.grammar(so, think).words.view(np.uint32)
        width = min(len(bits) * 32, self.vocab_size)
        return any(0 <= t < width and bool(bits[t // 32] >> np.uint32(t % 32) & 1) for t in token_ids)


def _ll_tokenizer(hf_tokenizer: Any, vocab_size: int, end_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: each id's bytes with only the truly special ids special
    (sampling/token_bytes.py: from the tokenizer's JSON alone, llguidance would take <tool_call> or <think> for
    special tokens a grammar cannot spell)."""
    try:
        tokens, special = token_bytes(hf_tokenizer, vocab_size)
    except ValueError:  # not byte-level BPE: llguidance reads the tokenizer's JSON itself
        return llguidance.LLTokenizer(
            hf_tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(end_ids)
        )

    # a special token's text (a grammar writing "<|im_end|>") tokenized as plain text, bytes the grammar can
    # take; on a copy of the tokenizer: transformers' split_special_tokens sets that mode on the shared one,
    # which would change how prompts tokenize on other threads meanwhile
    plain = tokenizers.Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    plain.encode_special_tokens = True

    class _Vocabulary:  # what llguidance's TokenizerWrapper reads
        eos_token_id, bos_token_id = end_ids[0], None

        def __init__(self) -> None:
            self.tokens, self.special_token_ids = tokens, special

        def __call__(self, text: str) -> list[int]:
            return plain.encode(text, add_special_tokens=False).ids

    return llguidance.LLTokenizer(
        TokenizerWrapper(_Vocabulary()), n_vocab=vocab_size, eos_token=list(end_ids)
    )


def _compiled_and_tried(tokenizer: llguidance.LLTokenizer, text: str) -> llguidance.LLMatcher:
    """The grammar compiled, its first mask computed (lexer errors show there; the lexer states it builds are
    shared with the chats' copies: a regex whose first mask takes 0.75 s costs each copy 0.14 s), and, on a
    copy, one allowed token taken and the next mask computed: a grammar past llguidance's limits (e.g.
    "a{99999999}") fails there, at its second token, which a 400 now reports instead of a cut answer. The
    returned matcher is in its error state when either step failed."""
    template = llguidance.LLMatcher(tokenizer, text, log_level=0)
    if template.is_error():
        return template
    words = _mask_words(template)
    if template.is_error():
        return template
    ends = set(tokenizer.eos_tokens)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")  # [W * 32]: bit t allows token t
    first = next((int(t) for t in np.flatnonzero(bits) if int(t) not in ends), None)
    if first is not None:
        trial = template.deep_copy()
        if not trial.consume_token(first):
            return trial
        trial.compute_bitmask()
        if trial.is_error():
            return trial
    return template


def _mask_words(matcher: llguidance.LLMatcher) -> np.ndarray:
    """The matcher's next-token mask as int32 words [ceil(V / 32)]: bit j of word w allows token 32 w + j."""
    return np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)


def _short(error: str, limit: int = 2000) -> str:
    """An llguidance error for a client: without the parser dump it appends (<state> and <grammar> blocks:
    internal counters and the request's own constraint), the stop reason of a grammar that matches nothing
    said in words, cut (some errors quote the whole grammar)."""
    error = re.sub(r"<(state|grammar)>.*?</\1>", "", error, flags=re.DOTALL).strip()
    if error.startswith("NoExtensionBias"):  # no token can start (or continue) any text the grammar allows
        return "it matches no text (no token can start or continue a string it allows)"
    return error if len(error) <= limit else error[:limit] + " ..."


class TokenGrammar:
    """One chat's grammar state: which tokens may come next, advanced by each sampled token. Once an end id
    was taken (only with ignore_eos does the chat go on), nothing is constrained any more, as in vLLM.

    With `think` = (<think> id, </think> id) (a chat under --reasoning-parser), the answer may think first, as
    vLLM lets it: the first token may also be <think>, and then nothing is constrained until </think>, after
    which the grammar starts. An answer that opens otherwise follows the grammar from its first token (vLLM
    waits for a </think> there too, which an answer that does not think never writes: its grammar never
    starts). A grammar that may itself open with <think> governs the thoughts as well."""

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, end_ids: Sequence[int] = (),
        think: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        self._matcher, self._vocab, self.end_ids = matcher, vocab_size, frozenset(end_ids)
        self.ended = False
        self._think = think if think is not None else (-1, -1)  # (no token is -1: the phase starts at answer)
        self._phase = "open" if think is not None else "answer"  # "open" -> "thinking" -> "answer"
        self._words: np.ndarray | None = None  # [W] int32 host bits of the next token's mask, once computed

    @property
    def idle(self) -> bool:
        """Nothing is constrained next (the grammar ended, or the answer is thinking)."""
        return self.ended or self._phase == "thinking"

    @property
    def words(self) -> np.ndarray:
        """[ceil(V / 32)] int32 on the host: bit j of word w allows token 32 w + j next (computed once per
        step; ~15 us with Qwen's vocabulary, llguidance releasing the GIL)."""
        if self._words is None:
            self._words = _mask_words(self._matcher)
            if self._phase == "open":  # <think> may open the answer too
                start, bits = self._think[0], self._words.copy().view(np.uint32)
                bit = np.uint32(1 << (start % 32))
                if bits[start // 32] & bit:  # the grammar writes <think> itself: it governs the thoughts too
                    self._phase = "answer"
                else:
                    bits[start // 32] |= bit
                    self._words = bits.view(np.int32)
        return self._words

    def constrain(self, logits: Tensor) -> Tensor:
        """logits [V] with every token the grammar forbids next at -inf (a new tensor)."""
        return constrain_rows(logits[None], [self])[0]

    def accept(self, token: int) -> None:
        """Advance past the sampled `token`. A token the mask did not allow (it cannot be sampled) leaves the
        grammar in its error state, whose mask allows only the end ids: the completion then stops."""
        self._words = None
        if self.ended:
            return
        if self._phase == "thinking":  # only </think> counts (an end id here goes on, with ignore_eos)
            if token == self._think[1]:
                self._phase = "answer"
            return
        if token in self.end_ids:
            self.ended = True
            return
        if self._phase == "open":
            self._phase = "thinking" if token == self._think[0] else "answer"
            if self._phase == "thinking":
                return
        if not self._matcher.consume_token(token):
            log.error("structured output: token %d refused by the grammar: %s", token,
                      _short(self._matcher.get_error(), 300))  # fmt: skip


def constrain_rows(logits: Tensor, grammars: Sequence[TokenGrammar | None]) -> Tensor:
    """logits [B, V] with row b's forbidden tokens at -inf by grammars[b] (None: the row as it is), a new
    tensor: the rows' host bits gathered in one numpy array (no torch CPU ops: their thread pool costs more
    than the work), one host-to-device copy and one pass for the batch (a copy and a pass per chat cost
    ~0.1 ms of launches each: 4 ms a step at 32 chats)."""
    rows = [(i, g) for i, g in enumerate(grammars) if g is not None and not g.idle]
    if not rows:
        return logits
    width = max(len(rows[0][1].words), (logits.shape[1] + 31) // 32)  # llguidance may add a word
    words = np.full((logits.shape[0], width), -1, dtype=np.int32)  # [B, W]: every token allowed
    for i, grammar in rows:
        words[i] = grammar.words
    return logits.masked_fill(~_unpack(words, logits.shape[1], logits.device), float("-inf"))


def _unpack(host: np.ndarray, vocab: int, device: torch.device) -> Tensor:
    """Host bits [R, W] int32 -> [R, vocab] bool on `device` (bit j of word w: token 32 w + j)."""
    words = torch.from_numpy(host)
    if device.type == "cuda":
        words = words.pin_memory().to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1  # [R, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()
