"""The und pathway and its K/V cache: computed once and reused, incremental == full, and Qwen3-VL-exact.

- A gen forward reads the prompt's cached und K/V without changing it, and reusing one cache over several
  denoising steps gives exactly what a fresh prefill per step gives (the diffusers way, which
  test_transformer_parity checks separately).
- und_step decode (one token per step, the cache growing past its capacity) and chunked prefill (causal
  mask aligned bottom-right) reproduce a one-shot prefill of the whole text; several sequences packed in
  one und_step reproduce separate calls.
- On its own, the und tower + norm + lm_head is transformers' Qwen3-VL text model: same logits for text.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worldserve.models.cosmos3.batch import GenBatch, GenItem, UndBatch

VOCAB = 256  # random ids stay below the byte-level base of any tiny vocabulary
TOL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    from worldserve.weights.loader import load_transformer

    return load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)


def _ids(seed, n):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_cached_und_kv_reused_across_steps_equals_recompute(model):
    ids = _ids(0, 33)
    (cache,) = model.prefill_und([ids])
    k0, v0 = cache.k.clone(), cache.v.clone()
    g = torch.Generator().manual_seed(1)
    for step, t in enumerate((999, 700, 300)):
        latents, sound = torch.randn(48, 3, 3, 5, generator=g), torch.randn(64, 10, generator=g)
        item = dict(latents=latents, timestep=t, sound=sound, clean_frames=(0,) if step else ())
        cached = model(GenBatch.pack([GenItem(und_cache=cache, **item)], config=model.config, device="cpu"))
        (fresh_cache,) = model.prefill_und([ids])
        fresh = model(
            GenBatch.pack([GenItem(und_cache=fresh_cache, **item)], config=model.config, device="cpu")
        )
        assert torch.equal(cached.video[0], fresh.video[0])
        assert torch.equal(cached.sound[0], fresh.sound[0])
    assert torch.equal(cache.k, k0) and torch.equal(cache.v, v0)
    assert cache.length == 33


def test_prefill_kv_equals_full_und_step(model):
    """kv_only prefill (skips the last layer's attention output and MLP) stores the same K/V."""
    ids = _ids(2, 20)
    (fast,) = model.prefill_und([ids])
    full = model.new_und_cache(20)
    model.und_step(UndBatch.text([ids]), [full])
    assert torch.equal(fast.k[:, :20], full.k[:, :20]) and torch.equal(fast.v[:, :20], full.v[:, :20])


def test_decode_and_chunked_prefill_equal_one_shot(model):
    ids = _ids(3, 24)
    one_shot = model.new_und_cache(24)
    hidden = model.und_step(UndBatch.text([ids]), [one_shot])  # [24, d]

    decode = model.new_und_cache(4)  # too small on purpose: reserve() must grow it
    model.und_step(UndBatch.text([ids[:10]]), [decode])
    steps = []
    for k in range(10, 24):
        steps.append(model.und_step(UndBatch.text([ids[k : k + 1]], starts=[decode.length]), [decode]))
    assert decode.length == 24 and decode.capacity >= 24
    assert rel(torch.cat(steps), hidden[10:]) <= TOL
    assert rel(decode.k[:, :24], one_shot.k[:, :24]) <= TOL

    chunked = model.new_und_cache(24)
    outs = []
    for a in range(0, 24, 7):
        outs.append(model.und_step(UndBatch.text([ids[a : a + 7]], starts=[a]), [chunked]))
    assert rel(torch.cat(outs), hidden) <= TOL


def test_packed_sequences_equal_separate_calls(model):
    a, b = _ids(4, 13), _ids(5, 29)
    ca, cb = model.new_und_cache(13), model.new_und_cache(29)
    packed = model.und_step(UndBatch.text([a, b]), [ca, cb])
    sa, sb = model.new_und_cache(13), model.new_und_cache(29)
    ha = model.und_step(UndBatch.text([a]), [sa])
    hb = model.und_step(UndBatch.text([b]), [sb])
    assert rel(packed[:13], ha) <= TOL and rel(packed[13:], hb) <= TOL
    assert rel(ca.k, sa.k) <= TOL and rel(cb.v, sb.v) <= TOL


def test_und_tower_is_the_qwen3vl_text_model(model, tiny_ckpt):
    """Prefill + decode logits equal transformers' Qwen3VLForConditionalGeneration on the same weights."""
    from worldserve.bench.reasoner_oracle import qwen3vl_oracle

    hf, _ = qwen3vl_oracle(tiny_ckpt)

    ids = _ids(6, 18)
    cache = model.new_und_cache(18)
    hidden = model.und_step(UndBatch.text([ids]), [cache])
    ours = [model.compute_logits(hidden)]
    seq = ids
    for _ in range(3):  # greedy decode, one token at a time from the cache
        nxt = ours[-1][-1].argmax().reshape(1)
        seq = torch.cat([seq, nxt])
        h = model.und_step(UndBatch.text([nxt], starts=[cache.length]), [cache])
        ours.append(model.compute_logits(h))
    with torch.no_grad():
        ref = hf(input_ids=seq[None]).logits[0]  # [L + 3, vocab]
    assert rel(torch.cat(ours), ref[: seq.numel()]) <= TOL


def test_compiled_gen_layers_equal_eager(tiny_ckpt, tmp_path):
    """The regional-compile path (shared qkv_math / finish_math graphs) computes what eager does.

    aot_eager traces through dynamo + AOTAutograd without generating kernels, so it is fast on CPU and
    still fails if a layer cannot be captured; inductor itself runs in the GPU benchmarks."""
    import torch

    from worldserve.models.cosmos3.batch import GenBatch, GenItem
    from worldserve.models.cosmos3.layer import finish_math, merge_attention, qkv_math
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    cache = model.prefill_und([torch.arange(20) % 200])[0]
    gen = torch.Generator().manual_seed(0)
    item = GenItem(
        latents=torch.randn(48, 2, 3, 5, generator=gen), timestep=900, und_cache=cache,
        sound=torch.randn(64, 7, generator=gen),
    )  # fmt: skip
    batch = GenBatch.pack([item], config=model.config, device="cpu")
    eager = model(batch)
    model.compile_gen_layers(backend="aot_eager")
    compiled = model(batch)
    torch.testing.assert_close(compiled.video[0], eager.video[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled.sound[0], eager.sound[0], rtol=1e-5, atol=1e-6)
    # another prompt length, the same gen shape: no new graph (the K/V workspace rows are bucketed)
    other = model.prefill_und([torch.arange(23) % 200])[0]
    batch2 = GenBatch.pack([dataclasses.replace(item, und_cache=other)], config=model.config, device="cpu")
    with torch._dynamo.config.patch(error_on_recompile=True):
        model(batch2)
    # under a LoRA adapter (compile_blocks' graphs take its pairs): what eager computes with it
    from pipeline_helpers import write_random_adapter

    from worldserve.weights.lora_adapter import inspect_adapter, load_adapter

    spec = inspect_adapter(write_random_adapter(tmp_path / "lora", tiny_ckpt), model.config)
    lora = load_adapter(spec, 1.0, model.config, dtype=torch.float32, device=torch.device("cpu"))
    adapted = model(batch, lora=lora.mark_ranks_dynamic())
    assert (adapted.video[0] - eager.video[0]).abs().max() > 1e-2
    # another adapter rank, its rank marked dynamic (as runner/lora_cache.py serves it): no new graph
    spec8 = inspect_adapter(write_random_adapter(tmp_path / "lora8", tiny_ckpt, rank=8, seed=8), model.config)
    lora8 = load_adapter(spec8, 1.0, model.config, dtype=torch.float32, device=torch.device("cpu"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        adapted8 = model(batch, lora=lora8.mark_ranks_dynamic())
    for block in (layer.gen for layer in model.layers):  # back to the eager math
        block.qkv_fn, block.finish_fn, block.merge_fn = qkv_math, finish_math, merge_attention
        block.qkv_lora_fn, block.finish_lora_fn = qkv_math, finish_math
    torch.testing.assert_close(adapted.video[0], model(batch, lora=lora).video[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adapted8.video[0], model(batch, lora=lora8).video[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_adapters_of_other_ranks_reuse_the_inductor_graphs_on_a_gpu(tiny_ckpt, tmp_path):
    """On a GPU, bf16, with inductor (what serve compiles): adapters of ranks 4, 8 and 16, each marked dynamic
    as runner/lora_cache.py serves them, run on the graphs the first one compiled (the CPU test above checks
    this with aot_eager only), and each lands near its eager run."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pipeline_helpers import write_random_adapter

    from worldserve.weights.loader import load_transformer
    from worldserve.weights.lora_adapter import inspect_adapter, load_adapter

    model = load_transformer(tiny_ckpt, dtype=torch.bfloat16, device="cuda", progress=False)
    cache = model.prefill_und([(torch.arange(20) % 200).cuda()])[0]
    gen = torch.Generator().manual_seed(0)
    item = GenItem(latents=torch.randn(48, 2, 3, 5, generator=gen).cuda(), timestep=900, und_cache=cache)
    batch = GenBatch.pack([item], config=model.config, device="cuda")
    adapters = []
    for rank in (4, 8, 16):
        spec = inspect_adapter(write_random_adapter(tmp_path / f"r{rank}", tiny_ckpt, rank=rank, seed=rank),
                               model.config)  # fmt: skip
        adapters.append(
            load_adapter(spec, 1.0, model.config, dtype=torch.bfloat16, device=torch.device("cuda"))
        )
    eager = [model(batch, lora=lora).video[0].float() for lora in adapters]
    model.compile_gen_layers()
    compiled = [model(batch, lora=adapters[0].mark_ranks_dynamic()).video[0].float()]
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled += [model(batch, lora=lora.mark_ranks_dynamic()).video[0].float() for lora in adapters[1:]]
    for ours, ref in zip(compiled, eager, strict=True):
        assert (ours - ref).norm() / ref.norm() < 2e-2


def test_in_place_residual_finish_equals_finish_math_and_reuses_h():
    """compile_blocks' finish: the residual adds inside the GEMMs (addmm_ into h) equal finish_math's
    h + linear(...), the result lives in h's own storage (no [N, d] copy), and fp8 scales, an o_proj bias
    or a strided h go through the fallback untouched."""
    from worldserve.models.cosmos3.layer import finish_math, finish_residual_in_place

    g = torch.Generator().manual_seed(0)
    n, heads, hd, d, inter = 6, 4, 8, 32, 48
    h = torch.randn(n, d, generator=g)
    attn = torch.randn(n, heads, hd, generator=g)
    o_w, ln_w = torch.randn(d, heads * hd, generator=g) / 8, 1 + torch.randn(d, generator=g) / 10
    gu_w, down_w = torch.randn(2 * inter, d, generator=g) / 6, torch.randn(d, inter, generator=g) / 7
    want = finish_math(h, attn, o_w, None, ln_w, gu_w, down_w, 1e-6)
    h_in = h.clone()
    with torch.inference_mode():
        got = finish_residual_in_place(h_in, attn, o_w, None, ln_w, gu_w, down_w, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.data_ptr() == h_in.data_ptr()

    calls = []

    def fallback(*args, **kwargs):
        calls.append(args)
        return finish_math(*args, **kwargs)

    o_b = torch.randn(d, generator=g)
    strided = torch.randn(d, n, generator=g).t()
    for case_h, case_b, grad in ((h.clone(), o_b, False), (strided, None, False), (h.clone(), None, True)):
        before = case_h.clone()
        with torch.inference_mode(not grad):
            out = finish_residual_in_place(
                case_h, attn, o_w, case_b, ln_w, gu_w, down_w, 1e-6, fallback=fallback
            )
        torch.testing.assert_close(out, finish_math(before, attn, o_w, case_b, ln_w, gu_w, down_w, 1e-6))
        assert torch.equal(case_h, before)  # the fallback leaves h alone
    assert len(calls) == 3

    # a LoRA adapter's o_proj / gate|up / down deltas, added in place too (one of them absent)
    lora = ((torch.randn(3, heads * hd, generator=g), torch.randn(d, 3, generator=g)), None,
            (torch.randn(2, inter, generator=g), torch.randn(d, 2, generator=g)))  # fmt: skip
    want = finish_math(h, attn, o_w, None, ln_w, gu_w, down_w, 1e-6, lora=lora)
    assert (want - finish_math(h, attn, o_w, None, ln_w, gu_w, down_w, 1e-6)).abs().max() > 1e-2
    h_in = h.clone()
    with torch.inference_mode():
        got = finish_residual_in_place(h_in, attn, o_w, None, ln_w, gu_w, down_w, 1e-6, lora=lora)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.data_ptr() == h_in.data_ptr()
    gu_lora = (torch.randn(2, d, generator=g), torch.randn(2 * inter, 2, generator=g))
    with torch.inference_mode():
        got = finish_residual_in_place(
            h.clone(), attn, o_w, None, ln_w, gu_w, down_w, 1e-6, lora=(None, gu_lora, None)
        )
    torch.testing.assert_close(
        got, finish_math(h, attn, o_w, None, ln_w, gu_w, down_w, 1e-6, lora=(None, gu_lora, None))
    )
