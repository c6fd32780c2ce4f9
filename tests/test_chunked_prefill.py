"""Chunked prefill (vLLM's, on by default): a prompt longer than --max-num-batched-tokens is prefilled in chunks,
one a step, while the running chats keep decoding. On the tiny checkpoint (float32, CPU): the chunked chat's
first logits and greedy tokens equal a whole prefill's (text, an image cut by a chunk's end, with and without
prefix caching); running chats get a token every step meanwhile; each chunk's budget leaves a token for every
decoding chat; a chat closed mid-prefill gives its blocks back and leaves its committed ones cached; start()
prefills to the end; the flags reach the Reasoner and a chunked chat answers over HTTP as a whole one does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart

BS = 16
BUDGET = 48  # tokens an iteration (admission pass and step) computes: three blocks


@pytest.fixture(scope="module")
def model_tok(tiny_ckpt):
    from transformers import AutoTokenizer

    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    return model, AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))


def make(tiny_ckpt, model_tok, *, chunked=True, caching=True, budget=BUDGET):
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_tok
    return Reasoner.from_pretrained(
        tiny_ckpt, model, tok, max_model_len=1024, kv_block_size=BS, enable_prefix_caching=caching,
        max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
    )  # fmt: skip


def ids_chat(n: int, first: int = 3, max_tokens: int = 6) -> ChatParams:
    ids = tuple(first + (i * 7) % 200 for i in range(n))
    return ChatParams(prompt_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def image_chat(max_tokens: int = 6) -> ChatParams:
    image = np.random.default_rng(5).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    content = (ChatPart(type="text", text="Look at this picture, please: " * 2), ChatPart(type="image", image=image),
               ChatPart(type="text", text="What is in it? Answer in detail."))  # fmt: skip
    return ChatParams(
        messages=(ChatMessage(role="user", content=content),),
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )


def run(reasoner, session) -> tuple[torch.Tensor, list[int], int]:
    """(first token's logits, greedy tokens, chunks after the first) of a session run alone: its chunks as
    step_all runs them (which then samples the first token in the same step), its steps to the end."""
    waited = 0
    while session.prefilling:
        session.prefill_next(reasoner.max_num_batched_tokens)
        waited += 1
    first = session.pending_logits.clone()
    while session.finish_reason is None:
        session.step()
    session.close()
    return first, session.token_ids, waited


def whole(tiny_ckpt, model_tok, params) -> tuple[torch.Tensor, list[int]]:
    r = make(tiny_ckpt, model_tok, chunked=False, caching=False)
    first, tokens, waited = run(r, r.start_many([params])[0])
    assert waited == 0
    return first, tokens


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("kind", ["text", "image"])
def test_a_chunked_prefill_gives_the_logits_and_tokens_of_a_whole_one(tiny_ckpt, model_tok, kind, caching):
    params = ids_chat(170) if kind == "text" else image_chat()
    r = make(tiny_ckpt, model_tok, caching=caching)
    n = len(r.build_prompt(params).input_ids)
    if kind == "image":  # an image cut by a chunk's end: its rows in two chunks, one encode
        rows = [i for i, t in enumerate(r.build_prompt(params).input_ids) if t == r.image_token_id]
        assert rows[0] // BUDGET < rows[-1] // BUDGET
    (session,) = r.start_many([params])
    assert session.prefilling and session.pending_logits is None
    first, tokens, waited = run(r, session)
    assert waited == -(-n // BUDGET) - 1  # one chunk at the start, one a step after it
    want_first, want_tokens = whole(tiny_ckpt, model_tok, params)
    assert ((first - want_first).norm() / want_first.norm()).item() < 1e-5
    assert tokens == want_tokens
    if kind == "image" and caching:
        assert r.prefiller.encoder.misses == 1
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_running_chats_decode_every_step_while_a_long_prompt_prefills(tiny_ckpt, model_tok):
    r = make(tiny_ckpt, model_tok, caching=False)
    short = [r.start(ids_chat(10, first=i, max_tokens=40)) for i in (5, 9)]
    extends = []
    extend = r.prefiller.extend
    r.prefiller.extend = lambda p, g, seq, budget: (
        extends.append((seq.length, budget)) or extend(p, g, seq, budget)
    )
    params = ids_chat(200, max_tokens=4)
    (long,) = r.start_many([params])
    n = len(long._prompt.input_ids)
    steps = 0
    while long.completion_tokens == 0:
        deltas = r.step_all([*short, long])
        steps += 1
        assert [d.completion_tokens for d in deltas[:2]] == [steps] * 2
    # its chunks, the first in its admission, one an iteration, a token of each iteration's budget left for each
    # decoding chat (none in the step of its admission's iteration: the pass took that share); its first token
    # sampled in the step of its last chunk
    share = BUDGET - 2
    assert extends == [(share * (i + 1), min(share, n - share * (i + 1))) for i in range(steps - 1)]
    assert sum(extends[-1]) == n
    r.prefiller.extend = extend
    while long.finish_reason is None:
        r.step_all([*short, long])
    assert long.token_ids == whole(tiny_ckpt, model_tok, params)[1]
    for s in (*short, long):
        s.close()


def test_a_chat_closed_mid_prefill_frees_its_blocks_and_keeps_its_committed_ones_cached(tiny_ckpt, model_tok):
    r = make(tiny_ckpt, model_tok)
    params = ids_chat(170)
    (session,) = r.start_many([params])
    r.step_all([session])  # its admission's iteration: the pass took the budget
    r.step_all([session])  # a second chunk
    assert session.prefilling
    committed = 2 * BUDGET
    session.close()
    assert r.pool.num_free == r.pool.num_blocks - 1 and r.pool.num_cached == committed // BS
    hits = r.prefix_cache_counts[1]
    first, tokens, _ = run(r, r.start_many([params])[0])
    assert r.prefix_cache_counts[1] - hits == committed
    want_first, want_tokens = whole(tiny_ckpt, model_tok, params)
    assert ((first - want_first).norm() / want_first.norm()).item() < 1e-5 and tokens == want_tokens


def test_start_prefills_to_the_end_and_no_chunking_prefills_whole(tiny_ckpt, model_tok):
    r = make(tiny_ckpt, model_tok)
    s = r.start(ids_chat(170))
    assert not s.prefilling and s.pending_logits is not None
    s.close()
    off = make(tiny_ckpt, model_tok, chunked=False)
    (s,) = off.start_many([ids_chat(170)])
    assert not s.prefilling and s.pending_logits is not None
    s.close()


def test_the_flags_reach_the_reasoner_and_are_checked(tiny_ckpt):
    from worldserve.commands import serve_backend
    from worldserve.config import ModelConfig, ParallelConfig, ReasonerConfig, SchedulerConfig

    cfg, chat = (
        ModelConfig(model=str(tiny_ckpt), device="cpu", warmup_shapes="none"),
        ReasonerConfig(max_model_len=4096),
    )
    sched = SchedulerConfig(max_num_batched_tokens=512, enable_chunked_prefill=False)
    reasoner = serve_backend.load_backend(cfg, ParallelConfig(), sched, chat)[2]
    assert (reasoner.max_num_batched_tokens, reasoner.chunked_prefill) == (512, False)
    reasoner = serve_backend.load_backend(cfg, ParallelConfig(), SchedulerConfig(), chat)[2]
    assert (reasoner.max_num_batched_tokens, reasoner.chunked_prefill) == (8192, True)  # vLLM's defaults
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=32)


@pytest.fixture(scope="module")
def reasoner(tiny_ckpt, model_tok):
    """The module's served Reasoner (conftest's reasoner_url / reasoner_oai): chunks of BUDGET tokens."""
    return make(tiny_ckpt, model_tok)


def test_a_chunked_chat_answers_over_http_as_a_whole_one(reasoner_oai, tiny_ckpt, model_tok):
    """Streamed and not, through the chat worker: the text of the whole prefill, and no empty chunks while
    the prompt prefills (vLLM streams nothing before the first token)."""
    params = ids_chat(170)
    want = model_tok[1].decode(whole(tiny_ckpt, model_tok, params)[1])
    kw = {"model": "test-model", "prompt": list(params.prompt_ids), "max_tokens": 6, "temperature": 0.0,
          "extra_body": {"ignore_eos": True}}  # fmt: skip
    assert reasoner_oai.completions.create(**kw).choices[0].text == want
    chunks = list(reasoner_oai.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks if c.choices)


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_chats_resume_chunk_by_chunk_and_answer_as_with_room(tiny_ckpt, model_tok, caching):
    """A pool too small for three long chats preempts them; each resume recomputes its prompt and answer in
    chunks (a step each) and every chat's tokens equal those of the same chats in a roomy pool."""
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_tok
    small = Reasoner.from_pretrained(
        tiny_ckpt, model, tok, max_model_len=20 * BS, kv_block_size=BS, kv_cache_tokens=20 * BS,
        max_num_batched_tokens=BUDGET, enable_prefix_caching=caching,
    )  # fmt: skip
    chats = [ids_chat(70, first=f, max_tokens=100) for f in (3, 11, 20)]
    resumes = []
    resume = small.prefill
    small.prefill = lambda p, g=(), **kw: resumes.append((len(g), kw.get("budget"))) or resume(p, g, **kw)
    sessions = [small.start(c) for c in chats]  # each alone: the pool holds one chat's prompt + answer
    live = list(sessions)
    while live:
        deltas = small.step_all(live)
        live = [s for s, d in zip(live, deltas, strict=True) if d.finish_reason is None]
    # chunked resumes, each within what the step's decodes left, a token kept for its own decode
    assert small.preemptions > 0 and any(g and b is not None for g, b in resumes)
    assert all(b < BUDGET for g, b in resumes if g)
    roomy = make(tiny_ckpt, model_tok, chunked=False, caching=False)
    want = [run(roomy, roomy.start_many([c])[0])[1] for c in chats]
    assert [s.token_ids for s in sessions] == want
    for s in sessions:
        s.close()
    assert small.pool.num_free == small.pool.num_blocks - 1


def test_a_burst_sharing_a_long_prefix_is_admitted_in_one_pass(tiny_ckpt, model_tok):
    """The pass budget counts the tokens computed, not those found cached or computed by an earlier chat of
    the pass (vLLM's step budget): eight chats on a 200-token common prefix fit one pass of 320 tokens, and
    the same burst again (the prefix now cached) too; without the cache the first fits, the second is chunked
    to the rest of the budget (vLLM's last new request) and the others wait."""
    r = make(tiny_ckpt, model_tok, budget=320)
    prefix = ids_chat(200).prompt_ids
    burst = [ChatParams(prompt_ids=prefix + (i, i + 1), max_tokens=2, temperature=0.0) for i in range(8)]
    for _ in range(2):
        sessions = r.start_many(burst)
        assert all(not isinstance(s, Exception) for s in sessions), sessions
        for s in sessions:
            s.close()
    plain = make(tiny_ckpt, model_tok, budget=320, caching=False)  # without the cache: whole prompts count
    out = plain.start_many(burst)
    assert sum(not isinstance(s, Exception) for s in out) == 2
    assert not out[0].prefilling and out[1].prefilling and out[1].prefill_left == 202 - (320 - 203)
    for s in out:
        if not isinstance(s, Exception):
            s.close()


def test_the_n_choices_of_a_prompt_past_the_budget_start_one_a_pass(tiny_ckpt, model_tok):
    """A later choice of a prompt longer than the step's budget waits for a later pass (ChatBackpressure: the
    chat worker retries it after the step) instead of forking a half-prefilled sequence, and while the first
    one's chunks take the budget; it finds the first choice's prompt blocks cached, and both answer what a whole
    prefill answers."""
    from worldserve.engine.outputs import ChatBackpressure

    r = make(tiny_ckpt, model_tok)
    params = ids_chat(170, max_tokens=6)
    first, refused = r.start_many(params.choices(2))
    assert first.prefilling and isinstance(refused, ChatBackpressure)
    second, waited = refused, 0
    while isinstance(second, ChatBackpressure):  # (the first's next chunks take the whole budget)
        r.step_all([first])
        committed, hits, waited = first._seq.length // BS * BS, r.prefix_cache_counts[1], waited + 1
        (second,) = r.start_many(params.choices(2)[1:])
    assert waited > 1 and r.prefix_cache_counts[1] - hits == committed > BUDGET  # the first's chunks, cached
    want = whole(tiny_ckpt, model_tok, params)[1]
    for s in (first, second):
        while s.finish_reason is None:
            s.step()
        assert s.token_ids == want
        s.close()
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_a_newer_chat_mid_prefill_is_preempted_before_an_older_decoding_one(tiny_ckpt, model_tok):
    """vLLM preempts the newest running request, one still prefilling too: when an older chat's next block
    finds the pool empty, the newer chat in the middle of its chunks gives its blocks back (not the older
    one), resumes once there is room, and both answer what they answer in a roomy pool."""
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_tok
    r = Reasoner.from_pretrained(
        tiny_ckpt, model, tok, max_model_len=20 * BS, kv_block_size=BS, kv_cache_tokens=20 * BS,
        max_num_batched_tokens=3,
    )  # fmt: skip
    older_params, newer_params = ids_chat(20, first=5, max_tokens=200), ids_chat(150, first=9, max_tokens=5)
    older = r.start(older_params)
    for _ in range(100):  # 120 tokens: 8 blocks of the pool's 20
        r.step_all([older])
    (newer,) = r.start_many([newer_params])  # 10 blocks, reserved; chunks of 2 tokens a step
    assert newer.prefilling
    seen = {"older": False, "newer": False}
    while older.finish_reason is None or newer.finish_reason is None:
        live = [s for s in (older, newer) if s.finish_reason is None]
        r.step_all(live)
        seen["older"] |= older.preempted
        seen["newer"] |= newer.preempted
    assert seen == {"older": False, "newer": True}
    roomy = make(tiny_ckpt, model_tok, chunked=False, caching=False)
    for s, params in ((older, older_params), (newer, newer_params)):
        assert s.token_ids == run(roomy, roomy.start_many([params])[0])[1]
        s.close()
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_a_chat_preempted_mid_prefill_resumes_counted_as_a_resume(tiny_ckpt, model_tok):
    """A chat preempted before its first token (mid-chunks) has generated nothing, yet its resume's lookup is
    a preempted request's (vLLM: num_preemptions > 0), kept apart from the new chats' prefix-cache counters:
    its prompt is counted once there, at its admission."""
    r = make(tiny_ckpt, model_tok)
    params = ids_chat(170)
    (session,) = r.start_many([params])
    r.step_all([session])  # its admission's iteration: the pass took the budget
    r.step_all([session])  # a second chunk
    queries = r.prefix_cache_counts
    session.preempt()  # as _make_room does when an older chat needs its blocks
    r._waiting.append(session)
    r.step_all([session])  # resumed: its committed chunks found cached
    assert not session.preempted
    assert r.prefix_cache_counts == queries
    assert (r.pool.preempted_queries, r.pool.preempted_hits) == (170, 2 * BUDGET)
    first, tokens, _ = run(r, session)
    assert tokens == whole(tiny_ckpt, model_tok, params)[1]
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_a_pass_cut_by_its_budget_shares_only_the_blocks_it_computes(tiny_ckpt, model_tok):
    """UndPrefill with several items and a budget that cuts the first: a later item sharing its prefix starts
    only on the blocks the pass computes (not on the first's blocks past the cut, which hold nothing yet);
    continued to its end, it has a whole prefill's logits."""
    r = make(tiny_ckpt, model_tok, caching=True)
    first = ids_chat(170)
    second = ChatParams(prompt_ids=first.prompt_ids[:165] + (4, 4, 4), max_tokens=1, temperature=0.0)
    p1, p2 = r.build_prompt(first), r.build_prompt(second)
    (_, s1, _), (h2, s2, _) = r.prefill_batch([(p1, ()), (p2, ())], budget=BUDGET)
    assert s1.length == BUDGET and s2.length == BUDGET + 1  # it started on the 3 blocks computed, + 1 token
    while s2.length < len(p2.input_ids):
        h2 = r.prefiller.extend(p2, (), s2, BUDGET)
    got = r.transformer.compute_logits(h2[-1:])[0]
    want, _ = whole(tiny_ckpt, model_tok, second)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    s1.release()
    s2.release()


def test_a_chunked_chat_s_first_token_follows_its_grammar_and_min_tokens(tiny_ckpt, model_tok):
    """The first token of a chat prefilled in chunks is sampled under its grammar's mask and min_tokens, as a
    whole prefill's: the same choice, the same tokens."""
    from worldserve.chat_params import StructuredOutput

    so = StructuredOutput(kind="choice", spec='["alpha", "beta", "gamma"]')
    long_text = "Pick one of the words, please. " * 6
    params = [
        ChatParams(messages=(ChatMessage(role="user", content=long_text),), structured=so, max_tokens=20,
                   temperature=0.0),
        ChatParams(messages=(ChatMessage(role="user", content=long_text),), min_tokens=5, max_tokens=8,
                   temperature=0.0),
    ]  # fmt: skip
    r = make(tiny_ckpt, model_tok, caching=False)  # (the second would find the first's blocks cached)
    for p in params:
        assert len(r.build_prompt(p).input_ids) > BUDGET
        (s,) = r.start_many([p])
        assert s.prefilling
        while s.finish_reason is None:
            r.step_all([s])
        _, want = whole(tiny_ckpt, model_tok, p)
        assert s.token_ids == want
        if p.structured is not None:
            assert model_tok[1].decode(s.token_ids) in ("alpha", "beta", "gamma")
        else:
            assert len(s.token_ids) >= 5
        s.close()
