"""One token budget per Reasoner iteration (vLLM's --max-num-batched-tokens; runner/step_budget.py): an
iteration of the chat worker (an admission pass, Reasoner.start_many, then a step, Reasoner.step_all) computes
at most max_num_batched_tokens tokens in all, decodes, chunks, resumes and new prompts together. On the tiny
checkpoint (float32, CPU), counting the tokens every und pass computes (prefill passes and decode steps): a
worker-like loop with chats arriving beside a chunked prefill, and one whose small pool preempts and resumes
chats, stay within the budget every iteration and answer the tokens of whole prefills; a new prompt is chunked
to what an iteration leaves; a resume waits while a running chunk takes the budget; a prefill advances when the
decodes take it all; without chunked prefill admission is as before."""

from __future__ import annotations

import pytest
import torch

from worldserve.chat_params import ChatParams
from worldserve.engine.outputs import ChatBackpressure

BS = 16
BUDGET = 48


@pytest.fixture(scope="module")
def model_tok(tiny_ckpt):
    from transformers import AutoTokenizer

    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    return model, AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))


class Meter:
    """Tokens a Reasoner's und passes compute: its prefill passes' (the transformer's und_step, through a view
    of the model) and its decode steps' (a token a sequence)."""

    def __init__(self, reasoner) -> None:
        self.tokens = 0
        meter, model, decode = self, reasoner.prefiller.transformer, reasoner.decoder.step

        class Counted:
            def __getattr__(self, name):
                return getattr(model, name)

            def und_step(self, batch, caches, **kw):
                meter.tokens += sum(batch.seq_lens)
                return model.und_step(batch, caches, **kw)

        def step(tokens, seqs, positions):
            meter.tokens += len(tokens)
            return decode(tokens, seqs, positions)

        reasoner.prefiller.transformer = Counted()
        reasoner.decoder.step = step

    def take(self) -> int:
        n, self.tokens = self.tokens, 0
        return n


def make(tiny_ckpt, model_tok, *, chunked=True, caching=True, budget=BUDGET, pool=None):
    from worldserve.runner.reasoner import Reasoner

    model, tok = model_tok
    return Reasoner.from_pretrained(
        tiny_ckpt, model, tok, max_model_len=pool or 1024, kv_cache_tokens=pool, kv_block_size=BS,
        enable_prefix_caching=caching, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
    )  # fmt: skip


def ids_chat(n: int, first: int = 3, max_tokens: int = 6) -> ChatParams:
    ids = tuple(first + (i * 7) % 200 for i in range(n))
    return ChatParams(prompt_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def whole(tiny_ckpt, model_tok, chats) -> list[list[int]]:
    """Each chat's greedy tokens from a whole prefill, alone in a roomy pool."""
    r = make(tiny_ckpt, model_tok, chunked=False, caching=False)
    out = []
    for params in chats:
        s = r.start(params)
        while s.finish_reason is None:
            s.step()
        out.append(s.token_ids)
    return out


def serve(reasoner, arrivals: dict[int, list[ChatParams]]) -> tuple[dict[int, list[int]], list[int]]:
    """The chat worker's loop: at iteration i the chats of arrivals[i] join the queue; each iteration admits the
    queue in order (a chat refused with ChatBackpressure stays in line), then steps the running chats. -> (each
    chat's tokens by id(params), the tokens each iteration computed)."""
    meter = Meter(reasoner)
    queue, active, answers, spent = [], [], {}, []
    while queue or active or len(spent) <= max(arrivals):
        queue += arrivals.get(len(spent), [])
        if queue:
            results = reasoner.start_many(queue)
            assert all(isinstance(s, ChatBackpressure) for s in results if isinstance(s, Exception)), results
            active += [
                (id(p), s) for p, s in zip(queue, results, strict=True) if not isinstance(s, Exception)
            ]
            queue = [p for p, s in zip(queue, results, strict=True) if isinstance(s, Exception)]
        if active:
            deltas = reasoner.step_all([s for _, s in active])
            for (key, s), d in zip(active, deltas, strict=True):
                if d.finish_reason is not None:
                    answers[key] = s.token_ids
            active = [(k, s) for (k, s), d in zip(active, deltas, strict=True) if d.finish_reason is None]
        spent.append(meter.take())
        assert len(spent) < 500
    return answers, spent


def test_admissions_beside_a_chunked_prefill_and_decodes_share_one_budget(tiny_ckpt, model_tok):
    """Two chats decode, a long prompt arrives (chunked: its first chunk what the decodes leave), then a new
    chat every iteration: no iteration computes more than the budget (before: the admission's pass, the step's
    chunk and its decodes each up to a budget), the long prompt still advances every iteration (the new chats
    wait for its chunks, vLLM's running-first order), and every chat answers what a whole prefill answers."""
    r = make(tiny_ckpt, model_tok, caching=False)
    short = [ids_chat(10, first=f, max_tokens=30) for f in (5, 9)]
    long = ids_chat(200, first=3, max_tokens=4)
    later = [ids_chat(12 + i, first=20 + i, max_tokens=3) for i in range(6)]
    arrivals = {0: short, 1: [long], **{2 + i: [c] for i, c in enumerate(later)}}
    answers, spent = serve(r, arrivals)
    assert max(spent) <= BUDGET, spent
    assert spent[1] == BUDGET  # the long prompt's first chunk: all the two decodes leave
    chats = [*short, long, *later]
    assert [answers[id(c)] for c in chats] == whole(tiny_ckpt, model_tok, chats)
    assert r.pool.num_free == r.pool.num_blocks - 1


@pytest.mark.parametrize("caching", [True, False])
def test_resumes_of_preempted_chats_share_the_budget(tiny_ckpt, model_tok, caching):
    """A pool too small for three long answers preempts chats and resumes them chunk by chunk: still no
    iteration past the budget (before: each resume up to a budget of its own, besides the decodes), and the
    tokens of a roomy pool."""
    r = make(tiny_ckpt, model_tok, caching=caching, pool=20 * BS)
    chats = [ids_chat(70, first=f, max_tokens=100) for f in (3, 11, 20)]
    answers, spent = serve(r, {0: chats})
    assert r.preemptions > 0
    assert max(spent) <= BUDGET, spent
    assert [answers[id(c)] for c in chats] == whole(tiny_ckpt, model_tok, chats)
    assert r.pool.num_free == r.pool.num_blocks - 1


def test_a_new_prompt_is_chunked_to_what_the_pass_leaves(tiny_ckpt, model_tok):
    """vLLM's last new request of a step is chunked to the budget left: a short chat and a long one arriving
    together are admitted in one pass, the short whole (its prompt and the decode of its first token), the
    long to the rest (before: refused until the next pass); the chat after them waits."""
    r = make(tiny_ckpt, model_tok, caching=False)
    meter = Meter(r)
    small, big, after = r.start_many([ids_chat(20), ids_chat(200, first=7), ids_chat(5, first=9)])
    assert not small.prefilling and big.prefilling and isinstance(after, ChatBackpressure)
    assert big.prefill_left == 200 - (BUDGET - 21)
    r.step_all([small, big])  # the same iteration: its first decode, no chunk
    assert meter.take() == BUDGET and big.prefill_left == 200 - (BUDGET - 21)
    for s in (small, big):
        s.close()


def test_a_resume_waits_while_a_running_chunk_takes_the_budget(tiny_ckpt, model_tok):
    """A preempted chat resumes only from what the running chats leave (vLLM schedules the running ones first):
    while an older chat's chunks take the budget it stays on the wait list, then resumes and answers as with
    room."""
    r = make(tiny_ckpt, model_tok, caching=False)
    params = [ids_chat(200, first=3, max_tokens=3), ids_chat(30, first=8, max_tokens=8)]
    (long,) = r.start_many(params[:1])
    r.step_all([long])  # its admission's iteration
    waiting = r.start(params[1])
    waiting.step()
    waiting.preempt()  # as _make_room does when an older chat needs its blocks
    r._waiting.append(waiting)
    while long.prefilling:
        r.step_all([long, waiting])
        assert waiting.preempted == long.prefilling
    while long.finish_reason is None or waiting.finish_reason is None:
        r.step_all([s for s in (long, waiting) if s.finish_reason is None])
    assert [long.token_ids, waiting.token_ids] == whole(tiny_ckpt, model_tok, params)


def test_a_prefill_advances_when_the_decodes_take_the_budget(tiny_ckpt, model_tok):
    """A chunked prefill still gets a token a step while decoding chats take the whole budget (no admission
    that iteration), and finishes with a whole prefill's tokens."""
    r = make(tiny_ckpt, model_tok, caching=False, budget=4)
    params = ids_chat(30, first=3, max_tokens=2)
    (long,) = r.start_many([params])
    r.step_all([long])  # its admission's iteration
    shorts = [
        r.start(ids_chat(5, first=f, max_tokens=40)) for f in (10, 20, 30, 40)
    ]  # each a pass of its own
    left = long.prefill_left
    while long.prefilling:
        r.step_all([*shorts, long])
        assert long.prefill_left in (left - 1, 0)
        left = long.prefill_left
    while long.finish_reason is None:
        r.step_all([*shorts, long])
    assert long.token_ids == whole(tiny_ckpt, model_tok, [params])[0]
    for s in shorts:
        s.close()


def test_without_chunked_prefill_admission_is_whole_prompts_as_before(tiny_ckpt, model_tok):
    """--no-enable-chunked-prefill: with chats running, a prompt longer than the budget goes alone and whole, the
    chat after it waits for the next pass."""
    r = make(tiny_ckpt, model_tok, chunked=False)
    running = [r.start(ids_chat(10, first=f, max_tokens=20)) for f in (5, 9)]
    big, after = r.start_many([ids_chat(170), ids_chat(5, first=9)])
    assert not big.prefilling and big.pending_logits is not None and isinstance(after, ChatBackpressure)
    for s in (*running, big):
        s.close()


def test_a_younger_prefill_takes_what_the_older_ones_last_chunk_leaves(tiny_ckpt, model_tok):
    """Two sessions prefilling at once (as a chunked resume beside a chunked prompt leaves them; made here by
    two admissions with the iteration's count cleared between them): in the step where the older one computes
    its last short chunk, the younger one gets the rest of the budget (vLLM's running prefills share a step;
    a new chat waits for them), the step stays within the budget, and both answer what whole prefills answer."""
    r = make(tiny_ckpt, model_tok, caching=False)
    meter = Meter(r)
    a, b = ids_chat(60, first=3), ids_chat(150, first=5)
    (older,) = r.start_many([a])  # 48 of 60
    r.budget.end()
    (younger,) = r.start_many([b])  # what the older one's last chunk and decode leave: 35 of 150
    r.budget.end()
    assert (older.prefill_left, younger.prefill_left) == (12, 115)
    (third,) = r.start_many([ids_chat(20, first=7)])
    assert isinstance(third, ChatBackpressure)  # both prefills' next chunks take the budget: running first
    meter.take()
    r.step_all([older, younger])
    assert not older.prefilling and younger.prefill_left == 115 - (BUDGET - 13)
    assert meter.take() == BUDGET  # 12 + 35 prompt tokens and the older one's first decode
    sessions = [older, younger]
    while any(s.finish_reason is None for s in sessions):
        r.step_all([s for s in sessions if s.finish_reason is None])
        assert meter.take() <= BUDGET
    assert [s.token_ids for s in sessions] == whole(tiny_ckpt, model_tok, [a, b])


def test_a_prompt_logprobs_chat_past_the_budget_is_not_starved_by_running_chats(tiny_ckpt, model_tok):
    """A chat asking for prompt logprobs prefills whole (its prompt's logprobs come from one pass): longer
    than what the running chats' decodes leave, it goes whole as the first chat of a pass, over the budget for
    that iteration, instead of waiting for every running chat to end (under steady load, forever)."""
    r = make(tiny_ckpt, model_tok)
    running = [r.start(ids_chat(20, first=3 + i, max_tokens=200)) for i in range(2)]
    r.step_all(running)
    params = ChatParams(prompt_ids=ids_chat(80, first=9).prompt_ids, max_tokens=2, temperature=0.0,
                        prompt_logprobs=0)  # fmt: skip
    late, refused = r.start_many([params, ids_chat(10, first=11)])
    assert not isinstance(late, ChatBackpressure) and not late.prefilling
    assert isinstance(refused, ChatBackpressure)  # the pass is over the budget already
    assert len(late.prompt_logprobs) == 80
    for s in (*running, late):
        s.close()
