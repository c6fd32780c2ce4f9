"""--reasoning-parser qwen3 (api/reasoning.py): a <think> answer split into reasoning_content and content, a
plain answer left as content (the pain point of parsers that route it all to reasoning_content); streamed
deltas add up to the finished split however the text is cut; over real HTTP (the tiny Reasoner, answers
forced by a regex as a random model writes no <think> of its own) with include_reasoning and tool calls.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from reasoner_helpers import tiny_reasoner
from serving_helpers import serve_reasoner

from worldserve.api.reasoning import ReasoningStream, split_reasoning
from worldserve.chat_params import StructuredOutput

TEXTS = [
    "<think>\nThe sky scatters blue light.\n</think>\n\nBlue.",
    "  <think>short</think>answer",
    "<think>cut by max_tokens, never closed",
    "<think></think>",
    "A plain answer, no thoughts: </think> and <think> later are text.",
    "<thin is not <think>",
    "",
]


def test_split_of_finished_answers():
    assert split_reasoning(TEXTS[0]) == ("\nThe sky scatters blue light.\n", "\n\nBlue.")
    assert split_reasoning(TEXTS[1]) == ("short", "answer")
    assert split_reasoning(TEXTS[2]) == ("cut by max_tokens, never closed", None)
    assert split_reasoning(TEXTS[3]) == (None, None)
    assert split_reasoning(TEXTS[4]) == (None, TEXTS[4])


@pytest.mark.parametrize("text", TEXTS)
def test_stream_adds_up_to_the_split(text):
    reasoning, content = split_reasoning(text)
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, max(len(text), 2)), min(max(len(text) - 1, 0), rng.randint(0, 10))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream, got = ReasoningStream(), {"reasoning_content": "", "content": ""}
        for i, piece in enumerate(pieces):
            for delta in stream.feed(piece, i == len(pieces) - 1):
                (key,) = delta
                got[key] += delta[key]
        assert (got["reasoning_content"] or None, got["content"] or None) == (reasoning, content or None)


MODEL = "test-model"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
THOUGHT = "<think>\\nBecause of Rayleigh scattering\\.\\n</think>\\n\\n(Blue|Azure)\\."


@pytest.fixture(scope="module")
def url(tiny_ckpt, tmp_path_factory):
    with serve_reasoner(tiny_reasoner(tiny_ckpt), tmp_path_factory.mktemp("reasoning"), model=MODEL,
                        name="test-reasoning-uvicorn", reasoning_parser="qwen3") as base:  # fmt: skip
        yield base


def _chat(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 60, **body},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed(url: str, **body) -> tuple[str, str]:
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "max_tokens": 60, "stream": True, **body}) as r:  # fmt: skip
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    return "".join(d.get("reasoning_content") or "" for d in deltas), "".join(
        d.get("content") or "" for d in deltas
    )


def test_thoughts_and_answer_over_http(url, reasoner):
    forced = {"structured_outputs": {"regex": THOUGHT}, "seed": 3}
    message = _chat(url, **forced)["message"]
    assert message["reasoning_content"] == "\nBecause of Rayleigh scattering.\n"
    assert message["content"] in ("\n\nBlue.", "\n\nAzure.")
    assert _streamed(url, **forced) == (message["reasoning_content"], message["content"])
    assert _chat(url, include_reasoning=False, **forced)["message"]["reasoning_content"] is None
    assert _streamed(url, include_reasoning=False, **forced)[0] == ""
    no_think = {str(reasoner.grammars.think_ids[0]): -100}  # a grammar's answer could open with <think>
    plain = _chat(url, structured_outputs={"regex": "(Blue|Azure)\\."}, logit_bias=no_think)["message"]
    assert plain["reasoning_content"] is None and plain["content"] in ("Blue.", "Azure.")


def _events(url: str, **body) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "max_tokens": 60, "stream": True, **body}) as r:  # fmt: skip
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_thoughts_come_under_both_names(url):
    """vLLM renamed reasoning_content to reasoning (v0.11.1) and then dropped the old name: the thoughts come
    under both, in the message and in every streamed delta, so the clients of either find them."""
    forced = {"structured_outputs": {"regex": THOUGHT}, "seed": 3}
    message = _chat(url, **forced)["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nBecause of Rayleigh scattering.\n"
    deltas = [e["choices"][0]["delta"] for e in _events(url, **forced) if e["choices"]]
    thoughts = [d for d in deltas if "reasoning" in d or "reasoning_content" in d]
    assert thoughts and all(d["reasoning"] == d["reasoning_content"] for d in thoughts)
    assert "".join(d["reasoning"] for d in thoughts) == message["reasoning"]
    plain = _chat(url, **forced, include_reasoning=False)["message"]
    assert plain["reasoning"] is None and plain["reasoning_content"] is None


def test_dropped_thoughts_take_the_logprobs_with_them(url):
    """include_reasoning false: no logprobs, streamed or not (vLLM's rule; their tokens would show the
    thoughts, streamed in chunks of their own), the answer's text unchanged."""
    forced = {"structured_outputs": {"regex": THOUGHT}, "seed": 3, "logprobs": True, "top_logprobs": 2}
    shown = _chat(url, **forced)
    assert shown["logprobs"]["content"][0]["token"] == "<think>"
    hidden = _chat(url, **forced, include_reasoning=False)
    assert hidden["logprobs"] is None and hidden["message"]["content"] == shown["message"]["content"]
    events = _events(url, **forced, include_reasoning=False)
    assert all(e["choices"][0]["logprobs"] is None for e in events if e["choices"])
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert content == shown["message"]["content"]


def test_tool_calls_come_from_the_content_after_the_thoughts(url):
    tool = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}
    regex = '<think>\\nI should look\\.\\n</think>\\n\\n<tool_call>\\n\\{"name": "look", "arguments": \\{\\}\\}\\n</tool_call>'
    choice = _chat(url, tools=[tool], structured_outputs={"regex": regex})
    assert (
        choice["finish_reason"] == "tool_calls"
        and choice["message"]["reasoning_content"] == "\nI should look.\n"
    )
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["look"]
    assert choice["message"]["content"] == "\n\n"


def test_the_flag_reaches_the_app():
    """`--reasoning-parser qwen3` is a server flag (build_app's reasoning_parser); other parsers are refused."""
    from worldserve.cli import build_parser
    from worldserve.commands import serve

    def options(*argv):
        return serve.app_settings(
            serve.engine_config(build_parser(["serve", *argv]).parse_args(["serve", *argv]))
        )

    assert options("--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    assert options().reasoning_parser is None
    with pytest.raises(SystemExit):
        options("--reasoning-parser", "deepseek_r1")


def _ids(reasoner, text: str) -> list[int]:
    return reasoner.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_grammar_starts_after_the_thoughts(reasoner):
    """Under --reasoning-parser the answer may open with <think> (besides the grammar's own first tokens);
    its thoughts are free and the grammar starts after </think>. An answer that opens otherwise follows
    the grammar from its first token, and <think> is then never allowed."""
    compiler = reasoner.grammars
    start, end = compiler.think_ids
    choice = StructuredOutput(kind="choice", spec='["Blue.", "Azure."]')
    free = torch.zeros(compiler.vocab_size)
    first = torch.isfinite(compiler.grammar(choice).constrain(free))  # the grammar's own first tokens
    thinking = compiler.grammar(choice, think=True)
    opening = torch.isfinite(thinking.constrain(free))
    assert opening[start] and not first[start] and not opening[end]
    assert torch.equal(opening.clone().index_fill_(0, torch.tensor([start]), False), first)
    thinking.accept(start)
    thoughts = _ids(reasoner, "Any thoughts at all, <|im_start|> and <think> too")
    for token in [
        *thoughts,
        *compiler.end_ids,
    ]:  # an end id taken while thinking (ignore_eos) changes nothing
        assert torch.equal(thinking.constrain(free), free)  # free while thinking
        thinking.accept(token)
    thinking.accept(end)
    assert torch.equal(torch.isfinite(thinking.constrain(free)), first)  # the grammar starts now
    for token in _ids(reasoner, "Azure."):
        thinking.accept(token)
    assert set(torch.isfinite(thinking.constrain(free)).nonzero()[:, 0].tolist()) == set(compiler.end_ids)
    plain = compiler.grammar(choice, think=True)
    plain.accept(_ids(reasoner, "Blue.")[0])
    assert not torch.isfinite(plain.constrain(free))[start]


def test_a_grammar_that_writes_the_thoughts_governs_them(reasoner):
    """A grammar that may open with <think> itself keeps governing the thoughts (the regex tests above rely
    on it); <think> and </think> are one token each, as in Qwen's vocabulary."""
    compiler = reasoner.grammars
    grammar = compiler.grammar(StructuredOutput(kind="regex", spec="<think>ok</think>done"), think=True)
    ids = _ids(reasoner, "<think>ok</think>done")
    assert ids[0] == compiler.think_ids[0] and compiler.think_ids[1] in ids
    free = torch.zeros(compiler.vocab_size)
    for token in ids:
        mask = torch.isfinite(grammar.constrain(free))
        assert mask[token] and int(mask.sum()) < compiler.vocab_size
        grammar.accept(token)
    assert set(torch.isfinite(grammar.constrain(free)).nonzero()[:, 0].tolist()) == set(compiler.end_ids)


def test_a_constrained_answer_thinks_first_over_http(url, reasoner):
    """Biased to open with <think> and close at once, the answer thinks (empty thoughts), then follows the
    choice: reasoning_content None, content one of the choices; the tokens show the thought tags (and, last,
    the end-of-sequence token that ended it)."""
    start, end = reasoner.grammars.think_ids
    choice = _chat(url, structured_outputs={"choice": ["Blue.", "Azure."]}, logprobs=True,
                   logit_bias={str(start): 90, str(end): 100})  # fmt: skip
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert tokens[:2] == ["<think>", "</think>"] and "".join(tokens[2:-1]) == choice["message"]["content"]
    assert tokens[-1] in ("<|im_end|>", "<|endoftext|>")
    assert (
        choice["message"]["content"] in ("Blue.", "Azure.") and choice["message"]["reasoning_content"] is None
    )
    assert choice["finish_reason"] == "stop"
