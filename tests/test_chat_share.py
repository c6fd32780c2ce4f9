"""Chats beside video steps (runner/chat_share.py): when the Reasoner may run without the model lock, on its
own stream, and that chats decoded while video forwards run on the same GPU emit the tokens they emit alone
(gpu). The worker side (no lock taken for such a backend) is in test_chat_worker.py; the SM margin reaching
FA3 and cuBLAS in test_attention_backends.py."""

from __future__ import annotations

import threading

import pytest
import torch
from reasoner_helpers import greedy_chats


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
    with torch.inference_mode():
        model(batch)  # the first forward's one-time costs before the race
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
