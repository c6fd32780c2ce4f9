"""How a Reasoner chat ends, by vLLM's rules (CPU, fp32, tiny checkpoint):

- min_tokens: a stop string counts only when it ends in a token after the first min_tokens
  (vllm/v1/engine/detokenizer.py: stop strings are checked once num_output_tokens() > min_tokens, over the
  text of the tokens past min_tokens);
- the token that ends a chat (an end-of-sequence or a request's stop token id) adds no text, but counts as a
  completion token (vLLM keeps it in the output token ids, so usage.completion_tokens counts it);
- every logprob equals log_softmax of transformers' Qwen3VLForConditionalGeneration logits.
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


def test_the_ending_token_counts_and_logprobs_are_the_oracles(reasoner, oracle):
    """A greedy chat whose 4th token is made a stop token id ends there: 3 tokens of text, 4 completion
    tokens, and the logprobs (with the top 2) of its 3 text tokens equal transformers' log_softmax."""
    params = ChatParams(messages=MSGS, temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=2)
    free = reasoner.start(params)
    while free.finish_reason is None:
        free.step()
    assert len(free.token_ids) == 6
    stop_id = free.token_ids[3]
    assert stop_id not in free.token_ids[:3], "pick another prompt: the stop id comes earlier"
    s = reasoner.start(ChatParams(messages=MSGS, temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=2,
                                  stop_token_ids=(stop_id,)))  # fmt: skip
    deltas = []
    while s.finish_reason is None:
        deltas.append(s.step())
    assert s.token_ids == free.token_ids[:3] and (s.finish_reason, s.stop_reason) == ("stop", stop_id)
    assert s.completion_tokens == deltas[-1].completion_tokens == 4 and deltas[-1].text == ""
    entries = [e for d in deltas for e in d.logprobs]
    assert [e.token for e in entries] == [reasoner.tokenizer.decode([t]) for t in free.token_ids[:3]]
    prompt = reasoner.build_prompt(params)
    with torch.no_grad():
        ref = oracle(input_ids=torch.tensor([prompt.input_ids + free.token_ids[:3]])).logits[0]
    lp = torch.log_softmax(ref[len(prompt.input_ids) - 1 :][:3], -1)
    assert [e.logprob for e in entries] == pytest.approx(
        [float(lp[i, t]) for i, t in enumerate(free.token_ids[:3])], abs=1e-4
    )
    assert [v for e in entries for _, v in e.top] == pytest.approx(
        lp.topk(2).values.flatten().tolist(), abs=1e-4
    )
