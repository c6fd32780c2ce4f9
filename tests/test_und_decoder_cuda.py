"""The Reasoner's decode on CUDA (gpu tests): the Triton paged attention against the reference, the decode
step's CUDA graphs against eager (alone, through the Reasoner's chats, under layerwise offload), and graph
captures while another thread of the process works on the same GPU: a multi-GPU pipeline's keep-alive
thread (runner/peers.py) pings idle peers at any time, the server's start-up (Reasoner.warm_up ->
UndDecoder.capture_all) included. Under CUDA's default "global" capture mode its calls (comm.send_object's
host-to-device copies, NCCL's completion polls) failed with cudaErrorStreamCaptureUnsupported and invalidated
the capture: the warm-up failed, and the keep-alive thread stopped for good."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from reasoner_helpers import greedy_chats

from worldserve.models.layers.paged_attention import paged_decode_attention_reference
from worldserve.models.layers.paged_kv import PagedKVPool


def _ping_work(dev: torch.device) -> None:
    """The CUDA work of one keep-alive ping on rank 0 (comm.send_object's two tensors, then a completion poll
    as NCCL's work.is_completed makes)."""
    data = torch.frombuffer(bytearray(pickle.dumps(("ping",))), dtype=torch.uint8).to(dev)
    torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    event = torch.cuda.Event()
    event.record()
    event.query()


def _step(decoder) -> torch.Tensor:
    seqs = [decoder.pool.sequence() for _ in range(3)]
    for s in seqs:
        s.reserve(1)
    return decoder.step([7, 8, 9], seqs, [0, 0, 0])


@pytest.mark.gpu
def test_decode_graphs_are_captured_beside_another_threads_cuda_work(tiny_ckpt):
    from worldserve.runner.und_decoder import UndDecoder
    from worldserve.weights.loader import load_transformer

    dev = torch.device("cuda")
    model = load_transformer(tiny_ckpt, dtype=torch.float32, device=dev, progress=False)

    def decoder(**kw) -> UndDecoder:
        return UndDecoder(
            model, model.new_paged_pool(4096, block_size=16), max_batch=32, max_model_len=512, **kw
        )

    want = _step(decoder(enforce_eager=True))
    _step(decoder())  # the step's math compiled before the pings start (the captures then take milliseconds)
    stop, errors, pings = threading.Event(), [], [0]

    def pinger() -> None:
        while not stop.is_set():
            try:
                _ping_work(dev)
            except Exception as exc:  # reported by the test
                errors.append(exc)
                return
            pings[0] += 1

    thread = threading.Thread(target=pinger, daemon=True)
    thread.start()
    graphed = []
    try:
        for _ in range(5):  # six buckets captured each time, the pings running throughout
            graphed.append(decoder())
            graphed[-1].capture_all()
    finally:
        stop.set()
        thread.join(10)
    assert not errors, errors[0]
    assert pings[0] > 0
    for d in graphed:  # the graphs captured beside the pings compute the eager step
        torch.testing.assert_close(_step(d), want, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("cached", [[0, 63, 64, 1000], [3000], [40, 1100, 2048, 7, 300]])
def test_triton_paged_attention_matches_the_reference(cached):
    """The Triton split + merge kernels at Nano's head layout (32 query / 8 KV heads, d 128, blocks of 64,
    bf16) against the torch reference, with lengths on and across block and split edges: same output, same
    new K/V stored."""
    from worldserve.models.layers.paged_attention import paged_decode_attention, triton_available

    if not triton_available():
        pytest.skip("needs Triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = []
    for _ in range(2):
        pool = PagedKVPool(num_layers=1, num_kv_heads=8, head_dim=128, num_blocks=200, block_size=64,
                           dtype=torch.bfloat16, device="cuda")  # fmt: skip
        pools.append(pool)
    pools[0].k.normal_(generator=g)
    pools[0].v.normal_(generator=g)
    pools[1].k.copy_(pools[0].k)
    pools[1].v.copy_(pools[0].v)
    perm = torch.randperm(199, generator=torch.Generator().manual_seed(1)) + 1  # scattered block ids
    table = torch.zeros(len(cached), 64, dtype=torch.int32)
    slots, used = [], 0
    for r, n in enumerate(cached):
        nb = n // 64 + 1  # the new token's block included
        table[r, :nb] = perm[used : used + nb].to(torch.int32)
        slots.append(int(table[r, n // 64]) * 64 + n % 64)
        used += nb
    table, lens = table.cuda(), torch.tensor(cached, dtype=torch.int32, device="cuda")
    slots = torch.tensor(slots, device="cuda")
    q = torch.randn(len(cached), 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k_new, v_new = (
        torch.randn(len(cached), 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv"
    )
    want = paged_decode_attention_reference(q, k_new, v_new, *pools[0].layer(0), table, lens, slots).float()
    got = paged_decode_attention(q, k_new, v_new, *pools[1].layer(0), table, lens, slots).float()
    assert float((got - want).norm() / want.norm()) < 1e-2
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)


@pytest.mark.gpu
def test_graphed_decode_equals_eager_on_cuda(tiny_ckpt):
    """The CUDA-graphed, compiled decode step (padded to its batch bucket) gives the eager step's logits on
    the tiny checkpoint in float32, over steps that grow the sequences across block edges."""
    from worldserve.runner.und_decoder import UndDecoder
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, device="cuda", progress=False)

    def run(enforce_eager: bool) -> list[torch.Tensor]:
        pool = model.new_paged_pool(4096, block_size=16)
        decoder = UndDecoder(model, pool, max_batch=4, max_model_len=512, enforce_eager=enforce_eager)
        assert decoder.use_graphs is not enforce_eager
        seqs, outs = [pool.sequence() for _ in range(3)], []
        for step in range(20):
            b = 3 if step % 2 else 1
            for s in seqs[:b]:
                s.reserve(1)
            outs.append(decoder.step([7 + step] * b, seqs[:b], [s.length for s in seqs[:b]]))
        return outs

    for got, want in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_graphed_reasoner_chats_equal_eager_on_cuda(tiny_ckpt):
    """Three concurrent greedy chats through the serve path on CUDA (warm-up compiles and captures every
    bucket) emit the tokens of the same chats with --enforce-eager."""
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, device="cuda", progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    prompts = ["Hello there", "Describe a cat", "Count to ten"]
    runs = []
    for eager in (True, False):
        r = Reasoner.from_pretrained(
            tiny_ckpt, model, tok, max_model_len=256, max_num_seqs=4, enforce_eager=eager
        )
        r.warm_up()
        runs.append(greedy_chats(r, prompts, 40))
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_offloaded_reasoner_chats_equal_resident_on_cuda(tiny_ckpt):
    """Under layerwise offload the decoder runs eagerly with the und blocks streamed per layer: the same
    greedy tokens as the resident, graphed model."""
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    prompts = ["Hello there", "Describe a cat"]
    runs = []
    for offload in (False, True):
        model = load_transformer(
            tiny_ckpt, dtype=torch.float32, device="cpu" if offload else "cuda", progress=False
        )
        if offload:
            model.enable_layerwise_offload("cuda")
        r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=256, max_num_seqs=4)
        assert r.decoder.use_graphs is not offload
        r.warm_up()
        runs.append(greedy_chats(r, prompts, 30))
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_compiled_prefill_equals_eager_and_compiles_once_for_every_prompt_length(tiny_ckpt):
    """On CUDA the prefill runs the decode step's compiled layer math (dynamic shapes) as piecewise CUDA graphs
    per token bucket, captured at the warm-up: after it no prompt length compiles a new graph, and each first
    token's logits (text of several lengths, an image prompt, a next turn starting on cached blocks, two
    chats in one pass) equal the --enforce-eager prefill's."""
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer

    from worldserve.chat_params import ChatMessage, ChatParams, ChatPart
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, device="cuda", progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    image = torch.randint(0, 256, (64, 96, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    first = ChatParams(prompt_ids=tuple(range(3, 140)), max_tokens=1, temperature=0.0)
    chats = [
        ChatParams(prompt_ids=tuple(range(3, 3 + n)), max_tokens=1, temperature=0.0) for n in (5, 37, 300)
    ] + [
        ChatParams(messages=(ChatMessage(role="user", content=(
            ChatPart(type="image", image=image.numpy()), ChatPart(type="text", text="What is this?"))),),
            max_tokens=1, temperature=0.0),
        ChatParams(prompt_ids=first.prompt_ids + (7, 8, 9), max_tokens=1, temperature=0.0),  # first's cached
    ]  # fmt: skip
    logits = {}
    for eager in (True, False):
        r = Reasoner.from_pretrained(
            tiny_ckpt, model, tok, max_model_len=512, max_num_seqs=4, enforce_eager=eager
        )
        assert (r.prefiller.math is None) is eager
        r.warm_up()
        r.start(first).close()  # its blocks cached for the last chat
        graphs = counters["stats"]["unique_graphs"]
        passes = None if eager else r.prefiller.graphs.replays
        out = []
        for batch in [[params] for params in chats] + [chats[1:3]]:
            for s in r.start_many(batch):
                out.append(s.pending_logits.float().cpu())
                s.close()
        if not eager:
            assert counters["stats"]["unique_graphs"] == graphs, "a prompt length compiled a new graph"
            assert r.prefiller.graphs.replays == passes + len(chats) + 1  # every pass ran the graphs
            assert r.prefix_cache_counts[1] > 0  # the next turn found first's blocks
        logits[eager] = out
    for got, want in zip(logits[False], logits[True], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    # chunked prefill through the graphs: the 300-token prompt in chunks of 64, each chunk a graphed pass
    chunked = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=512, max_num_seqs=4,
                                       max_num_batched_tokens=64)  # fmt: skip
    chunked.warm_up()
    passes = chunked.prefiller.graphs.replays
    s = chunked.start(chats[2])
    assert chunked.prefiller.graphs.replays == passes + 5
    torch.testing.assert_close(s.pending_logits.float().cpu(), logits[True][2], rtol=1e-3, atol=1e-3)
    s.close()


@pytest.mark.gpu
def test_a_pass_past_the_prefill_graphs_compiles_nothing_after_the_warm_up(tiny_ckpt):
    """With --max-num-seqs 1 the decode step never compiles its dynamic graph; the warm-up's pass past the
    largest bucket does, so a long prompt's first pass compiles nothing while serving."""
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer

    from worldserve.chat_params import ChatParams
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.bfloat16, device="cuda", progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    r = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=4096, max_num_seqs=1)
    r.warm_up()
    graphs, replays = counters["stats"]["unique_graphs"], r.prefiller.graphs.replays
    s = r.start(ChatParams(prompt_ids=tuple(3 + i % 250 for i in range(3000)), max_tokens=2, temperature=0.0))
    assert r.prefiller.graphs.replays == replays  # past the buckets: the compiled math
    assert counters["stats"]["unique_graphs"] == graphs
    s.step()
    s.close()
