"""LoRA through the VideoPipeline (float32, CPU, tiny checkpoint): a whole request with an adapter equals diffusers'
Cosmos3OmniPipeline whose transformer loaded the same adapter (`load_lora_adapter`, PEFT); requests with
different adapters never share a forward; the cache loads an adapter once per file and scale; a bad adapter
is refused by `validate` naming `lora`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from diffusers_oracle import assert_frames_match, rel_l2, run_diffusers_decoded
from pipeline_helpers import write_random_adapter
from safetensors.torch import load_file

from worldserve.params import LoraRequest, ParamError, VideoParams
from worldserve.runner.lora_cache import LoraCache

BASE = dict(prompt="A red fox runs through a snowy forest at dawn.", negative_prompt="blurry, distorted",
            num_frames=9, height=48, width=80, num_inference_steps=3, flow_shift=10.0, seed=1234)  # fmt: skip


@pytest.fixture(scope="module")
def adapter(tiny_ckpt, tmp_path_factory):
    return write_random_adapter(tmp_path_factory.mktemp("lora") / "fox", tiny_ckpt, rank=4, alpha=6.0)


@pytest.fixture(scope="module")
def adapted_diffusers(tiny_ckpt, adapter):
    """diffusers' pipeline with the adapter in its transformer at `weight` 0.5 (peft's scaling of B)."""
    pytest.importorskip("peft")
    from diffusers import Cosmos3OmniPipeline

    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    state = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    config = {
        "r": 4,
        "lora_alpha": 6.0,
        "target_modules": modules,
    }  # (diffusers reads it as LoraConfig kwargs)
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt, dtype=torch.float32)
    pipe.transformer.load_lora_adapter(state, prefix=None, adapter_name="fox", metadata=config)
    pipe.transformer.set_adapters(["fox"], weights=[0.5])
    return pipe


@pytest.mark.parametrize("case", ["t2v_sound", "i2v"])
def test_request_with_adapter_matches_diffusers(ours_pipeline, adapted_diffusers, adapter, case):
    extra = {"t2v_sound": dict(generate_sound=True),
             "i2v": dict(generate_sound=False, guidance_scale=4.0,
                         image=np.random.default_rng(1).integers(0, 256, (60, 90, 3), dtype=np.uint8))}[case]  # fmt: skip
    params = VideoParams(**BASE, **extra, lora=LoraRequest("fox", adapter, 0.5))
    result, state = ours_pipeline.generate(params)
    ref_latents, ref_sound, ref_frames = run_diffusers_decoded(
        adapted_diffusers, params, sound=params.generate_sound
    )
    assert rel_l2(state.latents, ref_latents.reshape(state.latents.shape)) <= 1e-4
    assert_frames_match(result.frames, ref_frames)
    if params.generate_sound:
        np.testing.assert_allclose(
            result.audio, ref_sound.float().numpy()[:, : result.audio.shape[1]], atol=1e-5
        )
    base, _ = ours_pipeline.generate(VideoParams(**BASE, **extra))  # the adapter changed the video
    assert np.abs(base.frames.astype(int) - result.frames.astype(int)).max() > 8


def test_adapters_never_share_a_forward(ours_pipeline, adapter):
    plain = VideoParams(**BASE, generate_sound=False)
    states = [
        ours_pipeline.prepare(
            "a", VideoParams(**BASE, generate_sound=False, lora=LoraRequest("fox", adapter, 1.0))
        ),
        ours_pipeline.prepare("b", plain),
        ours_pipeline.prepare(
            "c", VideoParams(**BASE, generate_sound=False, lora=LoraRequest("fox", adapter, 0.5))
        ),
        ours_pipeline.prepare(
            "d", VideoParams(**BASE, generate_sound=False, lora=LoraRequest("fox", adapter, 0.0))
        ),
    ]
    keys = [s.batch_key for s in states]
    assert len({keys[0], keys[1], keys[2]}) == 3 and keys[3] == keys[1]  # (scale 0: the base model)
    with pytest.raises(ValueError, match="cannot mix LoRA adapters"):
        ours_pipeline.denoise(states[:2])
    ours_pipeline.denoise([states[1], states[3]])  # the same step for both: the same latents after it
    assert torch.equal(states[1].latents, states[3].latents)
    for s in states:
        ours_pipeline.release(s)


def test_a_scale_that_overflows_the_activations_fails_naming_lora(ours_pipeline, adapter):
    """A scale of 1e30 passes the adapter's finite check (B x scale is finite) but overflows the activations:
    the latents went NaN and the request answered 200 with a black video (an audit's finding). The decode
    now refuses them, naming `lora`; without an adapter, or with the server's own, the same divergence is a
    DivergedError."""
    from worldserve.runner.video_decode import DivergedError, check_finite

    params = VideoParams(**{**BASE, "num_inference_steps": 1}, generate_sound=False,
                         lora=LoraRequest("fox", adapter, 1e30))  # fmt: skip
    with pytest.raises(ParamError, match="diverged") as err:
        ours_pipeline.generate(params, request_id="overflow")
    assert err.value.param == "lora"
    state = ours_pipeline.prepare("plain", VideoParams(**BASE, generate_sound=False))
    state.latents = state.latents.clone()
    state.latents[0, 0, 0, 0] = float("nan")
    with pytest.raises(DivergedError):
        check_finite(state)
    # the server's own adapter (--lora-path / --lora-scale) is the operator's: no request can lower it
    state.params = params
    with pytest.raises(DivergedError, match="the server needs a lower --lora-scale"):
        check_finite(state, server_lora=LoraRequest("fox", adapter, 1e30))
    with pytest.raises(ParamError, match="lower the scale"):  # another adapter than the server's
        check_finite(state, server_lora=LoraRequest("fox", adapter, 1.0))
    ours_pipeline.release(state)


def test_cache_loads_once_per_file_and_scale(ours_pipeline, tiny_ckpt, tmp_path):
    path = write_random_adapter(tmp_path / "a", tiny_ckpt, seed=3)
    cache = LoraCache(ours_pipeline.transformer, max_loaded=2)
    first = cache.get(LoraRequest("a", path, 1.0))
    assert cache.get(LoraRequest("other-name", path, 1.0)) is first  # (the name does not make an adapter)
    half = cache.get(LoraRequest("a", path, 0.5))
    assert half is not first and cache.get(LoraRequest("a", path, 0.0)) is None
    weights = os.path.join(path, "adapter_model.safetensors")
    os.utime(weights, ns=(1, 1))  # the file changed: read again
    again = cache.get(LoraRequest("a", path, 1.0))
    assert again is not first and again.key != first.key
    assert cache.get(LoraRequest("a", path, 1.0)) is again
    read = []
    cache._read = lambda request, spec, key, read_=cache._read: (
        read.append(request.scale) or read_(request, spec, key)
    )
    held = cache.get(LoraRequest("a", path, 0.5))  # (a new file identity: read, and kept with 1.0's)
    assert read == [0.5] and [k[1] for k in cache._loaded] == [1.0, 0.5]
    cache.get(LoraRequest("a", path, 2.0))  # (max_loaded 2: the least recently used host copy, 1.0's, goes)
    assert read == [0.5, 2.0] and [k[1] for k in cache._loaded] == [0.5, 2.0]
    assert cache.get(LoraRequest("a", path, 0.5)) is held and read == [0.5, 2.0]
    del again, first
    import gc

    gc.collect()  # (no request holds 1.0's copy any more: read again)
    cache.get(LoraRequest("a", path, 1.0))
    assert read == [0.5, 2.0, 1.0]


@pytest.mark.gpu
def test_gpu_copies_live_while_requests_hold_them(ours_pipeline, tiny_ckpt, tmp_path):
    """On a GPU the host copy is pinned and the device copy is shared by its holders, then freed."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import gc

    from worldserve.runner.video_pipeline import VideoPipeline

    pipe = VideoPipeline.from_pretrained(tiny_ckpt, device="cuda", progress=False)
    path = write_random_adapter(tmp_path / "a", tiny_ckpt)
    cache = LoraCache(pipe.transformer)
    a = cache.get(LoraRequest("a", path, 1.0))
    key = next(iter(cache._loaded))
    assert a.top["proj_in"][0].is_cuda and cache._loaded[key].top["proj_in"][0].is_pinned()
    assert cache.get(LoraRequest("b", path, 1.0)) is a
    before = torch.cuda.memory_allocated()
    del a
    gc.collect()
    assert torch.cuda.memory_allocated() < before and key not in cache._on_device


def test_validate_refuses_a_bad_adapter(ours_pipeline, tmp_path):
    with pytest.raises(ParamError) as err:
        ours_pipeline.validate(VideoParams(**BASE, lora=LoraRequest("x", str(tmp_path / "missing"))))
    assert err.value.param == "lora" and "no such file or folder" in err.value.message
    with pytest.raises(ParamError, match="finite"):
        VideoParams(**BASE, lora=LoraRequest("x", str(tmp_path), float("nan"))).validate()
    # (scale 0 runs the base model, but the adapter it names is checked all the same)
    with pytest.raises(ParamError, match="no such file or folder"):
        ours_pipeline.validate(VideoParams(**BASE, lora=LoraRequest("x", str(tmp_path / "missing"), 0.0)))


@pytest.mark.gpu
def test_gpu_adapter_through_compiled_bf16_layers(tiny_ckpt, ours_pipeline, adapter):
    """On a GPU with the served kernels (bf16, compiled gen layers, the attention backend auto picks): the
    adapter's request lands near the float32 CPU one, far from the base model's; so does the adapter merged
    into the bf16 weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from worldserve.runner.video_pipeline import VideoPipeline

    pipe = VideoPipeline.from_pretrained(tiny_ckpt, device="cuda", progress=False)
    params = VideoParams(**BASE, generate_sound=True, lora=LoraRequest("fox", adapter, 1.0))
    _, state = pipe.generate(params)
    _, cpu = ours_pipeline.generate(params)
    _, base = pipe.generate(VideoParams(**BASE, generate_sound=True))
    near = rel_l2(state.latents.float().cpu(), cpu.latents)
    assert near <= 5e-2 and rel_l2(base.latents.float().cpu(), cpu.latents) > 4 * near
    # merged into the bf16 weights, as serve's static adapter is
    from worldserve.runner.kernel_options import KernelOptions

    merged = VideoPipeline.from_pretrained(
        tiny_ckpt, device="cuda", progress=False, kernels=KernelOptions(merged_lora=params.lora)
    )
    assert merged.transformer.merged_lora is not None
    _, fused = merged.generate(params)
    assert rel_l2(fused.latents.float().cpu(), cpu.latents) <= 5e-2


def test_static_adapter_is_loaded_at_startup(ours_pipeline, adapter, tmp_path):
    """serve loads --lora-path's adapter against the model before it answers: a bad one stops the start, naming
    the flag; a good one is in the cache for the first request."""
    from worldserve.commands.serve_backend import load_static_lora
    from worldserve.config import LoraConfig

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^--lora-path: LoRA adapter .*found 0 \.safetensors files"):
        load_static_lora(ours_pipeline, LoraConfig(lora_path=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="^--lora-path: "):  # (checked at scale 0 too, which loads nothing)
        load_static_lora(ours_pipeline, LoraConfig(lora_path=str(tmp_path / "empty"), lora_scale=0.0))
    load_static_lora(ours_pipeline, LoraConfig(lora_path=adapter, lora_scale=0.25))
    static = LoraConfig(lora_path=adapter, lora_scale=0.25).static_lora
    assert any(key[1] == 0.25 for key in ours_pipeline.loras._loaded) and static.scale == 0.25
