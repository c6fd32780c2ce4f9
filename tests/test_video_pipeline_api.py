"""VideoPipeline as a Python user meets it (tiny checkpoint, CPU): from_pretrained resolving a model reference as
the CLI does (None: the embedded tiny checkpoint; a repo id: the Hugging Face cache), generate refusing the
prompt upsampling it cannot do, the token counts a result carries, and use as a context manager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_cache import hf_cache_snapshot

from worldserve.params import ParamError, VideoParams
from worldserve.runner.video_pipeline import VideoPipeline
from worldserve.weights.checkpoint import TINY_LAYOUT, TINY_SEED, CheckpointError

SMALL = dict(width=32, height=32, num_inference_steps=2, seed=3)


def _embedded_default(tiny_ckpt, tmp_path, monkeypatch) -> None:
    """resolve_model(None)'s folder under a fresh XDG_CACHE_HOME, linked to the session's tiny checkpoint."""
    cache = tmp_path / "cache"
    (cache / "worldserve").mkdir(parents=True)
    (cache / "worldserve" / f"tiny-cosmos3-v{TINY_LAYOUT}-seed{TINY_SEED}").symlink_to(tiny_ckpt)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))


def test_from_pretrained_without_a_path_loads_the_embedded_tiny_checkpoint(tiny_ckpt, tmp_path, monkeypatch):
    """No path had been a TypeError; the CLI's MODEL left out is the embedded tiny checkpoint."""
    _embedded_default(tiny_ckpt, tmp_path, monkeypatch)
    pipe = VideoPipeline.from_pretrained(device="cpu", dtype=torch.float32, progress=False)
    result, _ = pipe.generate(VideoParams(prompt="a fox", num_frames=1, **SMALL))
    assert result.frames.shape == (1, 32, 32, 3)


def test_from_pretrained_finds_a_repo_id_in_the_hf_cache(tiny_ckpt, tmp_path, monkeypatch, ours_pipeline):
    """A repo id had been read as a folder: 'nvidia/Cosmos3-Nano: model_index.json is missing'."""
    hf_cache_snapshot(tiny_ckpt, tmp_path, monkeypatch)
    pipe = VideoPipeline.from_pretrained(
        "nvidia/Cosmos3-Nano", revision="main", device="cpu", dtype=torch.float32, progress=False
    )
    params = VideoParams(prompt="a fox", num_frames=1, **SMALL)
    np.testing.assert_array_equal(pipe.generate(params)[0].frames, ours_pipeline.generate(params)[0].frames)
    with pytest.raises(CheckpointError, match="nvidia/Other .*not in the Hugging Face cache"):
        VideoPipeline.from_pretrained("nvidia/Other", device="cpu")


def test_generate_refuses_upsample_prompt_which_validate_accepts(ours_pipeline):
    """Prompt upsampling runs in the server's engine (the Reasoner): generate had ignored it in silence. The
    server validates such a request before its prompt is written, so validate still takes it."""
    params = VideoParams(prompt="a fox", num_frames=1, upsample_prompt=True, **SMALL)
    assert ours_pipeline.validate(params) is params
    with pytest.raises(ParamError, match="does not upsample prompts") as info:
        ours_pipeline.generate(params)
    assert info.value.param == "upsample_prompt"


def test_results_carry_the_prompt_tokens_and_the_denoised_gen_tokens(ours_pipeline):
    """prompt_tokens: the cond prompt ids prefilled; gen_tokens: the rows of one branch's gen stream that the
    transformer denoises (noisy video patches and sound tokens: GenBatch's timestep rows), for a video with
    sound and an image-to-video whose first latent frame is held clean."""
    from worldserve.models.cosmos3.batch import GenBatch
    from worldserve.runner.video_state import branch_items

    pipe = ours_pipeline
    first = np.full((32, 32, 3), 128, dtype=np.uint8)
    for params in (
        VideoParams(prompt="a fox in the snow", num_frames=9, generate_sound=True, **SMALL),
        VideoParams(prompt="the fox turns", num_frames=9, generate_sound=False, image=first, **SMALL),
    ):
        state = pipe.prepare("r", params)
        cond_ids, _ = pipe.encoder.encode_params(params, with_uncond=False)
        batch = GenBatch.pack(branch_items(state, state.und_caches[:1]), config=pipe.config, device="cpu")
        assert (state.sound is not None) == params.generate_sound
        assert state.prompt_tokens == len(cond_ids) > 0
        assert state.gen_tokens == batch.temb_rows.numel() > 0
        pipe.release(state)
        result, _ = pipe.generate(params)
        assert (result.prompt_tokens, result.gen_tokens) == (state.prompt_tokens, state.gen_tokens)
    _, frames, h, w = pipe.vae.latent_shape(9, 32, 32)
    p = pipe.config.latent_patch_size
    assert result.gen_tokens == (frames - 1) * -(-h // p) * -(-w // p)  # the I2V one: frame 0 held clean


def test_a_pipeline_is_a_context_manager(ours_pipeline):
    with ours_pipeline as pipe:
        assert pipe is ours_pipeline
    with pytest.raises(RuntimeError, match="inside"), ours_pipeline:
        raise RuntimeError("inside")  # (not swallowed)
