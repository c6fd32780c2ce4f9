"""The Reasoner's serving paths against transformers' Qwen3VLForConditionalGeneration (CPU, fp32, tiny
checkpoint): every logit a session samples from equals the oracle's for the same sequence, for

- images of several sizes and aspect ratios in one message, a tiny and an extreme one, a request's own pixel
  budget, and images in two turns of a conversation;
- text / image / video chats of different lengths decoded together over 8-token K/V blocks (prompts and
  decodes across many block edges), one of them joining the running batch;
- the n choices of one image request (prefilled once, the partial block copied per choice);
- chats whose K/V outgrow the pool: the newest is preempted and resumed by recompute (greedy tokens).

The oracle sees the prompt plus the generated tokens in one forward (its own get_rope_index positions).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from reasoner_helpers import oracle_logits

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart, ChatVideo
from worldserve.runner.reasoner_session import ReasonerSession

TOL = 1e-4


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    from worldserve.bench.reasoner_oracle import qwen3vl_oracle

    return qwen3vl_oracle(tiny_ckpt)[0]


@pytest.fixture(scope="module")
def model(reasoner):
    return reasoner.transformer


@pytest.fixture
def recorded(monkeypatch):
    """{id(session): [the logits of each token it sampled]} (the first from its prefill, then each decode's)."""
    rows: dict[int, list[torch.Tensor]] = {}
    init, receive = ReasonerSession.__init__, ReasonerSession.receive

    def rec_init(self, *a, **kw):
        init(self, *a, **kw)
        rows[id(self)] = [self.pending_logits.clone()]

    def rec_receive(self, logits):
        rows[id(self)].append(logits.clone())
        receive(self, logits)

    monkeypatch.setattr(ReasonerSession, "__init__", rec_init)
    monkeypatch.setattr(ReasonerSession, "receive", rec_receive)
    return rows


def _image(seed, h, w):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _video(seed, n, h, w):
    frames = np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    return ChatVideo(frames=frames, indices=tuple(range(0, 2 * n, 2)), source_fps=2.0)


def _chat(content, **kw):
    kw = {"temperature": 0.0, "max_tokens": 10} | kw
    return ChatParams(messages=(ChatMessage(role="user", content=content),), **kw)


def _run(reasoner, sessions):
    live = list(sessions)
    while live:
        deltas = reasoner.step_all(live)
        live = [s for s, d in zip(live, deltas, strict=True) if d.finish_reason is None]


def _oracle_logits(reasoner, oracle, prompt, tokens):
    """The oracle's logits [len(tokens) + 1, V] of the prompt's last position and each generated token's."""
    return oracle_logits(reasoner, oracle, prompt, tokens)[len(prompt.input_ids) - 1 :]


def _check(reasoner, oracle, session, rows, *, greedy=True):
    ref = _oracle_logits(reasoner, oracle, session._prompt, session.token_ids)
    ours = torch.stack(rows[id(session)])  # one row per sampled token (an ending token's included)
    ref = ref[: ours.shape[0]]
    assert ((ours - ref).norm() / ref.norm()).item() <= TOL
    if greedy:
        assert ref[: len(session.token_ids)].argmax(-1).tolist() == session.token_ids


def test_images_of_many_shapes_and_turns(reasoner, oracle, recorded):
    """Two images of opposite aspect ratios in one message, a 1x1 and a 20x900 image (smart_resize's
    extremes), a 300x500 image under a request's max_pixels, and images in two user turns around an
    assistant turn: their grids, placeholders, positions, ViT and deepstack rows all as transformers'."""
    chats = [
        _chat((ChatPart(type="text", text="a"), ChatPart(type="image", image=_image(1, 33, 90)),
               ChatPart(type="text", text="b"), ChatPart(type="image", image=_image(2, 70, 30)))),
        _chat((ChatPart(type="image", image=_image(3, 1, 1)), ChatPart(type="text", text="?"))),
        _chat((ChatPart(type="image", image=_image(4, 20, 900)), ChatPart(type="text", text="?"))),
        _chat((ChatPart(type="image", image=_image(5, 300, 500)), ChatPart(type="text", text="?")),
              image_min_pixels=1024, image_max_pixels=70000),
        ChatParams(messages=(
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content=(ChatPart(type="image", image=_image(6, 64, 64)),
                                              ChatPart(type="text", text="what"))),
            ChatMessage(role="assistant", content="a cat"),
            ChatMessage(role="user", content=(ChatPart(type="text", text="and"),
                                              ChatPart(type="image", image=_image(7, 96, 32)))),
        ), temperature=0.0, max_tokens=10),
    ]  # fmt: skip
    sessions = [reasoner.start(p) for p in chats]
    grids = [s._prompt.vision.grid_thw.tolist() for s in sessions]
    assert grids[3] == [[1, 12, 20]] and len(grids[0]) == len(grids[4]) == 2
    _run(reasoner, sessions)
    for s in sessions:
        _check(reasoner, oracle, s, recorded)


def test_chats_of_all_kinds_decoded_together_over_small_blocks(tiny_ckpt, model, reasoner, oracle, recorded):
    """A long text chat, an image chat and a video chat stepped together over 8-token blocks, and a second
    image chat joining after 5 steps: each one's logits are the oracle's, at every step."""
    from worldserve.runner.reasoner import Reasoner

    r = Reasoner.from_pretrained(tiny_ckpt, model, reasoner.tokenizer, max_model_len=512, kv_block_size=8)
    long = "The quick brown fox jumps over the lazy dog. " * 4
    sessions = [
        r.start(_chat(long, max_tokens=30, ignore_eos=True)),
        r.start(_chat((ChatPart(type="image", image=_image(8, 40, 56)), ChatPart(type="text", text="hi")),
                      max_tokens=25, ignore_eos=True)),
        r.start(_chat((ChatPart(type="video", video=_video(1, 5, 64, 96)), ChatPart(type="text", text="v")),
                      max_tokens=20, ignore_eos=True)),
    ]  # fmt: skip
    for _ in range(5):
        r.step_all(sessions)
    late = _chat((ChatPart(type="image", image=_image(9, 33, 70)), ChatPart(type="text", text="late")),
                 max_tokens=15, ignore_eos=True)  # fmt: skip
    sessions.append(r.start(late))
    _run(r, sessions)
    assert [len(s.token_ids) for s in sessions] == [30, 25, 20, 15]
    assert all(s._prompt.next_position != len(s._prompt.input_ids) for s in sessions[1:])  # mRoPE offsets
    for s in sessions:
        _check(r, oracle, s, recorded)
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_the_choices_of_an_image_request_sample_from_the_oracles_logits(tiny_ckpt, model, reasoner, oracle,
                                                                      recorded):  # fmt: skip
    """n = 3 sampled choices of one image message share one prefill (a partial last block copied per
    choice): each choice's logits at each step are the oracle's for its own tokens."""
    from worldserve.runner.reasoner import Reasoner

    r = Reasoner.from_pretrained(tiny_ckpt, model, reasoner.tokenizer, max_model_len=256, kv_block_size=8)
    base = _chat((ChatPart(type="image", image=_image(10, 50, 50)), ChatPart(type="text", text="n")),
                 max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)  # fmt: skip
    choices = r.start_many([dataclasses.replace(base, seed=5 + i) for i in range(3)])
    assert len(choices[0]._prompt.input_ids) % 8  # the prompt ends inside a block
    _run(r, choices)
    assert len({tuple(s.token_ids) for s in choices}) > 1
    for s in choices:
        _check(r, oracle, s, recorded, greedy=False)


def test_preempted_image_and_video_chats_resume_with_the_oracles_tokens(tiny_ckpt, model, reasoner, oracle):
    """An image chat and a video chat that outgrow a 160-token pool: one is preempted and recomputed (its
    prompt's vision rows and its tokens at their mRoPE positions); both emit the oracle's greedy tokens."""
    from worldserve.runner.reasoner import Reasoner

    r = Reasoner.from_pretrained(tiny_ckpt, model, reasoner.tokenizer, max_model_len=160, kv_cache_tokens=160,
                                 kv_block_size=8)  # fmt: skip
    sessions = r.start_many([
        _chat((ChatPart(type="image", image=_image(12, 40, 56)), ChatPart(type="text", text="x")),
              max_tokens=60, ignore_eos=True),
        _chat((ChatPart(type="video", video=_video(2, 4, 32, 64)), ChatPart(type="text", text="y")),
              max_tokens=60, ignore_eos=True),
    ])  # fmt: skip
    _run(r, sessions)
    assert r.preemptions >= 1
    for s in sessions:
        ref = _oracle_logits(r, oracle, s._prompt, s.token_ids)
        assert len(s.token_ids) == 60 and ref[:60].argmax(-1).tolist() == s.token_ids
    assert r.pool.num_free == r.pool.num_blocks - 1
