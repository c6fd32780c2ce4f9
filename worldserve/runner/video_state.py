"""A video request's denoising state on the GPU side, and what its current step runs: which LoRA adapter, whether
the uncond (CFG) branch runs inside the guidance interval, which prompt K/V caches, and the GenItems of its
branches.

Separate from runner/video_pipeline.py, which loads the model and runs prepare / denoise / decode: these are
the plain data and per-step rules that every rank of a multi-GPU pipeline shares (runner/parallel_pipeline.py
on rank 0, runner/parallel_worker.py and runner/peers.py on the peers) without loading a VAE. The latents and
sound are float32 (diffusers' `sampling_dtype`); `batch_key` groups the requests one forward may carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from worldserve.models.cosmos3.batch import GenItem
from worldserve.models.layers.lora import LoraWeights
from worldserve.params import VideoParams
from worldserve.sampling.flow import FlowSchedule, SolverState
from worldserve.sampling.guidance import guided_at

if TYPE_CHECKING:
    from worldserve.models.layers.attention import KVCache


@dataclass(slots=True, eq=False)
class VideoRequestState:
    """One request's denoising state (implements engine.outputs.DenoiseState)."""

    request_id: str
    params: VideoParams
    schedule: FlowSchedule
    latents: Tensor
    """float32 [48, T, h, w] on the device."""
    sound: Tensor | None
    """float32 [64, T_s] or None."""
    und_caches: list
    """[cond] or [cond, uncond] prompt K/V caches."""
    clean_frames: tuple[int, ...]
    """Latent frames held clean (I2V: (0,); V2V: the condition frame indexes)."""
    lora: LoraWeights | None = None
    """The LoRA adapter the request runs with (runner/lora_cache.py), None for the base model."""
    video_solver: SolverState = field(default_factory=SolverState)
    sound_solver: SolverState = field(default_factory=SolverState)
    step_index: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    """Token ids of the cond prompt prefilled (VideoResult.prompt_tokens)."""
    gen_tokens: int = 0
    """Gen tokens denoised each step for one branch (`count_gen_tokens`; VideoResult.gen_tokens)."""

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps

    @property
    def batch_key(self) -> tuple:
        snd = 0 if self.sound is None else self.sound.shape[1]
        return (tuple(self.latents.shape), snd, None if self.lora is None else self.lora.key)

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps


def count_gen_tokens(latents: Tensor, sound: Tensor | None, clean_frames: Iterable[int], patch: int) -> int:
    """The gen tokens one branch of a request denoises: its noisy latent frames' patches (GenBatch's
    `patch` x `patch` patchify, odd latent sizes padded) plus its sound tokens; `clean_frames` are held
    clean, not generated."""
    _, frames, height, width = latents.shape  # [48, T, h, w]
    per_frame = -(-height // patch) * -(-width // patch)
    noisy = frames - len({i for i in clean_frames if 0 <= i < frames})
    return noisy * per_frame + (0 if sound is None else int(sound.shape[1]))


def step_lora(states: Sequence[VideoRequestState]) -> LoraWeights | None:
    """The one LoRA adapter (or None) that every state of a denoising step runs with: a forward applies one
    adapter, so the engine batches requests by `batch_key`, which holds the adapter's key; a mix is a bug."""
    keys = {None if s.lora is None else s.lora.key for s in states}
    if len(keys) > 1:
        raise ValueError("one denoising step cannot mix LoRA adapters: batch the requests by batch_key")
    return states[0].lora


def guided(s: VideoRequestState) -> bool:
    """Whether the current step of `s` runs its uncond branch (its guidance scale and interval)."""
    p = s.params
    return guided_at(p.guidance_scale, p.guidance_interval, s.schedule.timesteps[s.step_index])


def step_caches(s: VideoRequestState) -> list:
    """The und caches of the branches `s` runs here this step: all of them, or the cond one alone outside its
    guidance interval."""
    return list(s.und_caches) if guided(s) else list(s.und_caches[:1])


def branch_items(s: VideoRequestState, caches: Sequence) -> list[GenItem]:
    """The GenItems of one request's current step, one per und cache (CFG branch) in `caches`."""
    timestep = s.schedule.timesteps[s.step_index]
    return [gen_item(s.latents, timestep, c, s.params.fps, s.clean_frames, s.sound) for c in caches]


def gen_item(
    latents: Tensor, timestep: Tensor | float, cache: KVCache, fps: float, clean_frames: Iterable[int],
    sound: Tensor | None,
) -> GenItem:  # fmt: skip
    """One branch of one request at one timestep (shared with the CFG-parallel peer)."""
    return GenItem(
        latents=latents, timestep=timestep, und_cache=cache, fps=float(fps),
        clean_frames=tuple(clean_frames), sound=sound,
    )  # fmt: skip
