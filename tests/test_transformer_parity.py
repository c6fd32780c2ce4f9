"""Our Cosmos3Transformer against diffusers' Cosmos3OmniTransformer on the tiny checkpoint (float32, CPU).

The diffusers forward inputs are built by the pipeline's own segment builders
(`Cosmos3OmniPipeline._prepare_{text,vision,sound}_segment`, called with a stand-in `self` that carries only
the transformer and the VAE's temporal factor) and assembled exactly as `__call__` does, so the reference
sees what the pipeline would pass. Our side: prefill_und once per prompt, then one packed GenBatch forward.
Velocities must agree to 1e-5 relative L2 (they agree to ~1e-7).
"""

from __future__ import annotations

import types

import pytest
import torch

from worldserve.models.cosmos3.batch import GenBatch, GenItem
from worldserve.models.cosmos3.positions import media_origin, sound_positions, text_positions, video_positions

TOL = 1e-5
VOCAB = 256  # random ids stay below the byte-level base of any tiny vocabulary


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    from diffusers import Cosmos3OmniTransformer

    from worldserve.weights.loader import load_transformer

    ref = Cosmos3OmniTransformer.from_pretrained(str(tiny_ckpt), subfolder="transformer", dtype=torch.float32)
    ours = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    return ref.eval(), ours


def reference_forward(ref, ids, latents, timestep, fps=24.0, clean_frames=(), sound=None):
    """diffusers' velocities for one CFG branch: video [C, T, H, W], sound [C_s, T_s] or None."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline as Pipe

    pipe = types.SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)
    text = Pipe._prepare_text_segment(pipe, ids.tolist(), "cpu")
    origin, und_len = text["vision_start_temporal_offset"], text["und_len"]
    vis = Pipe._prepare_vision_segment(
        pipe, latents[None], bool(clean_frames), origin, fps, und_len, "cpu", list(clean_frames)
    )
    mrope = [text["text_mrope_ids"], vis["vision_mrope_ids"]]
    seq_len = und_len + vis["num_vision_tokens"]
    kw = {}
    if sound is not None:
        snd = Pipe._prepare_sound_segment(
            pipe, sound, origin, float(ref.config.sound_latent_fps), seq_len, "cpu"
        )
        mrope.append(snd["sound_mrope_ids"])
        seq_len += snd["sound_len"]
        kw = dict(
            sound_tokens=[sound],
            sound_token_shapes=snd["sound_token_shapes"],
            sound_sequence_indexes=snd["sound_sequence_indexes"],
            sound_mse_loss_indexes=snd["sound_mse_loss_indexes"],
            sound_timesteps=torch.full((snd["sound_len"],), timestep),
            sound_noisy_frame_indexes=snd["sound_noisy_frame_indexes"],
        )
    with torch.no_grad():
        video, snd_out, _ = ref(
            input_ids=text["input_ids"],
            text_indexes=text["text_indexes"],
            position_ids=torch.cat(mrope, dim=1),
            und_len=und_len,
            sequence_length=seq_len,
            vision_tokens=[latents[None]],
            vision_token_shapes=vis["vision_token_shapes"],
            vision_sequence_indexes=vis["vision_sequence_indexes"],
            vision_mse_loss_indexes=vis["vision_mse_loss_indexes"],
            vision_timesteps=torch.full((vis["num_noisy_vision_tokens"],), timestep),
            vision_noisy_frame_indexes=vis["vision_noisy_frame_indexes"],
            return_dict=False,
            **kw,
        )
    return video[0][0], (None if snd_out is None else snd_out[0])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def make_case(seed, text_len, grid, sound_frames=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (text_len,), generator=g)
    latents = torch.randn(48, *grid, generator=g)
    sound = torch.randn(64, sound_frames, generator=g) if sound_frames else None
    return ids, latents, sound


def check(models, cases):
    """cases: dicts(ids, latents, timestep, fps, clean_frames, sound); one forward of ours, one diffusers call each."""
    ref, ours = models
    caches = ours.prefill_und([c["ids"] for c in cases])
    items = [
        GenItem(
            latents=c["latents"],
            timestep=c["timestep"],
            und_cache=cache,
            fps=c.get("fps", 24.0),
            clean_frames=c.get("clean_frames", ()),
            sound=c.get("sound"),
        )
        for c, cache in zip(cases, caches, strict=True)
    ]
    out = ours(GenBatch.pack(items, config=ours.config, device="cpu"))
    for c, video, sound in zip(cases, out.video, out.sound, strict=True):
        ref_video, ref_sound = reference_forward(
            ref,
            c["ids"],
            c["latents"],
            c["timestep"],
            c.get("fps", 24.0),
            c.get("clean_frames", ()),
            c.get("sound"),
        )
        assert video.shape == c["latents"].shape
        assert rel(video, ref_video) <= TOL
        for f in c.get("clean_frames", ()):
            assert torch.count_nonzero(video[:, f]) == 0
        if c.get("sound") is None:
            assert sound is None and ref_sound is None
        else:
            assert sound.shape == c["sound"].shape
            assert rel(sound, ref_sound) <= TOL


@pytest.mark.parametrize(
    "grid,fps",
    [((3, 3, 5), 24.0), ((2, 4, 6), 24.0), ((5, 2, 3), 16.0), ((4, 5, 3), 30.0), ((2, 1, 1), 24.0)],
    ids=["80x48", "96x64", "48x32@16fps", "48x80@30fps", "16x16"],
)
def test_t2v(models, grid, fps):
    ids, latents, _ = make_case(1, 23, grid)
    check(models, [dict(ids=ids, latents=latents, timestep=999, fps=fps)])


@pytest.mark.parametrize("fps", [24.0, 16.0])
def test_t2v_with_sound(models, fps):
    ids, latents, sound = make_case(2, 31, (3, 3, 5), sound_frames=10)
    check(models, [dict(ids=ids, latents=latents, timestep=861, fps=fps, sound=sound)])


@pytest.mark.parametrize("with_sound", [False, True])
def test_i2v_clean_first_frame(models, with_sound):
    ids, latents, sound = make_case(3, 19, (3, 3, 5), sound_frames=10 if with_sound else 0)
    check(models, [dict(ids=ids, latents=latents, timestep=500, clean_frames=(0,), sound=sound)])


def test_t2i_single_frame(models):
    ids, latents, _ = make_case(4, 17, (1, 4, 6))
    check(models, [dict(ids=ids, latents=latents, timestep=227, fps=24.0)])


def test_cfg_cond_and_uncond_in_one_forward(models):
    ids, latents, sound = make_case(5, 29, (3, 3, 5), sound_frames=10)
    neg = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(55))
    step = dict(latents=latents, timestep=950, sound=sound, clean_frames=(0,))
    check(models, [dict(ids=ids, **step), dict(ids=neg, **step)])


def test_requests_of_different_shapes_and_timesteps_batched(models):
    ids_a, lat_a, snd_a = make_case(6, 27, (3, 3, 5), sound_frames=10)
    ids_b, lat_b, _ = make_case(7, 14, (2, 4, 2))
    ids_c, lat_c, _ = make_case(8, 9, (1, 2, 3))
    check(
        models,
        [
            dict(ids=ids_a, latents=lat_a, timestep=999, sound=snd_a, fps=24.0),
            dict(ids=ids_b, latents=lat_b, timestep=412, fps=16.0, clean_frames=(0,)),
            dict(ids=ids_c, latents=lat_c, timestep=77),
        ],
    )


def test_positions_match_the_pipeline_builders(models):
    """Bit-identical mRoPE ids, including fractional fps-modulated ones."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
        get_3d_mrope_ids_text_tokens,
        get_3d_mrope_ids_vae_tokens,
    )

    cfg = models[1].config
    ref_text, nxt = get_3d_mrope_ids_text_tokens(110, 0, use_float_positions=True)
    assert torch.equal(text_positions(110), ref_text.float())
    origin = media_origin(110, cfg)
    assert origin == nxt + 15000
    for grid, fps in [((48, 23, 40), 24.0), ((12, 3, 5), 16.0), ((7, 2, 2), 29.97), ((1, 4, 6), 10.0)]:
        ref, _ = get_3d_mrope_ids_vae_tokens(
            *grid, origin, fps=fps, base_fps=24.0, temporal_compression_factor=4
        )
        assert torch.equal(video_positions(grid, origin=origin, fps=fps, config=cfg), ref.float())
    for n in (1, 10, 197):
        ref, _ = get_3d_mrope_ids_vae_tokens(
            n, 1, 1, origin, fps=25.0, base_fps=24.0, temporal_compression_factor=1
        )
        assert torch.equal(sound_positions(n, origin=origin, config=cfg), ref.float())


def test_action_heads_are_checked_but_not_loaded(tiny_copy):
    """The action heads (no request reaches them) stay out of the model, but the checkpoint must still hold
    them at their shapes: a checkpoint without them is refused, naming them."""
    import json

    from safetensors.torch import load_file, save_file

    from worldserve.weights.loader import CheckpointError, load_transformer

    model = load_transformer(tiny_copy, dtype=torch.float32, progress=False)
    assert not any("action" in name for name, _ in model.named_parameters())
    folder = tiny_copy / "transformer"
    for shard in folder.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(shard).items() if not k.startswith("action_proj_in")}, shard)
    for index in folder.glob("*.index.json"):
        data = json.loads(index.read_text())
        data["weight_map"] = {
            k: v for k, v in data["weight_map"].items() if not k.startswith("action_proj_in")
        }
        index.write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match="2 missing keys: action_proj_in.bias.weight; action_proj_in.fc"
    ):
        load_transformer(tiny_copy, dtype=torch.float32, progress=False)


def test_attention_bias_checkpoint(tmp_path):
    """A diffusers model with attention_bias=True, saved and loaded by both: fused q|k|v biases are right."""
    from diffusers import Cosmos3OmniTransformer

    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.weights.loader import load_transformer

    cfg = Cosmos3Config.tiny(vocab_size=300, sound=True)
    cfg = Cosmos3Config.from_dict({**cfg.to_dict(), "attention_bias": True})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref = Cosmos3OmniTransformer(**cfg.to_dict()).eval()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name.endswith("bias") or "modality_embed" in name or "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(str(tmp_path / "transformer"))
    ours = load_transformer(tmp_path, dtype=torch.float32, progress=False)
    assert ours.layers[1].gen.qkv_proj.bias is not None and ours.layers[0].und.o_proj.bias is not None
    ids, latents, sound = make_case(10, 15, (2, 3, 5), sound_frames=6)
    check((ref, ours), [dict(ids=ids, latents=latents, timestep=640, sound=sound, clean_frames=(0,))])
