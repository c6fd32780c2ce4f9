"""The Reasoner's paged K/V cache and its batched decode step (CPU, fp32, tiny checkpoint).

- PagedKVPool / PagedSequence: block accounting (scratch block 0 never handed out, a short pool takes
  nothing, release and garbage collection give blocks back) and the K/V round trip through the pages.
- paged_decode_attention_reference equals dense SDPA per sequence (GQA, lengths across block edges).
- UndDecoder's step equals the contiguous-cache und_step for a batch of chats of different lengths, its
  compiled math (aot_eager here) equals eager, and the Reasoner's recompute preemption under a pool too
  small for its chats emits exactly the tokens of an unconstrained run.
The Triton kernel and the CUDA graphs are checked against these on a GPU (tests/test_und_decoder_cuda.py).
"""

from __future__ import annotations

import gc

import pytest
import torch
from reasoner_helpers import greedy_chats

from worldserve.chat_params import ChatMessage, ChatParams
from worldserve.models.layers.attention import sdpa_attention
from worldserve.models.layers.paged_attention import paged_decode_attention_reference
from worldserve.models.layers.paged_kv import PagedKVPool, PoolExhausted


def _pool(blocks=6, block_size=4, heads=2, dim=8, layers=2):
    return PagedKVPool(num_layers=layers, num_kv_heads=heads, head_dim=dim, num_blocks=blocks,
                       block_size=block_size, dtype=torch.float32, device="cpu")  # fmt: skip


def test_pool_blocks_are_accounted_and_come_back():
    pool = _pool(blocks=6)
    a, b = pool.sequence(), pool.sequence()
    a.reserve(9)  # 3 blocks of 4
    assert len(a.blocks) == 3 and 0 not in a.blocks and pool.num_free == 2
    with pytest.raises(PoolExhausted):
        b.reserve(12)
    assert b.blocks == [] and pool.num_free == 2  # a failed reserve takes nothing
    b.reserve(8)
    a.release()
    assert a.blocks == [] and pool.num_free == 3
    del b
    gc.collect()
    assert pool.num_free == 5  # a dropped sequence's blocks come back too


def test_paged_write_and_gather_round_trip():
    pool = _pool()
    seq = pool.sequence()
    k, v = torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    seq.reserve(7)
    for layer in range(2):
        got_k, got_v = seq.write(layer, k[layer, :5], v[layer, :5])
        assert got_k is not None and torch.equal(got_k, k[layer, :5])
    seq.advance(5)
    seq.write(0, k[0, 5:], v[0, 5:])
    kk, vv = seq.write(1, k[1, 5:], v[1, 5:])  # a non-empty sequence gathers its pages
    assert torch.equal(kk, k[1]) and torch.equal(vv, v[1])
    seq.advance(2)
    for layer in range(2):
        assert all(torch.equal(x, y) for x, y in zip(seq.kv(layer), (k[layer], v[layer]), strict=True))


@pytest.mark.parametrize("group", [1, 4])
def test_reference_paged_attention_equals_dense_sdpa(group):
    """Sequences with 0, 3, 4, 12 cached tokens (blocks of 4) and a new token each: the new K/V land at their
    slots and the output is dense SDPA over cached + new."""
    torch.manual_seed(0)
    hkv, d, bs = 2, 16, 4
    pool = _pool(blocks=12, block_size=bs, heads=hkv, dim=d, layers=1)
    cached = [0, 3, 4, 12]
    seqs, dense = [], []
    for n in cached:
        s = pool.sequence()
        s.reserve(n + 1)
        k, v = torch.randn(n + 1, hkv, d), torch.randn(n + 1, hkv, d)
        if n:
            s.write(0, k[:n], v[:n])
            s.advance(n)
        seqs.append(s)
        dense.append((k, v))
    table = torch.zeros(len(cached), 4, dtype=torch.int32)
    for r, s in enumerate(seqs):
        table[r, : len(s.blocks)] = torch.tensor(s.blocks)
    q = torch.randn(len(cached), hkv * group, d)
    k_new = torch.stack([k[-1] for k, _ in dense])
    v_new = torch.stack([v[-1] for _, v in dense])
    slots = torch.tensor([s.slot(s.length) for s in seqs])
    got = paged_decode_attention_reference(
        q, k_new, v_new, *pool.layer(0), table, torch.tensor(cached, dtype=torch.int32), slots
    )
    for r, (k, v) in enumerate(dense):
        torch.testing.assert_close(got[r], sdpa_attention(q[r : r + 1], k, v)[0], rtol=1e-5, atol=1e-6)
    for s, (k, v) in zip(seqs, dense, strict=True):
        s.advance(1)
        assert torch.equal(s.kv(0)[0], k) and torch.equal(s.kv(0)[1], v)  # the new token was stored


@pytest.fixture(scope="module")
def model_and_tok(tiny_ckpt):
    from transformers import AutoTokenizer

    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    return model, AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))


def test_decoder_step_equals_the_contiguous_und_step(model_and_tok):
    """Three chats of 3, 9 and 17 tokens (blocks of 4: lengths inside and across block edges), decoded
    together for three steps, give the logits of the contiguous-cache und_step path."""
    from worldserve.models.cosmos3.batch import UndBatch
    from worldserve.runner.und_decoder import UndDecoder

    model, _ = model_and_tok
    pool = model.new_paged_pool(64, block_size=4)
    decoder = UndDecoder(model, pool, max_batch=4, max_model_len=32)
    prompts = [(torch.arange(n) * (i + 3)) % 200 for i, n in enumerate((3, 9, 17))]
    seqs, caches = [pool.sequence() for _ in prompts], [model.new_und_cache(32) for _ in prompts]
    for s, p in zip(seqs, prompts, strict=True):
        s.reserve(len(p))
    model.und_step(UndBatch.text(prompts), seqs, kv_only=True)
    model.und_step(UndBatch.text(prompts), caches, kv_only=True)
    for step in range(3):
        tokens = [5 + step, 9 + step, 11 + step]
        positions = [len(p) + step for p in prompts]
        for s in seqs:
            s.reserve(1)
        got = decoder.step(tokens, seqs, positions)
        ids = [torch.tensor([t]) for t in tokens]
        want = model.compute_logits(model.und_step(UndBatch.text(ids, starts=positions), caches))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [s.length for s in seqs] == [6, 12, 20]


def test_compiled_decode_math_equals_eager(model_and_tok):
    """The decode step's compiled copies (aot_eager on CPU) at batch 1 and 3 equal the eager step."""
    from worldserve.models.cosmos3.layer import compiled_decode_math
    from worldserve.runner.und_decoder import UndDecoder

    model, _ = model_and_tok

    def run(compiled: bool) -> list[torch.Tensor]:
        pool = model.new_paged_pool(64, block_size=4)
        decoder = UndDecoder(model, pool, max_batch=4, max_model_len=32)
        if compiled:
            decoder.qkv_fn, decoder.finish_fn = compiled_decode_math(backend="aot_eager")
        seqs, outs = [pool.sequence() for _ in range(3)], []
        for b in (1, 3, 3):
            for s in seqs[:b]:
                s.reserve(1)
            outs.append(decoder.step([7] * b, seqs[:b], [s.length for s in seqs[:b]]))
        return outs

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_preemption_recomputes_and_emits_the_same_tokens(tiny_ckpt, model_and_tok):
    """Two chats whose K/V outgrow a pool of 8 blocks of 8 tokens: the newer one is preempted, resumes by
    recomputing its prompt + tokens, and both emit what they emit with room to spare."""
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_and_tok
    prompts = ["Hello there", "Describe a cat"]
    roomy = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64, kv_cache_tokens=4096)
    want = greedy_chats(roomy, prompts, 30)
    tight = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64, kv_cache_tokens=64,
                                     kv_block_size=8)  # fmt: skip
    assert greedy_chats(tight, prompts, 30) == want
    assert tight.preemptions >= 1 and tight.pool.num_free == tight.pool.num_blocks - 1
    with pytest.raises(ValueError, match="kv-cache-memory-bytes"):
        Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64, kv_cache_tokens=32)


def test_preempted_session_steps_alone_and_resumes_with_its_own_positions(tiny_ckpt, model_and_tok):
    """Review findings: a preempted session stepped on its own (session.step()) idles instead of crashing,
    and its resume prefill gives the logits that decoding its tokens one by one gives, even when it generated
    an image-placeholder token (re-deriving Qwen3-VL positions from prompt + output would take it for an
    image and fail)."""
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_and_tok
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64, kv_cache_tokens=64, kv_block_size=8)
    params = ChatParams(messages=(ChatMessage(role="user", content="Hi"),), max_tokens=20, temperature=0.0)
    s = r.start(params)
    for _ in range(3):
        s.step()
    s.token_ids[-1] = r.image_token_id  # as if the model had produced <|image_pad|> as text
    s.preempt()
    r._waiting.append(s)
    hog = r.pool.sequence()
    hog.reserve(r.pool.num_free * r.pool.block_size)  # no room to resume into
    assert s.step().text == "" and s.preempted
    hog.release()
    _, seq, pos = r.prefill(s._prompt)
    for t in s.token_ids:
        want = r.decode(t, seq, pos)
        pos += 1
    seq.release()
    assert s.resume()
    torch.testing.assert_close(s.pending_logits, want, rtol=1e-4, atol=1e-4)
    r.forget(s)
    assert s.step().completion_tokens == 4 and s.close() is None
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_tiny_temperature_is_greedy_and_placeholder_text_is_a_400(tiny_ckpt, model_and_tok):
    """A temperature of 1e-45 samples greedily (dividing by it gave inf/NaN and failed every chat of the
    batch); "<|image_pad|>" typed into a message without an image is a ParamError naming messages."""
    from worldserve.params import ParamError
    from worldserve.runner.reasoner import Reasoner
    from worldserve.sampling.tokens import TokenSampler, sample_tokens

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    samplers = [TokenSampler(temperature=1e-45, seed=0), TokenSampler(temperature=0.0)]
    assert sample_tokens(samplers, logits) == logits.argmax(-1).tolist()
    model, tok = model_and_tok
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64)
    with pytest.raises(ParamError) as err:
        r.start(ChatParams(messages=(ChatMessage(role="user", content="look <|image_pad|>"),)))
    assert err.value.param == "messages"


def test_streamed_text_is_the_decoded_completion(tiny_ckpt, model_and_tok):
    """Incremental detokenization: the deltas of sampled chats (the tiny byte-level vocabulary splits UTF-8
    characters across tokens) add up to the tokenizer's decode of the whole completion, less a character
    left unfinished at the end (vLLM's DecodeStream never completes it: no U+FFFD)."""
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_and_tok
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=256)
    for seed in range(4):
        s = r.start(ChatParams(messages=(ChatMessage(role="user", content="Write ä poem"),), max_tokens=60,
                               temperature=1.5, seed=seed))  # fmt: skip
        text = ""
        while s.finish_reason is None:
            text += s.step().text
        assert text == tok.decode(s.token_ids, skip_special_tokens=True).rstrip("\ufffd")


def test_a_chat_without_room_is_refused_before_any_work_and_not_rebuilt(
    tiny_ckpt, model_and_tok, monkeypatch
):
    """With the pool full, start() raises ChatBackpressure before the prefill (no ViT, no K/V taken), and
    the chat worker's retry with the same params reuses the prompt built the first time."""
    from worldserve.engine.outputs import ChatBackpressure
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_and_tok
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64, kv_cache_tokens=64, kv_block_size=8)
    builds, build = [], r.build_prompt
    monkeypatch.setattr(r, "build_prompt", lambda p: builds.append(p) or build(p))
    params = ChatParams(messages=(ChatMessage(role="user", content="Hi"),), max_tokens=5, temperature=0.0)
    hog = r.pool.sequence()
    hog.reserve(r.pool.num_free * r.pool.block_size)
    for _ in range(2):
        with pytest.raises(ChatBackpressure):
            r.start(params)
    hog.release()
    s = r.start(params)
    assert len(builds) == 1 and s.prompt_tokens > 0
    s.close()
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_start_many_prefills_together_what_start_prefills_alone(tiny_ckpt, model_and_tok):
    """Three chats (one with an image: ViT embeddings and deepstack rows offset into the packed batch) and a
    bad one, started in one call: the bad one gets its ParamError, the others the greedy tokens they get when
    started one by one."""
    import numpy as np

    from worldserve.chat_params import ChatPart
    from worldserve.params import ParamError
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_and_tok
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=512)
    image = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    contents = ["Hello there", (ChatPart(type="image", image=image), ChatPart(type="text", text="What is it?")),
                "Count to ten"]  # fmt: skip
    params = [ChatParams(messages=(ChatMessage(role="user", content=c),), max_tokens=12, temperature=0.0)
              for c in contents]  # fmt: skip
    bad = ChatParams(messages=(ChatMessage(role="user", content="x"),), max_tokens=10_000)
    together = r.start_many([params[0], bad, params[1], params[2]])
    assert isinstance(together[1], ParamError)

    def finish(s):
        while s.finish_reason is None:
            s.step()
        return s.token_ids

    want = [finish(r.start(p)) for p in params]
    assert [finish(s) for s in (together[0], together[2], together[3])] == want


def test_a_failed_batched_prefill_retries_each_chat_alone(tiny_ckpt, model_and_tok, monkeypatch, caplog):
    """One chat whose prefill fails (say, out of memory on its video) fails alone: the batch is retried one
    chat at a time, and the others start; the batch's error is logged (an intermittent OOM left no trace)."""
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_and_tok
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=256)
    batch_prefill = r.prefill_batch

    def flaky(items, whole=(), budget=None):
        if any(len(p.input_ids) > 25 for p, _ in items):
            raise RuntimeError("CUDA out of memory (simulated)")
        return batch_prefill(items, whole, budget)

    monkeypatch.setattr(r, "prefill_batch", flaky)
    texts = ["Hi", "a much longer prompt that goes past twenty five tokens for sure", "Yo"]
    out = r.start_many(
        [ChatParams(messages=(ChatMessage(role="user", content=t),), max_tokens=3) for t in texts]
    )
    assert isinstance(out[1], RuntimeError) and all(s.prompt_tokens > 0 for s in (out[0], out[2]))
    assert any("a prefill of 3 chats failed" in r.getMessage() and "simulated" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    for s in (out[0], out[2]):
        s.close()
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    pool = _pool(blocks=8, block_size=4)
    a = pool.sequence()
    k, v = torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    a.reserve(7)
    for layer in range(2):
        a.write(layer, k[layer], v[layer])
    a.advance(6)
    b = a.fork()  # block 0 shared, block 1 (2 of 4 rows used) copied
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1] and b.length == 6
    assert all(torch.equal(x, y) for x, y in zip(b.kv(1), a.kv(1), strict=True))
    b.reserve(1)
    b.write(0, torch.ones(1, 2, 8), torch.ones(1, 2, 8))  # b's 7th token lands in b's own copy
    b.write(1, torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    b.advance(1)
    assert torch.equal(a.kv(0)[0], k[0]) and pool.num_free == 7 - 3
    a.release()
    assert pool.num_free == 7 - 2  # block 0 is still b's
    b.release()
    assert pool.num_free == 7


def test_the_choices_of_one_request_share_their_prompt(tiny_ckpt, model_and_tok):
    """n = 3 choices (the same messages object, seeds s, s + 1, s + 2, as the API builds them) are prefilled
    once and share the prompt's full blocks, and sample exactly what three separate chats sample."""
    import dataclasses

    from worldserve.runner.reasoner import Reasoner

    model, tok = model_and_tok
    # (no prefix cache: the three separate chats below would share the prompt's blocks through it too)
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=512, kv_block_size=16,
                                 enable_prefix_caching=False)  # fmt: skip
    long = "Describe, in great detail, a red fox running through fresh snow at dawn " * 3
    base = ChatParams(
        messages=(ChatMessage(role="user", content=long),), max_tokens=8, temperature=1.0, seed=3
    )
    choices = [dataclasses.replace(base, seed=3 + i) for i in range(3)]
    prefills, prefill_batch = [], r.prefill_batch
    r.prefill_batch = lambda items, *rest: prefills.append(len(items)) or prefill_batch(items, *rest)
    free = r.pool.num_free
    shared = r.start_many(choices)
    used_shared = free - r.pool.num_free
    r.prefill_batch = prefill_batch
    free = r.pool.num_free
    apart = [
        r.start(dataclasses.replace(c, messages=(ChatMessage(role="user", content=long),))) for c in choices
    ]
    assert prefills == [1] and used_shared < free - r.pool.num_free

    def finish(s):
        while s.finish_reason is None:
            s.step()
        return s.token_ids

    assert [finish(s) for s in shared] == [finish(s) for s in apart]
    assert r.pool.num_free == r.pool.num_blocks - 1
