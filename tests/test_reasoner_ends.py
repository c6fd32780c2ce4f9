"""How a Reasoner chat ends, by vLLM's rules (CPU, fp32, tiny checkpoint):

- min_tokens: a stop string counts only when it ends in a token after the first min_tokens
  (vllm/v1/engine/detokenizer.py: stop strings are checked once num_output_tokens() > min_tokens, over the
  text of the tokens past min_tokens);
- the token that ends a chat (an end-of-sequence or a request's stop token id) is output as vLLM outputs it
  (vllm/v1/engine/detokenizer.py update: kept in the output token ids, only its text is skipped): it counts
  as a completion token and has the last logprobs entry; with include_stop_str_in_output its text is in the
  output (a special token's subject to skip_special_tokens);
- every logprob, the ending token's too, equals log_softmax of transformers' Qwen3VLForConditionalGeneration
  logits.
"""

from __future__ import annotations

import pytest
import torch

from worldserve.chat_params import ChatMessage, ChatParams

MSGS = (ChatMessage(role="user", content="Tell me a story."),)


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    from worldserve.bench.reasoner_oracle import qwen3vl_oracle

    return qwen3vl_oracle(tiny_ckpt)[0]


def _run(reasoner, **kw):
    """(per-token texts, session) of a seeded chat stepped to its end."""
    s = reasoner.start(ChatParams(messages=MSGS, temperature=1.0, seed=4, ignore_eos=True, **kw))
    texts = []
    while s.finish_reason is None:
        texts.append(s.step().text)
    return texts, s


def test_a_stop_string_ending_within_min_tokens_does_not_stop(reasoner):
    """A stop string first completed by token k stops a chat with min_tokens k - 1 there, but not one with
    min_tokens k: that one goes on to the next occurrence ending after token k (or to its length)."""
    _, free = _run(reasoner, max_tokens=24)
    decode = reasoner.tokenizer.decode
    ends = [len(decode(free.token_ids[: i + 1])) for i in range(len(free.token_ids))]  # text length per token
    full = decode(free.token_ids)
    k, stop = next(
        (i + 1, full[ends[i] - 2 : ends[i]])
        for i in range(2, len(ends) - 4)
        if ends[i] - ends[i - 1] == 1 and full.find(full[ends[i] - 2 : ends[i]]) == ends[i] - 2
    )  # token k adds one character and completes `stop` for the first time
    texts, early = _run(reasoner, max_tokens=24, stop=(stop,), min_tokens=k - 1)
    assert "".join(texts) == full[: ends[k - 1] - 2] and early.completion_tokens == k
    assert early.stop_reason == stop
    texts, late = _run(reasoner, max_tokens=24, stop=(stop,), min_tokens=k)
    nxt = full.find(stop, ends[k - 1] - 1)  # the first occurrence ending after token k
    assert "".join(texts) == (full if nxt < 0 else full[:nxt])
    assert late.finish_reason == ("length" if nxt < 0 else "stop") and late.completion_tokens > k


def _ended(reasoner, **kw):
    """(deltas, session) of a greedy chat with logprobs (the top 2) stepped to its end."""
    s = reasoner.start(ChatParams(messages=MSGS, temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=2,
                                  **kw))  # fmt: skip
    deltas = []
    while s.finish_reason is None:
        deltas.append(s.step())
    return deltas, s


def _assert_oracles(reasoner, oracle, entries, tokens):
    """`entries` (TokenLogprobs of `tokens`, the last one the ending token) equal transformers' log_softmax."""
    prompt = reasoner.build_prompt(ChatParams(messages=MSGS))
    with torch.no_grad():
        ref = oracle(input_ids=torch.tensor([prompt.input_ids + tokens[:-1]])).logits[0]
    lp = torch.log_softmax(ref[len(prompt.input_ids) - 1 :], -1)
    assert [e.token for e in entries] == [reasoner.tokenizer.decode([t]) for t in tokens]
    assert [e.logprob for e in entries] == pytest.approx(
        [float(lp[i, t]) for i, t in enumerate(tokens)], abs=1e-4
    )
    assert [v for e in entries for _, v in e.top] == pytest.approx(
        lp.topk(2).values.flatten().tolist(), abs=1e-4
    )


def test_the_ending_token_counts_and_logprobs_are_the_oracles(reasoner, oracle):
    """A greedy chat whose 4th token is made a stop token id ends there: 3 tokens of text, 4 completion
    tokens, 4 logprobs entries (with the top 2), the stop token's last, all equal to transformers'
    log_softmax; with include_stop_str_in_output the stop token's text ends the output."""
    free = reasoner.start(ChatParams(messages=MSGS, temperature=0.0, max_tokens=6))
    while free.finish_reason is None:
        free.step()
    assert len(free.token_ids) == 6
    stop_id = free.token_ids[3]
    assert stop_id not in free.token_ids[:3], "pick another prompt: the stop id comes earlier"
    deltas, s = _ended(reasoner, stop_token_ids=(stop_id,))
    assert s.token_ids == free.token_ids[:3] and (s.finish_reason, s.stop_reason) == ("stop", stop_id)
    assert s.completion_tokens == deltas[-1].completion_tokens == 4 and deltas[-1].text == ""
    assert "".join(d.text for d in deltas) == reasoner.tokenizer.decode(free.token_ids[:3])
    entries = [e for d in deltas for e in d.logprobs]
    assert len(deltas[-1].logprobs) == 1
    _assert_oracles(reasoner, oracle, entries, free.token_ids[:4])
    kept, k = _ended(reasoner, stop_token_ids=(stop_id,), include_stop_str_in_output=True)
    text = "".join(d.text for d in kept)
    assert text == reasoner.tokenizer.decode(free.token_ids[:4]) and text.endswith(kept[-1].text)
    assert kept[-1].text and (k.stop_reason, k.completion_tokens, k.token_ids) == (stop_id, 4, s.token_ids)
    assert [e for d in kept for e in d.logprobs] == entries


@pytest.mark.parametrize("skip", [True, False])
def test_an_end_of_sequence_token_has_its_logprob_and_text_as_vllm(reasoner, oracle, skip):
    """<|im_end|> (a special end-of-sequence token), biased to come as soon as min_tokens lets it: the 3rd
    token ends the chat (stop_reason None), its entry reads "<|im_end|>" with the raw logits' log-probability
    (logit_bias is not in logprobs); include_stop_str_in_output puts its text in the output only without
    skip_special_tokens."""
    im_end = reasoner.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kw = dict(min_tokens=2, logit_bias=((im_end, 50.0),), skip_special_tokens=skip)
    deltas, s = _ended(reasoner, **kw)
    assert (s.finish_reason, s.stop_reason, len(s.token_ids), s.completion_tokens) == ("stop", None, 2, 3)
    entries = [e for d in deltas for e in d.logprobs]
    assert entries[-1].token == "<|im_end|>"
    _assert_oracles(reasoner, oracle, entries, [*s.token_ids, im_end])
    decode = reasoner.tokenizer.decode
    assert "".join(d.text for d in deltas) == decode(s.token_ids, skip_special_tokens=skip)
    kept, k = _ended(reasoner, include_stop_str_in_output=True, **kw)
    text = "".join(d.text for d in kept)
    assert text == decode([*s.token_ids, im_end], skip_special_tokens=skip)
    assert text.endswith("<|im_end|>") != skip and k.completion_tokens == 3
    assert [e for d in kept for e in d.logprobs] == entries
