"""One denoising step with CFG (cond + uncond forward, then `u + s (c - u)` in float32), for our transformer
and for diffusers' `Cosmos3OmniTransformer`, on identical inputs.

- `OurStep`: the und tower runs once per CFG branch (`prefill_und`, timed separately as a fixed cost);
  each step packs both branches into one `GenBatch` (or runs them one after the other) and calls
  `forward`, which attends to the cached text K/V.
- `DiffusersStep`: built exactly as `Cosmos3OmniPipeline.__call__` builds its transformer inputs: the
  pipeline's own `_prepare_text_segment` / `_prepare_vision_segment` / `_prepare_sound_segment` (called on
  a stand-in that carries only `transformer` and `vae_scale_factor_temporal`), then per step the same
  casts, `torch.full` timesteps, two `transformer(...)` calls (which recompute the text every time) and
  `_mask_velocity_predictions`. The scheduler update is left out of both (our sampler is separate and both
  are < 1 ms).
Each `__call__(timestep)` returns (video velocity [1, 48, T, H, W], sound velocity [64, T_s] or None),
float32; `last` keeps the per-branch predictions of the latest call for the parity check.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from worldserve.bench.workload import VAE_TEMPORAL, Workload

if TYPE_CHECKING:
    from worldserve.models.cosmos3.batch import GenItem
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.models.layers.attention import ContiguousKVCache

GUIDANCE = 6.0

Step = Callable[[int], tuple[Tensor, Tensor | None]]
"""One CFG denoising step at a timestep -> (video velocity, sound velocity or None): OurStep, DiffusersStep."""


def cfg_combine(cond: Tensor, uncond: Tensor, scale: float = GUIDANCE) -> Tensor:
    return uncond + scale * (cond - uncond)


def make_inputs(w: Workload, vocab: int, device: torch.device, seed: int) -> dict[str, Tensor]:
    """Random prompt ids and float32 noise latents, shared by both implementations."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    inputs = {
        "cond_ids": torch.randint(0, vocab, (w.cond_text,), generator=g),
        "uncond_ids": torch.randint(0, vocab, (w.uncond_text,), generator=g),
        "latents": torch.randn(w.latent_shape, generator=g).to(device),  # [1, 48, T, H, W] fp32
    }
    if w.sound:
        inputs["sound"] = torch.randn((64, w.audio_frames), generator=g).to(device)  # [64, T_s] fp32
    return inputs


class OurStep:
    def __init__(
        self, model: Cosmos3Transformer, w: Workload, inputs: dict[str, Tensor], *, batch_cfg: bool = True
    ) -> None:
        self.model, self.w, self.batch_cfg = model, w, batch_cfg
        self.inputs = inputs
        self.caches: list[ContiguousKVCache] | None = None  # the cond and uncond text K/V (prefill())
        self.last: dict[str, Tensor | None] = {}
        self.lora = None  # a LoraWeights every forward (and the prefill) runs with (bench/lora_step.py)

    def prefill(self) -> None:
        """Text K/V of the cond and uncond prompts (once per request)."""
        self.caches = self.model.prefill_und(
            [self.inputs["cond_ids"], self.inputs["uncond_ids"]], lora=self.lora
        )

    def _items(self, timestep: int) -> list[GenItem]:
        from worldserve.models.cosmos3.batch import GenItem

        if self.caches is None:
            raise RuntimeError("call prefill() first")
        lat, snd = self.inputs["latents"][0], self.inputs.get("sound")
        return [
            GenItem(latents=lat, timestep=float(timestep), und_cache=c, fps=self.w.fps, sound=snd)
            for c in self.caches
        ]

    def __call__(self, timestep: int) -> tuple[Tensor, Tensor | None]:
        from worldserve.models.cosmos3.batch import GenBatch

        items, cfg, dev = self._items(timestep), self.model.config, self.model.device
        if self.batch_cfg:
            out = self.model(GenBatch.pack(items, config=cfg, device=dev), lora=self.lora)
            videos, sounds = out.video, out.sound
        else:
            outs = [self.model(GenBatch.pack([it], config=cfg, device=dev), lora=self.lora) for it in items]
            videos, sounds = [o.video[0] for o in outs], [o.sound[0] for o in outs]
        cv, uv = (v.float().unsqueeze(0) for v in videos)
        cs, us = (None if s is None else s.float() for s in sounds)
        self.last = {"cond_video": cv, "uncond_video": uv, "cond_sound": cs, "uncond_sound": us}
        return cfg_combine(cv, uv), (None if cs is None else cfg_combine(cs, us))


class DiffusersStep:
    def __init__(self, model: Any, w: Workload, inputs: dict[str, Tensor]) -> None:
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

        self.pipe_cls = Cosmos3OmniPipeline
        self.model, self.w, self.inputs = model, w, inputs
        self.device = inputs["latents"].device
        self.dtype = model.dtype
        stub = SimpleNamespace(transformer=model, vae_scale_factor_temporal=VAE_TEMPORAL)
        self.static = [self._static(stub, inputs[k]) for k in ("cond_ids", "uncond_ids")]
        t = w.latent_shape[2]
        self.vision_mask = torch.zeros((t, 1, 1), device=self.device, dtype=torch.float32)
        self.sound_mask = (
            torch.zeros((w.audio_frames, 1), device=self.device, dtype=torch.float32) if w.sound else None
        )
        self.last: dict[str, Tensor | None] = {}

    def _static(self, stub: SimpleNamespace, ids: Tensor) -> dict:
        """The per-prompt packed fields, as the pipeline builds them before its denoising loop."""
        p, dev = self.pipe_cls, self.device
        text = p._prepare_text_segment(stub, ids.tolist(), device=dev)
        vision = p._prepare_vision_segment(
            stub,
            input_vision_tokens=self.inputs["latents"],
            has_image_condition=False,
            mrope_offset=text["vision_start_temporal_offset"],
            vision_fps=self.w.fps,
            curr=text["und_len"],
            device=dev,
            condition_frame_indexes=[],
        )
        sound: dict = {}
        if self.w.sound:
            sound = p._prepare_sound_segment(
                stub,
                input_sound_tokens=self.inputs["sound"],
                mrope_offset=text["vision_start_temporal_offset"],
                sound_fps=float(self.model.config.sound_latent_fps),
                curr=text["und_len"] + vision["num_vision_tokens"],
                device=dev,
            )
        mrope = [text["text_mrope_ids"], vision["vision_mrope_ids"]] + (
            [sound["sound_mrope_ids"]] if sound else []
        )
        return {
            **text,
            **vision,
            **sound,
            "position_ids": torch.cat(mrope, dim=1),
            "sequence_length": text["und_len"] + vision["num_vision_tokens"] + sound.get("sound_len", 0),
        }

    def _forward(
        self, s: dict, vision_tokens: Tensor, sound_tokens: Tensor | None, vision_ts: Tensor,
        sound_ts: Tensor | None,
    ) -> tuple:  # fmt: skip
        return self.model(
            input_ids=s["input_ids"],
            text_indexes=s["text_indexes"],
            position_ids=s["position_ids"],
            und_len=s["und_len"],
            sequence_length=s["sequence_length"],
            vision_tokens=[vision_tokens],
            vision_token_shapes=s["vision_token_shapes"],
            vision_sequence_indexes=s["vision_sequence_indexes"],
            vision_mse_loss_indexes=s["vision_mse_loss_indexes"],
            vision_timesteps=vision_ts,
            vision_noisy_frame_indexes=s["vision_noisy_frame_indexes"],
            sound_tokens=[sound_tokens] if sound_tokens is not None else None,
            sound_token_shapes=s.get("sound_token_shapes"),
            sound_sequence_indexes=s.get("sound_sequence_indexes"),
            sound_mse_loss_indexes=s.get("sound_mse_loss_indexes"),
            sound_timesteps=sound_ts,
            sound_noisy_frame_indexes=s.get("sound_noisy_frame_indexes"),
            return_dict=False,
        )

    @torch.inference_mode()
    def __call__(self, timestep: int) -> tuple[Tensor, Tensor | None]:
        dev, dtype = self.device, self.dtype
        vision_tokens = self.inputs["latents"].to(device=dev, dtype=dtype)
        snd = self.inputs.get("sound")
        sound_tokens = snd.to(device=dev, dtype=dtype) if snd is not None else None
        vision_ts = torch.full((self.static[0]["num_noisy_vision_tokens"],), timestep, device=dev)
        sound_ts = (
            torch.full((self.static[0]["sound_len"],), timestep, device=dev) if snd is not None else None
        )
        branch = []
        for s in self.static:
            pv, ps, _ = self._forward(s, vision_tokens, sound_tokens, vision_ts, sound_ts)
            v, a, _ = self.pipe_cls._mask_velocity_predictions(
                pv,
                ps,
                vision_condition_mask=[self.vision_mask],
                sound_condition_mask=[self.sound_mask] if self.sound_mask is not None else None,
            )
            branch.append((v.float(), None if a is None else a.float()))
        (cv, cs), (uv, us) = branch
        self.last = {"cond_video": cv, "uncond_video": uv, "cond_sound": cs, "uncond_sound": us}
        return cfg_combine(cv, uv), (None if cs is None else cfg_combine(cs, us))


def rel_error(a: Tensor | None, b: Tensor | None) -> float | None:
    """||a - b|| / ||b|| in float64 (None when either side is absent)."""
    if a is None or b is None:
        return None
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def snapshot(step: OurStep | DiffusersStep, timestep: int) -> dict[str, Tensor | None]:
    """Velocities of one step at `timestep`: CFG-combined video / sound and the per-branch outputs (copies)."""
    video, sound = step(timestep)
    out = {"video": video, "sound": sound, **step.last}
    return {k: None if v is None else v.detach().clone() for k, v in out.items()}
