"""The Reasoner equals transformers' Qwen3VLForConditionalGeneration on the tiny checkpoint (CPU, fp32).

The oracle (worldserve/bench/reasoner_oracle.py) is built from the root config.json and the Reasoner key map,
fed the same input_ids, pixel_values and image_grid_thw (our Qwen3-VL preprocessing) and mm_token_type_ids,
so it computes its own get_rope_index positions and deepstack injection. Compared: every prefill logit and
the logits of 5 greedy decode steps from our K/V cache, plus the greedy tokens a session emits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from reasoner_helpers import oracle_logits
from safetensors.torch import load_file

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart
from worldserve.models.cosmos3.vision import chat_positions
from worldserve.params import INT64, ParamError, choice_seed
from worldserve.sampling.tokens import TokenSampler, sample_tokens

TOL = 1e-4


@pytest.fixture(scope="module")
def reasoner(tiny_ckpt):
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    return Reasoner.from_pretrained(tiny_ckpt, model, tok)


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    from worldserve.bench.reasoner_oracle import qwen3vl_oracle

    return qwen3vl_oracle(tiny_ckpt)[0]


def _image(seed, h=40, w=56):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _check_parity(reasoner, oracle, params, steps=5):
    prompt = reasoner.build_prompt(params)
    hidden, cache, pos = reasoner.prefill(prompt)
    ours = [reasoner.transformer.compute_logits(hidden)]  # [N, V]
    tokens = []
    for _ in range(steps):
        tok = int(ours[-1][-1].argmax())
        tokens.append(tok)
        ours.append(reasoner.decode(tok, cache, pos)[None])
        pos += 1
    ref = oracle_logits(reasoner, oracle, prompt, tokens)  # [N + steps, V]
    ours_all = torch.cat(ours)
    assert rel(ours_all[: ref.shape[0]], ref) <= TOL
    assert ref[len(prompt.input_ids) - 1 :].argmax(-1).tolist()[:steps] == tokens
    return prompt, tokens


def test_text_chat_matches_qwen3vl(reasoner, oracle):
    params = ChatParams(
        messages=(
            ChatMessage(role="system", content="You are a helpful assistant."),
            ChatMessage(role="user", content="Describe the weather on Mars."),
        )
    )
    prompt, tokens = _check_parity(reasoner, oracle, params)
    assert prompt.vision is None


def test_image_chat_matches_qwen3vl(reasoner, oracle):
    params = ChatParams(
        messages=(
            ChatMessage(
                role="user",
                content=(
                    ChatPart(type="image", image=_image(0)),
                    ChatPart(type="text", text="What is this?"),
                ),
            ),
        ),
        temperature=0.0,
    )
    prompt, tokens = _check_parity(reasoner, oracle, params)
    n_img = int((torch.tensor(prompt.input_ids) == reasoner.image_token_id).sum())
    assert n_img == prompt.vision.tokens_per_image(2)[0] > 1
    assert prompt.vision.pixel_values().shape[1] == 3 * 2 * 16 * 16
    h, w = (int(x) * 16 for x in prompt.vision.grid_thw[0, 1:])
    assert h % 32 == 0 and w % 32 == 0 and h * w >= 65536
    # the session streams the same greedy tokens (up to a stop token)
    session = reasoner.start(ChatParams(messages=params.messages, temperature=0.0, max_tokens=len(tokens)))
    deltas = []
    while session.finish_reason is None:
        deltas.append(session.step())
    stop = next((i for i, t in enumerate(tokens) if t in reasoner.stop_token_ids), len(tokens))
    assert session.token_ids == tokens[:stop]
    assert "".join(d.text for d in deltas) == reasoner.tokenizer.decode(
        tokens[:stop], skip_special_tokens=True
    )
    assert deltas[-1].finish_reason == ("length" if stop == len(tokens) else "stop")


def test_two_images_positions_match_get_rope_index(reasoner, oracle):
    params = ChatParams(messages=(ChatMessage(role="user", content=(
        ChatPart(type="text", text="a"), ChatPart(type="image", image=_image(1, 33, 90)),
        ChatPart(type="text", text="b"), ChatPart(type="image", image=_image(2, 70, 30)),
    )),))  # fmt: skip
    prompt = reasoner.build_prompt(params)
    ids = torch.tensor(prompt.input_ids)[None]
    ref, _ = oracle.model.get_rope_index(
        ids, (ids == reasoner.image_token_id).int(), image_grid_thw=prompt.vision.grid_thw
    )
    ours, nxt = chat_positions(prompt.input_ids, reasoner.image_token_id, prompt.vision.grid_thw.tolist(), 2)
    assert torch.equal(ours.long(), ref[:, 0]) and nxt == int(ref.max()) + 1


def test_batched_decode_of_concurrent_chats_equals_solo_runs(reasoner):
    """step_all over several sessions (different prompts, an image, different lengths and finish times) emits
    what each session emits alone: continuous batching changes the cost, not the tokens."""

    def params(i):
        parts = (
            (ChatPart(type="image", image=_image(i)), ChatPart(type="text", text="what?"))
            if i == 1
            else f"hi {i}"
        )
        return ChatParams(
            messages=(ChatMessage(role="user", content=parts),), temperature=0.0, max_tokens=3 + 2 * i
        )

    solo = []
    for i in range(3):
        s = reasoner.start(params(i))
        texts = []
        while s.finish_reason is None:
            texts.append(s.step().text)
        solo.append((s.token_ids, texts))
    sessions = [reasoner.start(params(i)) for i in range(3)]
    texts = [[] for _ in sessions]
    while any(s.finish_reason is None for s in sessions):
        live = [i for i, s in enumerate(sessions) if s.finish_reason is None]
        for i, d in zip(live, reasoner.step_all([sessions[i] for i in live]), strict=True):
            texts[i].append(d.text)
    assert [(s.token_ids, t) for s, t in zip(sessions, texts, strict=True)] == solo
    assert [len(t) for _, t in solo] == [3, 5, 7] or any(s.finish_reason == "stop" for s in sessions)


def test_n_choices_take_seed_plus_i_wrapped_to_int64():
    """Choice i of a seeded request samples with seed + i (as images' n), wrapped to stay an int64."""
    params = ChatParams(messages=(ChatMessage(role="user", content="hi"),), seed=INT64 - 2)
    assert [c.seed for c in params.choices(4)] == [INT64 - 2, INT64 - 1, -INT64, -INT64 + 1]
    assert [c.seed for c in ChatParams(messages=(ChatMessage(role="user", content="hi"),)).choices(2)] == [
        None,
        None,
    ]
    assert choice_seed(5, 3) == 8 and choice_seed(-INT64, 0) == -INT64


def test_sampling_seeded_and_bounded():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    a = [TokenSampler(temperature=0.8, top_p=0.9, top_k=10, seed=7).sample(logits) for _ in range(3)]
    s = TokenSampler(temperature=0.8, top_p=0.9, top_k=10, seed=7)
    assert a[0] == s.sample(logits) and len(set(a)) == 1
    top10 = set(torch.topk(logits, 10).indices.tolist())
    s = TokenSampler(temperature=1.0, top_k=10, seed=1)
    assert {s.sample(logits) for _ in range(50)} <= top10
    s = TokenSampler(temperature=1.0, top_p=1e-6, seed=1)
    assert s.sample(logits) == int(logits.argmax())
    assert TokenSampler(temperature=0).sample(logits) == int(logits.argmax())


def test_batched_sampling_equals_each_row_alone_and_follows_the_distribution():
    """sample_tokens over a mix of samplers (greedy, penalized, top-k, top-p, plain temperature) gives each
    row the token its sampler draws alone, and plain temperature-1 draws follow softmax(logits)."""
    from worldserve.sampling.tokens import sample_tokens

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 30, generator=g) * 2
    kinds = [dict(temperature=0.0), dict(temperature=0.0, presence_penalty=1.0, repetition_penalty=1.5),
             dict(temperature=0.7, top_k=5), dict(temperature=0.9, top_p=0.5, presence_penalty=0.5),
             dict(temperature=1.0)]  # fmt: skip

    def make():
        return [TokenSampler(**kw, seed=11 + i, prompt_ids=(1, 2, 3)) for i, kw in enumerate(kinds)]

    batched, alone = make(), make()
    for _ in range(6):
        together = sample_tokens(batched, logits)
        assert together == [s.sample(row) for s, row in zip(alone, logits, strict=True)]
    ties = torch.tensor([2.0, 1.0, 1.0, 1.0] + [0.0] * 26)  # top_k=2 keeps every token tied with the 2nd
    alone = [TokenSampler(temperature=1.0, top_k=2, seed=5) for _ in range(2)]
    other = TokenSampler(temperature=1.0, top_k=1, seed=6)
    drawn = [alone[0].sample(ties) for _ in range(200)]
    assert set(drawn) == {0, 1, 2, 3}
    assert drawn == [sample_tokens([other, alone[1]], torch.stack([ties, ties]))[1] for _ in range(200)]
    s = TokenSampler(temperature=1.0, seed=0)
    row = torch.tensor([0.0, 1.0, 2.0, -1.0])
    counts = torch.bincount(torch.tensor([s.sample(row) for _ in range(4000)]), minlength=4).float()
    torch.testing.assert_close(counts / 4000, row.softmax(-1), atol=0.03, rtol=0)


def test_context_limit_and_stop_strings(reasoner):
    msgs = (ChatMessage(role="user", content="hello"),)
    with pytest.raises(ParamError) as err:
        reasoner.start(ChatParams(messages=msgs, max_tokens=10**6))
    assert err.value.param == "max_tokens" and "cannot be greater than max_model_len" in err.value.message
    with pytest.raises(ParamError):
        reasoner.start(ChatParams(messages=()))
    s = reasoner.start(ChatParams(messages=msgs, temperature=1.0, seed=3, max_tokens=40))
    text = ""
    while s.finish_reason is None:
        text += s.step().text
    full = reasoner.tokenizer.decode(s.token_ids, skip_special_tokens=True)
    assert text == full
    if len(full) > 3:  # stop on a piece of what the same seed produces: the output ends before it
        stop = full[2:4]
        s2 = reasoner.start(ChatParams(messages=msgs, temperature=1.0, seed=3, max_tokens=40, stop=(stop,)))
        out = ""
        while s2.finish_reason is None:
            out += s2.step().text
        assert out == full[: full.find(stop)] and s2.finish_reason == "stop" and s2.stop_reason == stop
    assert s.stop_reason is None  # length, or an end-of-sequence token


def test_an_image_or_video_part_without_its_pixels_is_a_param_error(reasoner):
    """An in-process caller's ChatPart(type="image") with no image (or a video part with no video) is a bad
    request naming `messages`, not an AttributeError deep in the preprocessing (a server error)."""
    for part in (ChatPart(type="image"), ChatPart(type="video")):
        msgs = (ChatMessage(role="user", content=(part, ChatPart(type="text", text="what?"))),)
        with pytest.raises(ParamError) as err:
            reasoner.build_prompt(ChatParams(messages=msgs))
        assert err.value.param == "messages" and "no decoded" in err.value.message


def test_vision_encoder_loading_is_strict(tiny_ckpt, tmp_path, reasoner):
    """Bare safetensors (keys prefixed `visual.`) + the root vision_config load the same ViT; a missing
    weight is an error, never a silently random tower."""
    from safetensors.torch import save_file

    from worldserve.models.cosmos3.vision import VisionEncoder
    from worldserve.weights.checkpoint import CheckpointError

    root = json.loads((tiny_ckpt / "config.json").read_text())
    state = load_file(tiny_ckpt / "vision_encoder" / "model.safetensors")
    save_file({f"visual.{k}": v for k, v in state.items()}, tmp_path / "model.safetensors")
    bare = VisionEncoder.from_pretrained(tmp_path, vision_config=root["vision_config"])
    inputs = reasoner.prompts.preprocess([_image(5)])
    a, da = bare.encode(inputs)
    b, db = reasoner.vision.encode(inputs)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(da, db, strict=True))
    state.pop(next(iter(state)))
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="its weights do not match the model: missing"):
        VisionEncoder.from_pretrained(tmp_path, vision_config=root["vision_config"])


def test_penalties_match_their_definitions():
    """repetition_penalty equals transformers' RepetitionPenaltyLogitsProcessor over prompt + output;
    presence / frequency penalties subtract per output token as OpenAI defines them."""
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=g) * 3
    prompt, output = (3, 5, 5, 9), (5, 7, 7, 7)
    s = TokenSampler(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                     prompt_ids=prompt)  # fmt: skip
    for t in output:
        s.output_counts[t] = s.output_counts.get(t, 0) + 1
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    ref[5] -= 0.25 * 1 + 0.5
    ref[7] -= 0.25 * 3 + 0.5
    torch.testing.assert_close(s.penalize(logits), ref)
    # greedy picks from the penalized scores, and every pick counts for the next one
    s2 = TokenSampler(temperature=0.0, frequency_penalty=2.0)
    flat = torch.zeros(4)
    flat[2] = 1.0
    assert [s2.sample(flat) for _ in range(3)] == [2, 0, 1]


def test_the_smallest_repetition_penalty_keeps_scores_ordered_and_masks_masked():
    """At float32's smallest normal penalty a seen token's positive score divided by it stays finite (the
    largest float32) and a masked token's -inf stays -inf: no NaN that argmax would pick past a grammar."""
    s = TokenSampler(temperature=0.0, repetition_penalty=1e-38, prompt_ids=(0, 1, 2))
    scores = s.penalize(torch.tensor([float("-inf"), 5.0, -3.0, 2.0]))  # (5 / 1e-38 overflows float32)
    assert scores[0] == float("-inf") and scores[1] == torch.finfo(torch.float32).max
    assert not scores.isnan().any() and scores[2] < 0 and scores[3] == 2.0


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_penalized_rows_batched_as_chats_come_and_go_equal_each_row_alone(device):
    """The output counts live in one slab per batch (sampling/tokens.py _batch_counts): as rows join, leave and
    change places between steps, and a row is sampled alone in between, every row's tokens stay those of
    its own sampler run alone on the same logits."""
    kinds = [dict(temperature=0.8, presence_penalty=1.5, frequency_penalty=0.3, top_k=20, top_p=0.8),
             dict(temperature=0, frequency_penalty=0.7), dict(temperature=1.0, repetition_penalty=1.4, prompt_ids=(1, 2, 3)), dict(temperature=0.9),
             dict(temperature=0, presence_penalty=2.0, repetition_penalty=1.2)]  # fmt: skip
    alone = [TokenSampler(**kw, seed=7 + i) for i, kw in enumerate(kinds)]
    batched = [TokenSampler(**kw, seed=7 + i) for i, kw in enumerate(kinds)]
    g = torch.Generator().manual_seed(1)
    plan = (
        [[0, 1, 2, 3, 4]] * 3
        + [[4, 0, 2], [1], [1, 3]]
        + [[0, 1, 2, 3, 4]] * 2
        + [[3, 4], [2, 0, 4, 3, 1]] * 2
    )
    for rows in plan:
        logits = (torch.randn(len(rows), 12, generator=g) * 2).to(device)  # a small vocabulary: tokens repeat
        together = sample_tokens([batched[r] for r in rows], logits)
        assert together == [alone[r].sample(logits[i]) for i, r in enumerate(rows)], rows
    flat = torch.zeros(12, device=device)
    for kw, a, b in zip(kinds, alone, batched, strict=True):
        assert a.output_counts == b.output_counts
        fresh = TokenSampler(**kw)  # its device counts built once from the host's counts
        fresh.output_counts.update(b.output_counts)
        torch.testing.assert_close(b.penalize(flat), fresh.penalize(flat))
        torch.testing.assert_close(a.penalize(flat), fresh.penalize(flat))


@pytest.mark.parametrize("device", DEVICES)
def test_batched_logprobs_equal_each_rows_log_softmax(reasoner, device):
    """batch_logprobs (every chat's sampled-token logprobs in one pass): each row's value and its own number
    of alternatives, as log_softmax of that row alone gives them."""
    from worldserve.runner.chat_logprobs import TokenTexts, batch_logprobs

    g = torch.Generator().manual_seed(2)
    vocab = len(reasoner.tokenizer)
    rows = [(torch.randn(vocab, generator=g) * 4).to(device) for _ in range(3)]
    tokens, tops = [5, 17, 40], [0, 2, 5]
    entries = batch_logprobs(TokenTexts(reasoner.tokenizer), rows, tokens, tops)
    for row, token, top, e in zip(rows, tokens, tops, entries, strict=True):
        lp = torch.log_softmax(row.float().cpu(), -1)
        assert e.token == reasoner.tokenizer.decode([token]) and e.logprob == pytest.approx(
            float(lp[token]), abs=1e-5
        )
        vals, ids = lp.topk(top) if top else (lp[:0], lp[:0].long())
        assert [t for t, _ in e.top] == [reasoner.tokenizer.decode([int(i)]) for i in ids]
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=1e-5)


def test_a_chat_samples_from_penalized_logits(reasoner):
    """The session's sampler sees the prompt (repetition penalty) and its own output (presence penalty):
    its greedy tokens equal a reference loop that applies TokenSampler.penalize to prefill/decode logits."""
    params = ChatParams(messages=(ChatMessage(role="user", content="Say something."),), temperature=0.0,
                        max_tokens=6, repetition_penalty=2.0, presence_penalty=2.0)  # fmt: skip
    session = reasoner.start(params)
    while session.finish_reason is None:
        session.step()
    prompt = reasoner.build_prompt(params)
    hidden, cache, pos = reasoner.prefill(prompt)
    logits = reasoner.transformer.compute_logits(hidden[-1:])[0]
    ref = TokenSampler(
        temperature=0.0, repetition_penalty=2.0, presence_penalty=2.0, prompt_ids=tuple(prompt.input_ids)
    )
    tokens = []
    for _ in range(len(session.token_ids)):
        tokens.append(ref.sample(logits))
        logits = reasoner.decode(tokens[-1], cache, pos)
        pos += 1
    assert tokens == session.token_ids
    plain = TokenSampler(temperature=0.0)
    first = reasoner.transformer.compute_logits(reasoner.prefill(prompt)[0][-1:])[0]
    assert tokens[0] != plain.sample(first) or tokens[0] not in prompt.input_ids  # the penalty was applied


def test_warm_up_runs_a_prefill_and_a_decode_step_and_frees_its_blocks(reasoner, monkeypatch):
    """What `serve` calls before taking requests (on CUDA it also compiles and captures the decode step): one
    prompt prefill, one decode step of one sequence, and every K/V block back in the pool afterwards."""
    model, decoder = reasoner.transformer, reasoner.decoder
    sizes, steps, und_step, step = [], [], model.und_step, decoder.step
    monkeypatch.setattr(
        model,
        "und_step",
        lambda batch, caches, **kw: sizes.append(batch.input_ids.numel()) or und_step(batch, caches, **kw),
    )
    monkeypatch.setattr(decoder, "step", lambda t, s, p: steps.append(len(s)) or step(t, s, p))
    free = reasoner.pool.num_free
    reasoner.warm_up()
    assert len(sizes) == 1 and sizes[0] > 1 and steps == [1]
    assert reasoner.pool.num_free == free


@pytest.mark.gpu
def test_prompt_logprobs_on_cuda_equal_the_cpu(tiny_ckpt, reasoner):
    """A prompt's log-probabilities (ChatParams.prompt_logprobs, computed PROMPT_LOGPROB_ROWS rows at a time
    on the device) on CUDA equal the CPU's, over a prompt long enough for several chunks."""
    from worldserve.runner.chat_logprobs import PROMPT_LOGPROB_ROWS
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, device="cuda", progress=False)
    gpu = Reasoner.from_pretrained(tiny_ckpt, model, reasoner.tokenizer)
    ids = tuple(reasoner.tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]) * 40
    assert len(ids) > 3 * PROMPT_LOGPROB_ROWS
    sessions = [r.start(ChatParams(prompt_ids=ids, max_tokens=1, prompt_logprobs=3)) for r in (reasoner, gpu)]
    cpu_lp, gpu_lp = (s.prompt_logprobs for s in sessions)
    for s in sessions:
        s.close()
    assert [e.token_id for e in cpu_lp] == [e.token_id for e in gpu_lp] == list(ids)
    assert cpu_lp[0].logprob is None is gpu_lp[0].logprob
    assert [e.logprob for e in gpu_lp[1:]] == pytest.approx([e.logprob for e in cpu_lp[1:]], abs=1e-4)
    assert [e.top_ids[0] for e in gpu_lp[1:]] == [e.top_ids[0] for e in cpu_lp[1:]]
