"""A chat's text: ReasonerSession's incremental detokenization and stop strings against the plain algorithm.

The plain algorithm (the oracle here) decodes all tokens at every step, finishes at the first stop string
to appear (the one ending first when a token completes several; cut before it, or after it with
include_stop_str_in_output), holds back an unfinished UTF-8 character (left out at the end, as vLLM's
DecodeStream leaves it) and, without include_stop_str_in_output, len(longest stop) - 1 characters, and
sends the rest. The session decodes only the tokens since its last boundary. A byte-level tokenizer (ids 0-255
are bytes, 300 is the merged token b"P\\xe4": a stop string's last letter and the first byte of a
character in one token, as byte-level BPE vocabularies have) drives both over random token streams.
"""

from __future__ import annotations

import random

import torch

from worldserve.runner.chat_logprobs import TokenTexts
from worldserve.runner.reasoner_session import ReasonerSession
from worldserve.sampling.tokens import TokenSampler

EOS = 301
"""The tokenizer's end-of-sequence id (stop_reason None)."""
ENDOFTEXT = 302
"""Another end-of-sequence id of the model (a generation config's <|endoftext|>: stop_reason its id)."""
MERGED = {300: b"P\xe4"}
STOPS = [(), ("STOP",), ("ab", "ba"), ("aba", "bab", "abab"), ("\u4e2d",), ("P\u4e2d", "OK")]


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        out = b"".join(MERGED.get(i, bytes([i]) if i < 256 else b"") for i in ids)
        return out.decode("utf-8", "replace")

    def convert_tokens_to_ids(self, token):
        """No added tokens (<think> is its bytes here): None, as transformers answers without an unk token."""
        return None


class NoPrefixCache:
    def register(self, prompt, generated, seq):
        pass


class FakeReasoner:
    tokenizer = ByteTokenizer()
    token_texts = TokenTexts(tokenizer)
    stop_token_ids = frozenset({EOS, ENDOFTEXT})
    reported_stop_ids = frozenset({ENDOFTEXT})
    prefiller = NoPrefixCache()

    def forget(self, session):
        pass


class FakeSeq:
    def release(self):
        pass


class FakePrompt:
    input_ids = [1]


def run_session(tokens, stop, max_tokens, keep=False):
    s = ReasonerSession(FakeReasoner(), TokenSampler(), FakeSeq(), torch.zeros(1), 0, prompt=FakePrompt(), started=1,
                        max_tokens=max_tokens, stop=stop, ends=(False, 0, (), keep))  # fmt: skip
    out = []
    for t in tokens:
        delta, _ = s.advance(t)
        out.append(delta.text)
        if delta.finish_reason:
            return "".join(out), delta.finish_reason, delta.stop_reason, delta.completion_tokens
        s.receive(torch.zeros(1))
    return "".join(out), None, None, s.completion_tokens


def run_plain(tokens, stop, max_tokens, keep=False):
    tok, ids, emitted, out = ByteTokenizer(), [], 0, []
    held = 0 if keep else max((len(x) - 1 for x in stop), default=0)
    for t in tokens:
        finished = t == EOS
        if not finished:
            ids.append(t)
        text = tok.decode(ids).rstrip("\ufffd")
        found = [(i + len(x), n, i, x) for n, x in enumerate(stop) if (i := text.find(x)) >= 0]
        cut, matched = min(found)[2:] if found else (-1, None)
        if finished or cut >= 0 or len(ids) >= max_tokens:
            reason = "stop" if finished or cut >= 0 else "length"
            end = (cut + len(matched) if keep else cut) if cut >= 0 else len(text)
            out.append(text[emitted : max(end, emitted)])
            return "".join(out), reason, (matched if cut >= 0 else None), len(ids) + finished  # EOS counts
        end = len(text) - held
        out.append(text[emitted : max(end, emitted)])
        emitted = max(end, emitted)
    return "".join(out), None, None, len(ids)


def test_stop_string_completed_by_a_token_that_starts_a_character():
    """ "OK STO" + b"P\\xe4": the stop string is complete although the character after it is not; the session
    stops there (the character never arrives, or arrives later, or the chat ends at that token)."""
    pre = list(b"OK STO") + [300]
    for tokens, max_tokens in ((pre + [EOS], 99), (pre, len(pre)), (pre + [0xB8, 0xAD] + list(b" more"), 99)):
        assert run_session(tokens, ("STOP",), max_tokens) == ("OK ", "stop", "STOP", 7)


def test_incremental_text_equals_the_plain_algorithm_on_random_streams():
    rng = random.Random(0)
    alphabet = [*b"abOKSTP ", 0xE4, 0xB8, 0xAD, 0xC3, 0xA4, 300, EOS]
    for _ in range(4000):
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 14))]
        stop, max_tokens, keep = rng.choice(STOPS), rng.randint(1, 16), rng.random() < 0.3
        got, want = run_session(tokens, stop, max_tokens, keep), run_plain(tokens, stop, max_tokens, keep)
        assert got == want, (tokens, stop, keep)


def test_a_stop_token_id_is_output_as_vllm_outputs_it():
    """A request's stop token id (here the byte "X", not a special token) ends the chat: its text joins the
    output only with include_stop_str_in_output, and then a stop string it completes is the stop_reason (vLLM's
    detokenizer searches the text that token adds: vllm/v1/engine/detokenizer.py update, then the output
    processor's stop_reason = the string); every token, the ending one too, has its logprobs entry; token_ids
    leave it out and completion_tokens count it."""
    tokens = [*b"abc", ord("X")]
    for keep, text, reason in ((False, "abc", ord("X")), (True, "abcX", "cX")):
        s = ReasonerSession(FakeReasoner(), TokenSampler(), FakeSeq(), torch.zeros(302), 0, prompt=FakePrompt(), started=1,
                            max_tokens=9, stop=("cX",), top_logprobs=0, ends=(False, 0, (ord("X"),), keep))  # fmt: skip
        deltas = []
        for t in tokens:
            deltas.append(s.advance(t)[0])
            if s.finish_reason is None:
                s.receive(torch.zeros(302))
        assert "".join(d.text for d in deltas) == text
        assert (s.finish_reason, s.stop_reason, s.completion_tokens) == ("stop", reason, 4)
        assert s.token_ids == [*b"abc"]
        assert [e.token for d in deltas for e in d.logprobs] == ["a", "b", "c", "X"]


def test_the_models_other_end_of_sequence_id_is_the_stop_reason():
    """vLLM adds the generation config's end-of-sequence ids other than the tokenizer's eos to a request's
    stop_token_ids: a chat Qwen's <|endoftext|> ends has that id as its stop_reason (it was None, as for the
    tokenizer's <|im_end|>)."""
    for end, reason in ((EOS, None), (ENDOFTEXT, ENDOFTEXT)):
        assert run_session([*b"ab", end], (), 9) == ("ab", "stop", reason, 3)


def test_stop_strings_end_the_answer_not_its_thoughts():
    """With stops_after_thoughts (a --reasoning-parser server, as vLLM defers stop strings while a request
    reasons): in an answer opening with <think>, a stop string matches only after </think> (also one that
    would straddle it); an answer without thoughts stops as before; without the option, the first match wins."""

    def run(text, defer, stop=("STOP",)):
        s = ReasonerSession(FakeReasoner(), TokenSampler(), FakeSeq(), torch.zeros(1), 0, prompt=FakePrompt(), started=1,
                            max_tokens=len(text), stop=stop)  # fmt: skip
        s.defer_stops_past_thoughts(defer)
        out = []
        for t in text.encode():
            delta, _ = s.advance(t)
            out.append(delta.text)
            if delta.finish_reason:
                return "".join(out), delta.stop_reason
            s.receive(torch.zeros(1))
        return "".join(out), None

    thinking = "<think>a STOP b</think> c STOP d"
    assert run(thinking, True) == ("<think>a STOP b</think> c ", "STOP")
    assert run(thinking, False) == ("<think>a ", "STOP")
    assert run(" x STOP y", True) == (" x ", "STOP")  # no thoughts: nothing deferred
    assert run("<think>a STOP", True) == ("<think>a STOP", None)  # thinking to the end (max_tokens): no stop
    assert run("<think>a</think>b", True, stop=("k>b", "b")) == (
        "<think>a</think>",
        "b",
    )  # not across </think>
