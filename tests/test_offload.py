"""Layerwise offload: blocks packed into host buffers and streamed through device slots give the same numbers.

On the CPU the streamer runs its aliasing and copies synchronously (no memory is saved, but every block
must be re-loaded into the right slot before it runs, or the outputs differ); the `gpu` tests run the real
pinned-memory / side-stream path and check that it uses less device memory.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tests.pipeline_helpers import run_requests
from worldserve.models.cosmos3.wan_decoder import DEFAULT_CHUNK_SIZE
from worldserve.models.cosmos3.wan_decoder_convs import TimeWinogradConv3d
from worldserve.models.layers.offload import BlockStreamer
from worldserve.params import VideoParams
from worldserve.runner.kernel_options import KernelOptions
from worldserve.runner.video_pipeline import VideoPipeline

PARAMS = [
    VideoParams(prompt="a red fox in snow", width=80, height=48, num_frames=9, num_inference_steps=3, seed=1),
    VideoParams(prompt="waves", width=80, height=48, num_frames=9, num_inference_steps=3, seed=2),
]


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8, bias=False))


def test_streamed_blocks_alias_slots_and_compute_the_same():
    blocks = [_mlp(i) for i in range(5)]
    x = torch.randn(3, 8)
    expected = [b(x) for b in blocks]
    streamer = BlockStreamer(blocks, torch.device("cpu"), slots=2)
    assert len(streamer) == 5 and streamer.num_slots == 2
    # host blocks are views into power-of-two chunks: 5 x 1280 B -> chunks of 4096 (3 blocks), 2048, 2048
    assert streamer.block_bytes == 1280 and streamer.pinned_bytes == 4096 + 2048 + 2048
    assert streamer.host[1].data_ptr() - streamer.host[0].data_ptr() == 1280
    # blocks 0, 2, 4 share slot 0's storage: only two blocks' worth of "device" memory
    assert blocks[0][0].weight.data_ptr() == blocks[2][0].weight.data_ptr() == blocks[4][0].weight.data_ptr()
    assert blocks[1][0].weight.data_ptr() != blocks[0][0].weight.data_ptr()
    for _ in range(2):  # a second pass (the next denoising step) reloads every block again
        for i, block in enumerate(blocks):
            with streamer.use(i):
                torch.testing.assert_close(block(x), expected[i], rtol=0, atol=0)
    # out of order too (the und tower runs between gen passes with its own streamer; any order must hold)
    for i in (3, 0, 4, 4, 1):
        with streamer.use(i):
            torch.testing.assert_close(blocks[i](x), expected[i], rtol=0, atol=0)


def test_pinned_chunks_hold_every_block_in_powers_of_two():
    from worldserve.models.layers.offload import pinned_chunks

    block = 368 * 2**20  # a Nano gen block
    chunks = pinned_chunks(36, block)
    assert sum(k for _, k in chunks) == 36
    assert all(size & (size - 1) == 0 and size - k * block < block for size, k in chunks)
    assert sum(size for size, _ in chunks) < 1.05 * 36 * block  # 13.5 GiB, not 36 x 512 MiB = 18 GiB


def test_a_failing_block_leaves_the_streamer_usable():
    blocks = [_mlp(i) for i in range(3)]
    x = torch.randn(2, 8)
    expected = [b(x) for b in blocks]
    streamer = BlockStreamer(blocks, torch.device("cpu"))
    with pytest.raises(RuntimeError), streamer.use(0):
        raise RuntimeError("out of memory in block 0")
    for i in (1, 2, 0):
        with streamer.use(i):
            torch.testing.assert_close(blocks[i](x), expected[i], rtol=0, atol=0)


def test_blocks_of_different_layouts_are_refused():
    with pytest.raises(ValueError, match="block 1 differs in layout"):
        BlockStreamer([_mlp(0), nn.Linear(8, 8)], torch.device("cpu"))
    with pytest.raises(ValueError, match=">= 2 device slots"):
        BlockStreamer([_mlp(0), _mlp(1)], torch.device("cpu"), slots=1)


@pytest.fixture(scope="module")
def offloaded(tiny_ckpt):
    return VideoPipeline.from_pretrained(
        tiny_ckpt,
        device="cpu",
        dtype=torch.float32,
        kernels=KernelOptions(layerwise_offload=True),
        progress=False,
    )


def _five_layer_pipeline(base: VideoPipeline) -> VideoPipeline:
    """`base` with a 5-layer transformer (layer i: base layer i % 2 plus its own noise), so that two slots
    hold blocks 0/2/4 and 1/3 in turn and the wrap-around from block 4 to block 0 hits the same slot."""
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer

    config = dataclasses.replace(base.config, num_hidden_layers=5)
    model = Cosmos3Transformer(config, dtype=torch.float32)
    source = base.transformer.state_dict()
    gen = torch.Generator().manual_seed(0)
    state = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if parts[0] == "layers":
            layer = int(parts[1])
            value = source[".".join(["layers", str(layer % 2), *parts[2:]])]
            value = value + 0.02 * torch.randn(value.shape, generator=gen, dtype=value.dtype)
        else:
            value = source[key]
        state[key] = value
    model.load_state_dict(state)
    return VideoPipeline(model.eval().requires_grad_(False), base.vae, base.audio_vae, base.encoder, "cpu")


def test_offloaded_transformer_generates_bitwise_the_same(ours_pipeline):
    resident = _five_layer_pipeline(ours_pipeline)
    offloaded = _five_layer_pipeline(ours_pipeline)
    t = offloaded.transformer
    t.enable_layerwise_offload("cpu")
    assert len(t.gen_blocks) == len(t.und_blocks) == 5 and t.gen_blocks.num_slots == 2
    assert t.layers[0].gen.qkv_proj.weight.data_ptr() == t.layers[4].gen.qkv_proj.weight.data_ptr()
    assert t.gen_blocks.host_bytes == 5 * t.gen_blocks.block_bytes == 2.5 * t.gen_blocks.device_bytes
    ref = run_requests(resident, PARAMS)  # batched CFG, two requests, joint audio, und prefill per request
    got = run_requests(offloaded, PARAMS)
    for (lat, snd, res), (lat_o, snd_o, res_o) in zip(ref, got, strict=True):
        assert torch.equal(lat, lat_o) and torch.equal(snd, snd_o)
        assert (res.frames == res_o.frames).all()


def test_offloaded_pipeline_loads_through_kernel_options(ours_pipeline, offloaded):
    t = offloaded.transformer
    assert t.gen_blocks is not None and t.device.type == "cpu"
    assert t.layers[0].gen.qkv_proj.weight.data_ptr() != t.layers[1].gen.qkv_proj.weight.data_ptr()
    # memory is short under offload: the VAE decodes with plain Conv3d calls (Winograd's transformed
    # frames would add to the decode's peak); the resident pipeline keeps the faster Winograd convs
    winograd = [(m.time_winograd, r.time_winograd) for m, r in zip(
        offloaded.vae.decoder.modules(), ours_pipeline.vae.decoder.modules(), strict=True,
    ) if isinstance(m, TimeWinogradConv3d)]  # fmt: skip
    assert winograd and all(not mine and theirs for mine, theirs in winograd)
    # both decode 2 latent frames a chunk (DEFAULT_CHUNK_SIZE: a served 720p request ran out of memory on a
    # 31 GiB cap with 4): the same frames, as every chunk size gives
    assert offloaded.vae.decode_chunk_size == ours_pipeline.vae.decode_chunk_size == DEFAULT_CHUNK_SIZE == 2
    ref, got = run_requests(ours_pipeline, PARAMS[:1])[0], run_requests(offloaded, PARAMS[:1])[0]
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_offloaded_reasoner_answers_the_same(tiny_ckpt, ours_pipeline, offloaded):
    from worldserve.chat_params import ChatMessage, ChatParams
    from worldserve.runner.reasoner import Reasoner

    params = ChatParams(
        messages=(ChatMessage(role="user", content="Describe a fox."),), temperature=0.0, max_tokens=12
    )
    answers = []
    for pipe in (ours_pipeline, offloaded):
        session = Reasoner.from_pretrained(tiny_ckpt, pipe.transformer, pipe.encoder.tokenizer).start(params)
        while session.finish_reason is None:
            session.step()
        answers.append(session.token_ids)
    assert answers[0] == answers[1] and len(answers[0]) > 0


def test_fp8_quantised_then_offloaded(tiny_ckpt, ours_pipeline, tmp_path):
    kernels = KernelOptions(quantization="fp8-emulated", layerwise_offload=True)
    pipe = VideoPipeline.from_pretrained(
        tiny_ckpt, device="cpu", dtype=torch.float32, kernels=kernels, progress=False
    )
    plain = VideoPipeline.from_pretrained(
        tiny_ckpt, device="cpu", dtype=torch.float32, kernels=KernelOptions(quantization="fp8-emulated"),
        progress=False,
    )  # fmt: skip
    got, ref = run_requests(pipe, PARAMS[:1])[0], run_requests(plain, PARAMS[:1])[0]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with pytest.raises(ValueError, match="quantize before enable_layerwise_offload"):
        pipe.transformer.quantize_gen_fp8(emulate=True)
    # a LoRA adapter over fp8 GEMMs and streamed blocks: its pairs stay on the device beside the slots
    from tests.pipeline_helpers import write_random_adapter
    from worldserve.params import LoraRequest

    lora = LoraRequest("fox", write_random_adapter(tmp_path / "fox", tiny_ckpt), 1.0)
    adapted = dataclasses.replace(PARAMS[0], lora=lora)
    got, ref = run_requests(pipe, [adapted])[0], run_requests(plain, [adapted])[0]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert (got[0] - run_requests(plain, PARAMS[:1])[0][0]).abs().max() > 1e-2


@pytest.mark.gpu
def test_gpu_offload_matches_resident_model_and_saves_memory(ours_pipeline):
    """The 5-layer model on CUDA: pinned host blocks, side-stream copies, event ordering; same velocities
    as the resident copy, bitwise, with two of five blocks per tower on the device."""
    from worldserve.bench.denoise import OurStep, make_inputs
    from worldserve.bench.workload import Workload

    device = torch.device("cuda")
    w = Workload(width=128, height=64, num_frames=9, sound=True, cond_text=20, uncond_text=7)
    outputs, memory = [], []
    for offload in (False, True):
        model = _five_layer_pipeline(ours_pipeline).transformer
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        if offload:
            model.enable_layerwise_offload(device)
        else:
            model.to(
                device
            ).post_load()  # RoPE tables computed on the device, as enable_layerwise_offload does
        memory.append(torch.cuda.memory_allocated(device) - before)
        step = OurStep(model, w, make_inputs(w, model.config.vocab_size, device, seed=0))
        step.prefill()
        outputs.append(
            [x.cpu() for t in (900, 500, 100) for x in step(t)]
        )  # three forwards, same blocks reused
        del model, step
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)
    assert memory[1] < memory[0]


@pytest.mark.gpu
def test_gpu_pipeline_loads_on_a_bare_cuda_device(tiny_ckpt):
    """`serve` / `generate` without --device pass torch.device("cuda") (no index): resident and offloaded."""
    for offload in (False, True):
        kernels = KernelOptions(layerwise_offload=offload, compile=False)
        pipe = VideoPipeline.from_pretrained(tiny_ckpt, device="cuda", kernels=kernels, progress=False)
        assert pipe.transformer.device.type == "cuda"
        run_requests(pipe, PARAMS[:1])
