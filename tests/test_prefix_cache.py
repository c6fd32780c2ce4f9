"""Prefix caching (vLLM's automatic prefix caching) of the Reasoner's K/V: the pool's cache of full blocks
(registration, lookup, LRU eviction), the block keys (tokens, positions, pixels), and chats that start on
cached blocks: their logits equal a whole prefill's (fp32 CPU, the tiny checkpoint), with text, images
cached whole or cut by the cache boundary, a later request that extends an answer, preemption, eviction
under a small pool, prompt logprobs, and vLLM's prefix-cache counters on /metrics; the encoder cache (the
ViT's outputs of recent images, by digest): equal outputs, one encode per image, LRU eviction."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart
from worldserve.models.layers.paged_kv import PagedKVPool, PoolExhausted
from worldserve.runner.prefix_hashes import block_hashes

BS = 16  # block size of these tests: prompts of a few blocks stay short
LONG = "You are a careful assistant who describes scenes of snowy forests at dawn in great detail. " * 2


@pytest.fixture(scope="module")
def model_tok(tiny_ckpt):
    from transformers import AutoTokenizer

    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    return model, AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))


def make_reasoner(tiny_ckpt, model_tok, *, caching=True, kv_cache_tokens=None, max_model_len=1024):
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_tok
    return Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=max_model_len, kv_block_size=BS,
                                    kv_cache_tokens=kv_cache_tokens, enable_prefix_caching=caching)  # fmt: skip


def image(seed, h=64, w=96):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def chat(*parts, max_tokens=6, **kw):
    content = tuple(ChatPart(type="text", text=p) if isinstance(p, str) else ChatPart(type="image", image=p)
                    for p in parts)  # fmt: skip
    return ChatParams(messages=(ChatMessage(role="user", content=content),), max_tokens=max_tokens,
                      temperature=0.0, **kw)  # fmt: skip


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def first_logits_and_tokens(r, params):
    """(the first token's logits, the greedy tokens) of one chat run alone; its session closed."""
    s = r.start(params)
    first = s.pending_logits.clone()
    while s.finish_reason is None:
        s.step()
    return first, s.token_ids


def test_pool_keeps_freed_cached_blocks_and_evicts_the_least_recently_freed():
    pool = PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=6, block_size=4,
                       dtype=torch.float32, device="cpu")  # fmt: skip
    a = pool.sequence()
    a.reserve(12)
    pool.register(a.blocks, [b"h1", b"h2", b"h3"])
    held = list(a.blocks)
    a.release()
    assert (pool.num_free, pool.num_cached) == (5, 3)  # two free + three cached that nobody holds
    assert pool.lookup([b"h1", b"h2", b"hX"], 12) == held[:2]
    assert (pool.prefix_queries, pool.prefix_hits, pool.num_free) == (12, 8, 3)
    taken = pool.allocate(3)  # the two free blocks, then the cached one nobody holds: it leaves the cache
    assert held[2] in taken and pool.num_cached == 2 and pool.lookup([b"h3"], 4) == []
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.free(held[:2])  # the lookup's holds
    pool.free(taken)
    assert pool.num_free == 5 and pool.lookup([b"h1"], 4) == held[:1]


def test_block_keys_follow_tokens_positions_and_pixels(tiny_ckpt, model_tok):
    r = make_reasoner(tiny_ckpt, model_tok)
    base = r.build_prompt(chat(LONG, image(1), "What is in it?"))
    same = r.build_prompt(chat(LONG, image(1), "What is in it?"))
    other_px = r.build_prompt(chat(LONG, image(2), "What is in it?"))
    keys = [block_hashes(p, (), BS, len(p.input_ids)) for p in (base, same, other_px)]
    assert keys[0] == keys[1] and len(keys[0]) == len(base.input_ids) // BS
    first_image_row = base.input_ids.index(r.image_token_id)
    cut = first_image_row // BS  # the block where the image starts: its key takes the pixels in
    assert keys[0][:cut] == keys[2][:cut] and all(
        a != b for a, b in zip(keys[0][cut:], keys[2][cut:], strict=True)
    )
    longer = r.build_prompt(chat(LONG + "More words here.", image(1), "What is in it?"))
    assert block_hashes(longer, (), BS, BS)[0] == keys[0][0]  # one prefix, one key
    gen = [5, 6, 7]  # generated tokens: keys of the prompt + them, at positions after the prompt's
    n = len(base.input_ids) + len(gen)
    assert block_hashes(base, gen, BS, n)[: len(keys[0])] == keys[0]


@pytest.mark.parametrize("kind", ["text", "image cached whole", "image cut by the cache"])
def test_a_chat_on_cached_blocks_has_the_logits_of_a_whole_prefill(tiny_ckpt, model_tok, kind):
    if kind == "text":
        first, second = chat(LONG, "Question one?"), chat(LONG, "Question two, a longer one?")
    elif kind == "image cached whole":
        first, second = chat(image(3), LONG, "Question one?"), chat(image(3), LONG, "Question two?")
    else:  # the question follows the image at once: the last cached block ends inside the image's rows
        first, second = chat(LONG, image(4), "one"), chat(LONG, image(4), "two")
    cached, plain = make_reasoner(tiny_ckpt, model_tok), make_reasoner(tiny_ckpt, model_tok, caching=False)
    first_logits_and_tokens(cached, first)
    hits = cached.prefix_cache_counts[1]
    got_logits, got_tokens = first_logits_and_tokens(cached, second)
    found = cached.prefix_cache_counts[1] - hits
    want_logits, want_tokens = first_logits_and_tokens(plain, second)
    prompt = cached.build_prompt(second)
    assert found >= BS and found % BS == 0 and found < len(prompt.input_ids)
    rows = [i for i, t in enumerate(prompt.input_ids) if t == cached.image_token_id]
    if kind == "image cached whole":
        assert rows[-1] < found
    elif kind == "image cut by the cache":  # the ViT's outputs come from the encoder cache
        assert rows[0] < found <= rows[-1] and cached.prefiller.encoder.hits == 1
    assert rel(got_logits, want_logits) < 1e-5
    assert got_tokens == want_tokens
    assert plain.prefix_cache_counts == (0, 0) and plain.pool.num_cached == 0


def test_encoder_cache_encodes_each_image_once_and_evicts_the_least_recently_used(tiny_ckpt, model_tok):
    from worldserve.runner.encoder_cache import EncoderCache

    r = make_reasoner(tiny_ckpt, model_tok)
    pre = r.prompts.preprocess
    a, b, c = (pre([image(i)]) for i in (11, 12, 13))

    def both(*items):  # one VisionInputs of several images, as a prompt carries them
        return type(a)(
            torch.cat([x.patches for x in items]), torch.cat([x.grid_thw for x in items]), repeat=a.repeat
        )

    cache = EncoderCache(r.vision)
    cache.encode(both(a, b), [b"a", b"b"])
    got = cache.encode(both(b, c), [b"b", b"c"])
    want = r.vision.encode(both(b, c))
    assert (cache.hits, cache.misses, len(cache)) == (1, 3, 3)
    assert rel(got[0], want[0]) < 1e-5 and all(rel(x, y) < 1e-5 for x, y in zip(got[1], want[1], strict=True))
    one = a.tokens_per_image(r.vision.merge_size)[0]
    small = EncoderCache(r.vision, max_tokens=one)  # room for one image: the newest stays
    small.encode(both(a, b), [b"a", b"b"])
    small.encode(both(a), [b"a"])
    assert (small.hits, small.misses, len(small)) == (0, 3, 1)


def test_encoder_cache_keeps_only_its_items_rows(tiny_ckpt, model_tok):
    """A cached item is a copy of its own rows: a view into the pass's outputs would keep the rows of every
    item encoded with it (evicted or too large to cache) alive, past the cache's token count."""
    from worldserve.runner.encoder_cache import EncoderCache

    r = make_reasoner(tiny_ckpt, model_tok)
    a, b = (r.prompts.preprocess([image(i)]) for i in (21, 22))
    pair = type(a)(torch.cat([a.patches, b.patches]), torch.cat([a.grid_thw, b.grid_thw]), repeat=a.repeat)
    cache = EncoderCache(r.vision, max_tokens=b.tokens_per_image(r.vision.merge_size)[0])  # room for one
    cache.encode(pair, [b"a", b"b"])
    ((embeds, deepstack),) = cache._items.values()
    assert all(x.untyped_storage().nbytes() == x.nbytes for x in (embeds, *deepstack))


def test_images_inside_the_cached_prefix_skip_the_vit(tiny_ckpt, model_tok):
    """A next turn that adds an image encodes that image only: one whose rows are all in cached blocks is not
    encoded again, even when the encoder cache no longer holds it (evicted, or too large for it)."""
    from worldserve.runner.encoder_cache import EncoderCache

    first = chat(image(7), LONG, "Question one?")
    second = chat(image(7), LONG, image(8), "Question two?")
    cached = make_reasoner(tiny_ckpt, model_tok)
    first_logits_and_tokens(cached, first)
    # image 7 leaves the encoder cache; its K/V blocks stay in the prefix cache
    cached.prefiller.encoder = EncoderCache(cached.vision)
    hits = cached.prefix_cache_counts[1]
    got_logits, got_tokens = first_logits_and_tokens(cached, second)
    prompt = cached.build_prompt(second)
    rows = [i for i, t in enumerate(prompt.input_ids) if t == cached.image_token_id]
    assert rows[len(rows) // 2 - 1] < cached.prefix_cache_counts[1] - hits <= rows[len(rows) // 2]
    assert cached.prefiller.encoder.misses == 1  # image 8 alone
    plain = make_reasoner(tiny_ckpt, model_tok, caching=False)
    want_logits, want_tokens = first_logits_and_tokens(plain, second)
    assert rel(got_logits, want_logits) < 1e-5 and got_tokens == want_tokens


@pytest.mark.parametrize("kind", ["text", "image"])
def test_chats_arriving_together_compute_their_common_prefix_once(tiny_ckpt, model_tok, monkeypatch, kind):
    """Chats prefilled in one pass that share a prefix (a system prompt, an image) compute it once: the later
    ones start on the blocks the first computes in the same pass (counted as hits, as vLLM counts blocks
    computed in the same step); each chat's first logits and greedy tokens equal its uncached prefill's."""
    parts = (LONG,) if kind == "text" else (image(9), LONG)
    chats = [chat(*parts, q, max_tokens=8) for q in ("Question one?", "Another question, two?", "Three?")]
    cached, plain = make_reasoner(tiny_ckpt, model_tok), make_reasoner(tiny_ckpt, model_tok, caching=False)
    prompts = [cached.build_prompt(c) for c in chats]
    keys = [block_hashes(p, (), BS, len(p.input_ids)) for p in prompts]
    shared = [0] + [  # each later chat's leading blocks equal to the first's, all but its last token's
        next((m for m in range(min(len(k), (len(p.input_ids) - 1) // BS)) if k[m] != keys[0][m]),
             min(len(k), (len(p.input_ids) - 1) // BS))
        for p, k in zip(prompts[1:], keys[1:], strict=True)
    ]  # fmt: skip
    assert all(m >= 2 for m in shared[1:])
    computed, und_step = [], cached.transformer.und_step
    monkeypatch.setattr(
        cached.transformer,
        "und_step",
        lambda b, c, **kw: computed.append(b.input_ids.numel()) or und_step(b, c, **kw),
    )
    sessions = cached.start_many(chats)
    assert computed == [sum(len(p.input_ids) for p in prompts) - BS * sum(shared)]  # one pass
    assert cached.prefix_cache_counts[1] == BS * sum(shared)
    if kind == "image":  # the image's rows are in the first chat's blocks: encoded once
        assert cached.prefiller.encoder.misses == 1
    monkeypatch.undo()
    for c, s in zip(chats, sessions, strict=True):
        got_logits = s.pending_logits.clone()
        while s.finish_reason is None:
            s.step()
        want_logits, want_tokens = first_logits_and_tokens(plain, c)
        assert rel(got_logits, want_logits) < 1e-5 and s.token_ids == want_tokens
        s.close()
    assert cached.pool.num_free == cached.pool.num_blocks - 1  # every shared block given back


def test_a_request_extending_an_answer_starts_on_the_answer_s_blocks(tiny_ckpt, model_tok):
    """A finished chat's full blocks (prompt and the tokens it generated) stay cached: a raw prompt made of
    that prompt, that answer and more (a client's next turn) prefills only what follows them."""
    r = make_reasoner(tiny_ckpt, model_tok)
    prompt_ids = tuple(r.build_prompt(chat(LONG, "Tell me more.")).input_ids)
    _, answer = first_logits_and_tokens(r, ChatParams(prompt_ids=prompt_ids, max_tokens=40, temperature=0.0,
                                                      ignore_eos=True))  # fmt: skip
    assert len(answer) == 40
    follow = ChatParams(prompt_ids=prompt_ids + tuple(answer) + (11, 12, 13), max_tokens=5, temperature=0.0)
    hits = r.prefix_cache_counts[1]
    got, got_tokens = first_logits_and_tokens(r, follow)
    committed = len(prompt_ids) + len(answer) - 1  # the last token sampled was never decoded
    assert r.prefix_cache_counts[1] - hits == committed // BS * BS
    want, want_tokens = first_logits_and_tokens(make_reasoner(tiny_ckpt, model_tok, caching=False), follow)
    assert rel(got, want) < 1e-5 and got_tokens == want_tokens


def test_prompt_logprobs_compute_the_whole_prompt(tiny_ckpt, model_tok):
    r = make_reasoner(tiny_ckpt, model_tok)
    params = chat(LONG, "Question?", prompt_logprobs=1)
    first_logits_and_tokens(r, chat(LONG, "Question?"))
    queries = r.prefix_cache_counts[0]
    s = r.start(params)
    assert r.prefix_cache_counts[0] == queries  # no lookup
    want = make_reasoner(tiny_ckpt, model_tok, caching=False).start(params).prompt_logprobs
    assert len(s.prompt_logprobs) == len(want) == len(r.build_prompt(params).input_ids)
    for a, b in zip(s.prompt_logprobs[1:], want[1:], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4 and a.top_ids == b.top_ids


def test_a_small_pool_evicts_and_every_answer_stays_right(tiny_ckpt, model_tok):
    """A pool of 24 blocks and chats of ~10 blocks each: cached blocks are evicted for new ones (oldest freed
    first), running chats are preempted and resume, and every chat answers what it answers without a cache."""
    from reasoner_helpers import greedy_chats

    prompts = [f"Scene number {i}: {LONG} Describe it." for i in range(6)]  # ~7 blocks each, none shared
    small = make_reasoner(tiny_ckpt, model_tok, kv_cache_tokens=24 * BS, max_model_len=24 * BS)
    plain = make_reasoner(tiny_ckpt, model_tok, caching=False, kv_cache_tokens=24 * BS, max_model_len=24 * BS)
    want = greedy_chats(plain, prompts[:3], 40, close=True)
    for round_ in range(2):  # the second round finds some blocks cached, others evicted
        assert greedy_chats(small, prompts[:3], 40, close=True) == want, round_
        greedy_chats(small, prompts[3:], 8, close=True)
    assert small.preemptions > 0 and small.pool.preempted_hits > 0  # resumes found their own blocks
    assert small.pool.num_free == small.pool.num_blocks - 1  # nothing held once every chat closed


def test_prefix_cache_counters_count_as_vllm_s(tiny_ckpt, model_tok):
    """vLLM's prefix_cache_queries / _hits: each choice of an n > 1 chat is a request whose lookup counts (the
    later ones find the first one's full prompt blocks, as vLLM's child requests scheduled after it do); a
    preempted chat's resume is left out (vLLM counts it apart, in stats it does not export)."""
    r = make_reasoner(tiny_ckpt, model_tok)
    params = chat(LONG, "Question?", max_tokens=30, ignore_eos=True)
    n = len(r.build_prompt(params).input_ids)
    first, second = r.start_many(params.choices(2))
    assert r.prefix_cache_counts == (2 * n, (n - 1) // BS * BS)
    for _ in range(20):
        r.step_all([first, second])
    first.preempt()  # (as Reasoner.step_all does when the pool runs out of blocks)
    assert first.resume() and r.prefix_cache_counts == (2 * n, (n - 1) // BS * BS)
    assert r.pool.preempted_queries == n + 20 and r.pool.preempted_hits == (n + 19) // BS * BS
    while first.finish_reason is None:
        r.step_all([first, second])
    _, alone = first_logits_and_tokens(make_reasoner(tiny_ckpt, model_tok, caching=False), params)
    assert first.token_ids == second.token_ids == alone


def test_prefix_cache_counters_on_metrics(reasoner_url):
    def counts():
        text = httpx.get(reasoner_url + "/metrics").text
        lines = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_")]
        return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if "_created" not in ln}

    before = counts()
    body = {"model": "test-model", "messages": [{"role": "user", "content": LONG * 2}], "max_tokens": 2}
    for _ in range(2):
        assert httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    after = counts()
    queried = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    found = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert queried > 0 and 0 < found < queried  # the second chat found the first one's full blocks


def test_cache_salt_keeps_prompts_apart(tiny_ckpt, model_tok):
    """vLLM's cache_salt: it seeds the first block's key, so chats share cached blocks only with chats of the
    same salt (or, without one, with unsalted chats); a truncated prompt keeps its salt."""
    r = make_reasoner(tiny_ckpt, model_tok)
    prompts = [r.build_prompt(chat(LONG, "Question?", cache_salt=s)) for s in ("a", "a", "b", None)]
    keys = [block_hashes(p, (), BS, len(p.input_ids)) for p in prompts]
    assert keys[0] == keys[1] and len(keys[0]) >= 2
    assert all(x != y for other in keys[2:] for x, y in zip(keys[0], other, strict=True))
    assert all(x != y for x, y in zip(keys[2], keys[3], strict=True))
    n = len(prompts[0].input_ids)
    hits = []
    for salt in ("a", "b", None, "a", None):
        first_logits_and_tokens(r, chat(LONG, "Question?", cache_salt=salt))
        hits.append(r.prefix_cache_counts[1])
    shared = (n - 1) // BS * BS  # what a chat finds of an earlier one's prompt (its last token is computed)
    assert hits == [0, 0, 0, shared, 2 * shared]  # "a" again and unsalted again find their own blocks only
    cut = r.prompts.truncated(prompts[0], n - 3, 1024, 6)
    assert cut.cache_salt == "a" and len(cut.input_ids) == n - 3


@pytest.mark.parametrize(
    ("route", "salt", "status"),
    [("chat", "", 400), ("chat", 5, 400), ("chat", "tenant-1", 200), ("completions", "", 400),
     ("completions", "tenant-1", 200)],
)  # fmt: skip
def test_cache_salt_must_be_a_non_empty_string(reasoner_url, route, salt, status):
    body = {"model": "test-model", "max_tokens": 2, "cache_salt": salt}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body["prompt"] = "Hello"
    resp = httpx.post(
        f"{reasoner_url}/v1/{'chat/' if route == 'chat' else ''}completions", json=body, timeout=60
    )
    assert resp.status_code == status, resp.text
    if status == 400:
        assert resp.json()["error"]["param"] == "cache_salt"
        if salt == "":
            assert (
                resp.json()["error"]["message"]
                == "Parameter 'cache_salt' must be a non-empty string if provided."
            )
