"""GenBatch.pack builds a layout's positions and index tensors once and reuses them over a request's steps.

Within a request only the latents' values and the timestep change from step to step; the layout (shapes,
prompt lengths, fps, clean frames) does not, so its device tensors are cached and each step moves only its
timesteps (without the stream synchronization a plain host-to-device copy costs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worldserve.models.cosmos3 import batch as batch_mod
from worldserve.models.cosmos3.batch import GenBatch, GenItem
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.transformer import Cosmos3Transformer

FIELDS = ("positions", "temb_rows", "temb_items", "video_rows", "video_slots", "sound_rows")


@pytest.fixture(scope="module")
def setup():
    config = Cosmos3Config.tiny()
    model = Cosmos3Transformer(config, dtype=torch.float32)
    caches = []
    for n in (5, 7):
        c = model.new_und_cache(n)
        c.advance(n)
        caches.append(c)
    return config, caches


def _items(config, caches, timestep, clean=(), frames=3):
    lat = torch.randn(config.latent_channel, frames, 4, 6)
    snd = torch.randn(config.sound_dim, 4)
    return [
        GenItem(latents=lat, timestep=timestep, und_cache=c, sound=snd, clean_frames=clean) for c in caches
    ]


def test_steps_of_one_request_share_the_layout_and_carry_their_own_timesteps(setup):
    config, caches = setup
    batch_mod._LAYOUTS.clear()
    first = GenBatch.pack(_items(config, caches, 900.0), config=config, device="cpu")
    later = GenBatch.pack(_items(config, caches, torch.tensor(450)), config=config, device="cpu")
    assert all(getattr(first, f) is getattr(later, f) for f in FIELDS)  # built once
    assert first.layout == later.layout
    assert first.timesteps.tolist() == [900.0, 900.0] and later.timesteps.tolist() == [450.0, 450.0]
    assert first.twins == later.twins == ((0, 1),)
    batch_mod._LAYOUTS.clear()  # a fresh build gives the same tensors as the reused ones
    fresh = GenBatch.pack(_items(config, caches, 450.0), config=config, device="cpu")
    assert all(torch.equal(getattr(fresh, f), getattr(later, f)) for f in FIELDS)


def test_a_different_layout_gets_its_own_tensors(setup):
    config, caches = setup
    base = GenBatch.pack(_items(config, caches, 1.0), config=config, device="cpu")
    i2v = GenBatch.pack(_items(config, caches, 1.0, clean=(0,)), config=config, device="cpu")
    assert i2v.video_rows.numel() < base.video_rows.numel()  # clean frame 0 gets no velocity rows
    swapped = GenBatch.pack(_items(config, caches[::-1], 1.0), config=config, device="cpu")
    assert not torch.equal(swapped.positions, base.positions)  # prompt lengths set the mRoPE origins
    other_config = dataclasses.replace(config)  # equal but another object: keyed apart, never confused
    again = GenBatch.pack(_items(config, caches, 1.0), config=other_config, device="cpu")
    assert torch.equal(again.positions, base.positions) and again.positions is not base.positions


def test_the_cache_keeps_a_bounded_number_of_layouts_and_drops_the_least_recently_used(setup):
    config, caches = setup
    batch_mod._LAYOUTS.clear()
    running = GenBatch.pack(_items(config, caches, 1.0, frames=1), config=config, device="cpu")
    built = {}
    for frames in range(2, batch_mod._LAYOUTS_KEPT + 4):
        built[frames] = GenBatch.pack(_items(config, caches, 1.0, frames=frames), config=config, device="cpu")
        again = GenBatch.pack(_items(config, caches, 0.5, frames=1), config=config, device="cpu")
        assert again.positions is running.positions  # used every step: never the one dropped
    assert len(batch_mod._LAYOUTS) == batch_mod._LAYOUTS_KEPT
    newest = max(built)
    kept = GenBatch.pack(_items(config, caches, 1.0, frames=newest), config=config, device="cpu")
    rebuilt = GenBatch.pack(_items(config, caches, 1.0, frames=2), config=config, device="cpu")
    assert kept.positions is built[newest].positions
    assert rebuilt.positions is not built[2].positions and torch.equal(rebuilt.positions, built[2].positions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_timesteps_arrive_and_the_layout_stays_on_the_device(setup):
    config, caches = setup
    dev = torch.device("cuda")
    a = GenBatch.pack(_items(config, caches, 700.0), config=config, device=dev)
    b = GenBatch.pack(_items(config, caches, torch.tensor(300.0)), config=config, device=dev)
    assert a.positions is b.positions and a.positions.device.type == "cuda"
    assert a.timesteps.device.type == "cuda" and a.timesteps.tolist() == [700.0, 700.0]
    assert b.timesteps.tolist() == [300.0, 300.0]
