"""The prefill's split into pieces (runner/prefill_graphs.py) on the CPU: the pieces run as plain calls
(capture=False) over the padded static buffers, attention eager between them, must give what the whole
und pass gives: the first token's logits and the K/V later steps read, for prompts padded up to their
bucket, an image prompt (deepstack rows), a next turn starting on cached blocks, several chats in one pass,
prompt logprobs, n choices, a preempted chat's resume, and a pass too large for the buckets (it takes the
plain und pass). The CUDA capture itself: the gpu test
in test_und_decoder_cuda.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reasoner_helpers import greedy_chats, tiny_reasoner

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart
from worldserve.models.cosmos3.layer import finish_math, qkv_math
from worldserve.runner.prefill_graphs import PrefillGraphs, prefill_buckets


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    """(plain Reasoner, Reasoner whose prefill runs the pieces), same weights, max bucket 256 tokens."""
    plain = tiny_reasoner(tiny_ckpt, max_model_len=1024)
    pieces = tiny_reasoner(tiny_ckpt, max_model_len=1024)
    model = pieces.prefiller.transformer
    pieces.prefiller.graphs = PrefillGraphs(
        model,
        (qkv_math, finish_math),
        num_deepstack=pieces.vision.num_deepstack,
        max_tokens=256,
        capture=False,
    )
    return plain, pieces


def _params(ids=None, image=None, text="What is it?", max_tokens=6) -> ChatParams:
    if ids is not None:
        return ChatParams(prompt_ids=tuple(ids), max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    content = (ChatPart(type="image", image=image), ChatPart(type="text", text=text))
    return ChatParams(
        messages=(ChatMessage(role="user", content=content),),
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )


def _run(reasoner, batch: list[ChatParams]) -> list[tuple[torch.Tensor, list[int]]]:
    """Each chat's first-token logits and greedy tokens (the K/V its prefill wrote are read by its steps)."""
    sessions = reasoner.start_many(batch)
    firsts = [s.pending_logits.clone() for s in sessions]
    live = list(sessions)
    while live:
        deltas = reasoner.step_all(live)
        live = [s for s, d in zip(live, deltas, strict=True) if d.finish_reason is None]
    for s in sessions:
        s.close()
    return [(f, s.token_ids) for f, s in zip(firsts, sessions, strict=True)]


def _same(pair, batch: list[ChatParams], *, replayed: bool = True) -> None:
    plain, pieces = pair
    before = pieces.prefiller.graphs.replays
    want, got = _run(plain, batch), _run(pieces, batch)
    assert (pieces.prefiller.graphs.replays > before) is replayed
    for (lw, tw), (lg, tg) in zip(want, got, strict=True):
        torch.testing.assert_close(lg, lw, rtol=1e-4, atol=1e-4)
        assert tg == tw


def test_buckets_pad_short_passes_to_powers_of_two_and_longer_ones_by_at_most_128_tokens():
    assert prefill_buckets(2048) == (16, 32, 64, *range(128, 2049, 128))
    assert prefill_buckets(300) == (16, 32, 64, 128, 256, 300)
    assert prefill_buckets(40) == (16, 32, 40)


@pytest.mark.parametrize("n", [1, 5, 16, 37, 255])
def test_a_text_prompt_padded_to_its_bucket(pair, n):
    _same(pair, [_params(ids=range(3, 3 + n))])


def test_an_image_prompt_adds_its_deepstack_rows_and_a_text_one_after_it_none(pair):
    image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    _same(pair, [_params(image=image)])
    _same(pair, [_params(ids=range(40, 90))])  # the dense deepstack rows were zeroed again


def test_a_next_turn_on_cached_blocks_and_several_chats_in_one_pass(pair):
    first = list(range(3, 150))
    _same(pair, [_params(ids=first)])
    hits = pair[1].prefix_cache_counts[1]
    _same(pair, [_params(ids=first + [7, 8, 9]), _params(ids=range(60, 90)), _params(ids=first[:70] + [5])])
    assert pair[1].prefix_cache_counts[1] > hits


def test_a_pass_past_the_largest_bucket_runs_the_plain_und_pass(pair):
    # (first tokens no earlier test used: no cached prefix shrinks the pass to fit)
    _same(pair, [_params(ids=[1, 1, *range(3, 200)]), _params(ids=[2, 2, *range(9, 120)])], replayed=False)


def test_chats_sharing_a_prefix_in_one_pass_read_the_blocks_the_first_writes(pair):
    """The second chat starts on the blocks the first computes in the same pass: between the pieces the
    first's K/V are written before the second's attention reads them."""
    hits = pair[1].prefix_cache_counts[1]
    _same(pair, [_params(ids=[4, 4, *range(100, 240)]), _params(ids=[4, 4, *range(100, 230), 9])])
    assert pair[1].prefix_cache_counts[1] - hits == 2 * pair[1].pool.block_size


def test_prompt_logprobs_n_choices_and_a_preempted_chats_resume_through_the_pieces(pair, tiny_ckpt):
    """Every prompt row's hidden state (prompt logprobs: the whole prompt computed), the n choices of one
    prompt (one pass, the others fork its K/V), and a preempted chat's resume (its prompt and the tokens it
    generated, prefilled after it) give through the pieces what the plain und pass gives."""
    from worldserve.runner.reasoner import Reasoner

    plain, pieces = pair
    ids = tuple(range(5, 70))
    logprobs = ChatParams(prompt_ids=ids, max_tokens=2, temperature=0.0, prompt_logprobs=3)
    want, got = (r.start(logprobs) for r in pair)
    assert got.prompt_logprobs == want.prompt_logprobs
    for s in (want, got):
        s.close()
    choices = [ChatParams(prompt_ids=ids, max_tokens=6, temperature=1.0, seed=i) for i in range(3)]
    _same(pair, choices)
    model, tok = pieces.prefiller.transformer, pieces.tokenizer
    tight = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64, kv_cache_tokens=64,
                                     kv_block_size=8)  # fmt: skip
    tight.prefiller.graphs = PrefillGraphs(
        model, (qkv_math, finish_math), num_deepstack=tight.vision.num_deepstack, max_tokens=64, capture=False
    )
    roomy = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64, kv_cache_tokens=4096)
    prompts = ["Hello there", "Describe a cat"]
    assert greedy_chats(tight, prompts, 30, close=True) == greedy_chats(roomy, prompts, 30, close=True)
    assert tight.preemptions >= 1 and tight.prefiller.graphs.replays > len(prompts)  # the resumes' passes too
