"""Chats beside video steps (runner/chat_share.py): when the Reasoner may run without the model lock, on its
own stream, and that chats decoded while video forwards run on the same GPU emit the tokens they emit alone
(gpu). The worker side (no lock taken for such a backend) is in test_chat_worker.py; the SM margin reaching
FA3 and cuBLAS in test_attention_backends.py."""

from __future__ import annotations

import threading

import pytest
import torch
from reasoner_helpers import greedy_chats

from worldserve.chat_params import ChatMessage, ChatParams


def test_on_the_cpu_chats_take_turns_with_video(tiny_ckpt):
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64)
    r.warm_up()
    assert not r.concurrent_with_video and r.share.why_not == "not on a CUDA device"
    assert r.share.stream is None
    with pytest.raises(ValueError, match="--chat-sm-margin"):
        Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=64, chat_sm_margin=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chats_beside_video_forwards_emit_their_tokens_alone(tiny_ckpt):
    """Greedy chats on the Reasoner's stream while another thread runs gen forwards of a CFG pair on the same
    model and GPU without pause: the same tokens as alone; the SM margin is held exactly while chats live."""
    from transformers import AutoTokenizer

    from worldserve.models.cosmos3.batch import GenBatch, GenItem
    from worldserve.models.layers import flash_attention
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, device="cuda", progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=256, max_num_seqs=4, chat_sm_margin=8)
    assert not r.concurrent_with_video  # not before the decode graphs are captured
    r.warm_up()
    assert r.concurrent_with_video and r.share.why_not is None
    prompts = ["Hello there", "Describe a cat", "Count to ten"]
    alone = greedy_chats(r, prompts, 40, close=True)
    assert flash_attention._sm_margin == 0

    cfg = model.config
    g = torch.Generator().manual_seed(1)
    caches = model.prefill_und([torch.randint(0, 100, (n,), generator=g).cuda() for n in (9, 4)])
    lat = torch.randn(cfg.latent_channel, 3, 8, 8, generator=g).cuda()
    batch = GenBatch.pack([GenItem(latents=lat, timestep=500.0, und_cache=c) for c in caches], config=cfg,
                          device="cuda")  # fmt: skip
    assert model.launch_window == 2  # set with the Reasoner's readiness: forwards queue <= 2 layers ahead
    with torch.inference_mode():  # (also the first forward's one-time costs, before the race)
        windowed = model(batch).video[0]
        model.launch_window = 0
        torch.testing.assert_close(model(batch).video[0], windowed, rtol=0, atol=0)
        model.launch_window = 2
    torch.cuda.synchronize()
    stop, running, forwards, margins = threading.Event(), threading.Event(), [0], set()

    def video() -> None:
        with torch.inference_mode():
            while not stop.is_set():
                margins.add(flash_attention._sm_margin)  # as this forward's kernels see it
                model(batch)
                forwards[0] += 1
                running.set()
        torch.cuda.synchronize()

    thread = threading.Thread(target=video)
    thread.start()
    try:
        assert running.wait(60)
        beside = greedy_chats(r, prompts, 40, close=True)
        during = forwards[0]
    finally:
        stop.set()
        thread.join()
    assert beside == alone
    assert during > 1 and 8 in margins, (during, margins)  # video ran while the chats held the margin
    assert flash_attention._sm_margin == 0  # released with the last chat


def test_a_chat_failing_after_its_prefill_alone_gives_its_blocks_back(tiny_ckpt, monkeypatch):
    """start_many: a chat whose session cannot be made after the shared prefill (here: its logits raise, as
    an out-of-memory would) fails alone, its K/V blocks back and the live count (which holds the SM margin
    while chats run) untouched; a later choice of the same messages fails with it (nothing to fork)."""
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    r = Reasoner.from_pretrained(
        tiny_ckpt, model, tok, max_model_len=64, kv_cache_tokens=4096, kv_block_size=8
    )
    free = r.pool.num_free
    calls, real = [0], model.compute_logits

    def flaky(hidden):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(hidden)

    monkeypatch.setattr(model, "compute_logits", flaky)
    shared = (ChatMessage(role="user", content="Same words"),)
    batch = [ChatParams(messages=(ChatMessage(role="user", content="Hello"),), max_tokens=4),
             ChatParams(messages=shared, max_tokens=4), ChatParams(messages=shared, max_tokens=4, seed=1)]  # fmt: skip
    ok, failed, choice = r.start_many(batch)
    assert isinstance(failed, RuntimeError) and choice is failed
    assert r._live == 1 and r.pool.num_free == free - len(ok._seq.blocks)  # the failed chats hold none
    ok.close()
    assert r._live == 0 and r.pool.num_free == free
