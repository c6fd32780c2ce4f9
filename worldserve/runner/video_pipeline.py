"""VideoPipeline: the GPU side of a video request, as the engine's `VideoBackend` (prepare / denoise / decode).

prepare:  VideoParams -> prompt token ids (cond, uncond) -> the request's LoRA adapter, if any, from the
          LoraCache -> und K/V prefill of both CFG branches (under the adapter's und deltas), once ->
          initial noise drawn exactly as diffusers' Cosmos3OmniPipeline draws it (CPU generator seeded with
          the request's seed: the video noise, then the sound noise) -> I2V: latent frame 0 replaced by the
          VAE-encoded conditioning image (held clean); V2V: the first max(idx)*4+1 frames of the clip encoded,
          latent frames `condition_frame_indexes` replaced and held clean -> an immutable FlowSchedule + per-request SolverStates.
denoise:  one step for a list of prepared requests: one transformer forward over every request and both
          CFG branches (GenBatch; requests batch only with those of the same adapter: `batch_key`), CFG
          combine in float32, then each request's UniPC step.
decode:   Wan2.2 VAE (video) and AVAE (audio, trimmed to the video length) -> host uint8 frames + float audio.
The sampling state is float32 (diffusers' `sampling_dtype`); the transformer runs in its own dtype.
Kernels (runner/kernel_options.py): compiled gen layers on CUDA, the gen tower's FA4 cluster kernel and
FlashAttention-3 where they run (else cuDNN-first SDPA); opt-in fp8 GEMMs / fp8 attention on Hopper only,
refused elsewhere before anything loads. A request's state and its per-step rules (adapter, CFG interval,
caches) are runner/video_state.py's; its initial noise and conditioning latents runner/video_conditioning.py's.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import torch
from torch import Tensor

from worldserve.closeable import Closeable
from worldserve.engine.outputs import VideoResult
from worldserve.models.cosmos3.batch import GenBatch, GenItem, GenOutput
from worldserve.models.cosmos3.prompt import PromptEncoder
from worldserve.models.layers.compile_limits import limits_in_this_thread
from worldserve.models.layers.lora import LoraWeights
from worldserve.parallel.groups import SINGLE, ParallelGroup
from worldserve.params import ParamError, VideoParams
from worldserve.runner.devices import check_device, default_device, default_dtype
from worldserve.runner.kernel_options import KernelOptions
from worldserve.runner.lora_cache import DEFAULT_MAX_LOADED, LoraCache
from worldserve.runner.video_conditioning import encode_image, encode_video, initial_noise
from worldserve.runner.video_decode import decode_video
from worldserve.runner.video_state import (
    VideoRequestState,
    branch_items,
    count_gen_tokens,
    step_caches,
    step_lora,
)
from worldserve.sampling.flow import FlowSchedule, unipc_step
from worldserve.sampling.guidance import cfg_combine, needs_uncond
from worldserve.weights.checkpoint import read_layout, resolve_model
from worldserve.weights.load_lock import model_loads
from worldserve.weights.loader import load_transformer

if TYPE_CHECKING:  # the VAEs import diffusers, which a peer rank (transformer only) never needs
    from worldserve.models.cosmos3.audio_vae import AudioVAE
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.models.cosmos3.vae import VideoVAE
    from worldserve.runner.parallel_pipeline import ParallelPipeline

log = logging.getLogger(__name__)


def load_configured_transformer(
    root: Path,
    dtype: torch.dtype,
    device: torch.device,
    kernels: KernelOptions,
    *,
    tp: ParallelGroup | None = None,
    progress: bool = True,
) -> Cosmos3Transformer:
    """The checkpoint's transformer (this rank's tensor-parallel slices with `tp`) with `kernels` applied:
    what every rank of a pipeline runs."""
    load_device = kernels.load_device(device)
    transformer = load_transformer(root, dtype=dtype, device=load_device, progress=progress, tp=tp)
    log.info("transformer kernels: %s", kernels.apply(transformer, device))
    return transformer


class SteppedBackend(Protocol):
    """What `VideoPipeline.generate` runs through (VideoPipeline, and ParallelPipeline, which borrows it)."""

    def validate(self, params: VideoParams) -> VideoParams: ...

    def prepare(self, request_id: str, params: VideoParams) -> VideoRequestState: ...

    def denoise(self, states: Sequence[VideoRequestState]) -> None: ...

    def decode(self, state: VideoRequestState, *, stream: bool = False) -> VideoResult: ...


class _Sentinel(enum.Enum):
    READ_ADAPTER = "read"


READ_ADAPTER: Final = _Sentinel.READ_ADAPTER
"""VideoPipeline.prepare's `adapter` default: read the request's adapter there."""


class VideoPipeline(Closeable):
    """Loaded Cosmos3 generation components behind the VideoBackend protocol."""

    def __init__(
        self, transformer: Cosmos3Transformer, vae: VideoVAE, audio_vae: AudioVAE | None, encoder: PromptEncoder,
        device: str | torch.device, max_loras: int = DEFAULT_MAX_LOADED, max_lora_rank: int | None = None,
    ) -> None:  # fmt: skip
        self.transformer = transformer
        self.loras = LoraCache(transformer, max_loras, max_lora_rank)
        self.vae = vae
        self.audio_vae = audio_vae
        self.encoder = encoder
        self.device = torch.device(device)
        self.config = transformer.config

    @classmethod
    @model_loads("VideoPipeline.from_pretrained")
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        vae_tiling: bool = False,
        progress: bool = True,
        kernels: KernelOptions | None = None,
        tp: ParallelGroup = SINGLE,
        max_loras: int = DEFAULT_MAX_LOADED,
        *,
        max_lora_rank: int | None = None,
        revision: str | None = None,
    ) -> VideoPipeline:
        """Load transformer, VAE, audio VAE (when the checkpoint has one) and tokenizer from a checkpoint.

        `path` as the CLI's MODEL (weights/checkpoint.py resolve_model): a checkpoint folder, a Hugging Face
        repo id found in the HF cache (downloaded unless HF_HUB_OFFLINE=1) at `revision`, or None for the
        embedded tiny checkpoint (noise).

        `kernels` (default KernelOptions()): compile on CUDA, fp8 GEMMs / attention, attention backend; an
        option that cannot run here (fp8 off Hopper, FLASH_ATTN without FA3) is a ValueError before any
        loading. The compiled VAE decoder follows `kernels.compile`; under layerwise offload (memory is short)
        it decodes with plain Conv3d calls (the Winograd convs' transformed frames add ~6.4 GiB to a 720p
        decode's peak). `tp`: this rank's tensor-parallel group (ParallelPipeline; every rank of it must then
        run the same transformer calls). `max_loras`: LoRA adapters kept read in host memory; `max_lora_rank`:
        the highest module rank of an adapter its requests may name (--max-lora-rank; None: no bound; runner/
        lora_cache.py)."""
        root = resolve_model(None if path is None else str(path), revision)
        layout = read_layout(root)
        dev: torch.device = torch.device(device) if device is not None else default_device()
        if dtype is None:
            dtype = default_dtype(dev)
        kernels = kernels or KernelOptions()
        kernels.check(dev, dtype)
        from worldserve.models.cosmos3.audio_vae import AudioVAE
        from worldserve.models.cosmos3.vae import VideoVAE

        prompts = PromptEncoder.from_pretrained(root)  # (first: a bad tokenizer before minutes of weights)
        transformer = load_configured_transformer(root, dtype, dev, kernels, tp=tp, progress=progress)
        vae = VideoVAE.from_pretrained(
            root / "vae", dtype=dtype, device=dev, tiling=vae_tiling,
            compile_decoder=kernels.compile and dev.type == "cuda", time_winograd=not kernels.layerwise_offload,
        )  # fmt: skip
        audio_vae = None
        if layout.has_sound:
            audio_vae = AudioVAE.from_pretrained(root / "sound_tokenizer", dtype=dtype, device=dev)
        return cls(transformer, vae, audio_vae, prompts, dev, max_loras, max_lora_rank)

    # ------------------------------------------------------------------ VideoBackend
    @property
    def has_sound(self) -> bool:
        return self.audio_vae is not None

    def sound_enabled(self, params: VideoParams) -> bool:
        """Audio is on by default for videos when the checkpoint has a sound tokenizer; off for images."""
        if params.generate_sound is None:
            return self.has_sound and params.num_frames > 1
        return bool(params.generate_sound)

    def problem(self) -> str | None:
        """None: one process, nothing of it can be gone while it answers (ParallelPipeline's peers can)."""
        return None

    def prepare_thread(self) -> None:
        """Called by the thread that will run this backend (the engine's, the chat worker's): dynamo's graph
        limits for it (on torch >= 2.12 a config value set is the setting thread's own: set at load, on the
        loader thread, they did not reach this one, which kept 8 graphs and then ran eagerly)."""
        limits_in_this_thread()

    def validate(self, params: VideoParams) -> VideoParams:
        """Field checks plus model checks (sound available, prompts within max_sequence_length, a LoRA adapter
        that fits the transformer and --max-lora-rank, at a scale of 0 too: headers only)."""
        params.validate()
        self.loras.check(params.lora)
        if self.sound_enabled(params):
            if not self.has_sound:
                raise ParamError(
                    "generate_sound",
                    "generate_sound was requested but this checkpoint has no sound tokenizer",
                )
            if params.num_frames == 1:
                raise ParamError(
                    "generate_sound", "sound cannot be generated for a single image (num_frames=1)"
                )
        self.encoder.encode_params(params, with_uncond=needs_uncond(params.guidance_scale))
        return params

    @torch.inference_mode()
    def prepare(
        self, request_id: str, params: VideoParams, *, prefill_uncond: bool = True,
        prompt_ids: tuple[list[int], list[int] | None] | None = None,
        adapter: LoraWeights | None | Literal[_Sentinel.READ_ADAPTER] = READ_ADAPTER,
    ) -> VideoRequestState:  # fmt: skip
        """`prefill_uncond=False`: the uncond branch lives elsewhere (CFG-parallel peer); cond cache only.
        `prompt_ids`: (cond ids, uncond ids or None) when the caller has already tokenized the prompts.
        `adapter`: the request's LoraWeights (or None) when the caller has already read them (ParallelPipeline:
        what its peers load too); by default read here."""
        t0 = time.perf_counter()
        cfg = needs_uncond(params.guidance_scale)
        cond_ids, uncond_ids = prompt_ids or self.encoder.encode_params(params, with_uncond=cfg)
        prompts = [torch.tensor(cond_ids, dtype=torch.long)]
        if uncond_ids is not None and prefill_uncond:
            prompts.append(torch.tensor(uncond_ids, dtype=torch.long))
        lora = (
            self.loras.get(params.lora) if adapter is READ_ADAPTER else adapter
        )  # (und deltas shape the K/V)
        caches = self.transformer.prefill_und(prompts, lora=lora)
        t1 = time.perf_counter()
        latents, sound = initial_noise(
            params, self.vae, self.audio_vae, self.sound_enabled(params), self.device
        )
        clean: tuple[int, ...] = ()
        if params.image is not None:
            latents[:, 0] = encode_image(self.vae, params.image, params, self.device)
            clean = (0,)
        elif params.video is not None:
            cond = encode_video(self.vae, params.video, params, self.device)  # [48, max(idx)+1, h, w]
            clean = tuple(sorted(set(params.condition_frame_indexes)))
            for i in clean:
                latents[:, i] = cond[:, i]
        state = VideoRequestState(
            request_id=request_id,
            params=params,
            schedule=FlowSchedule.native(params.num_inference_steps, params.resolved_flow_shift()),
            latents=latents,
            sound=sound,
            und_caches=caches,
            clean_frames=clean,
            lora=lora,
            prompt_tokens=len(cond_ids),
            gen_tokens=count_gen_tokens(latents, sound, clean, self.config.latent_patch_size),
        )
        state.stage_seconds["prefill"] = t1 - t0
        state.stage_seconds["prepare_latents"] = time.perf_counter() - t1
        return state

    @torch.inference_mode()
    def denoise(self, states: Sequence[VideoRequestState]) -> None:
        """Advance every state by one step with a single batched transformer forward."""
        t0 = time.perf_counter()
        items = [it for s in states for it in branch_items(s, step_caches(s))]  # cond, then uncond (CFG)
        self.apply_step(states, self.forward(items, step_lora(states)), t0)

    def apply_step(
        self,
        states: Sequence[VideoRequestState],
        out: GenOutput,
        t0: float,
        remote: Mapping[str, tuple] | None = None,
    ) -> None:
        """CFG-combine and UniPC-step every state from `out` (one row per und cache, states in order); the
        uncond velocities (video, sound or None) of requests in `remote` come from elsewhere and go last."""
        row = 0
        for s in states:
            n = len(step_caches(s))
            v_video = list(out.video[row : row + n])
            v_sound = list(out.sound[row : row + n]) if s.sound is not None else None
            if remote and s.request_id in remote:
                v, vs = remote[s.request_id]
                v_video.append(v)
                if v_sound is not None:
                    v_sound.append(vs)
            self.combine_and_step(s, v_video, v_sound)
            row += n
        self.finish_step(states, t0)

    sp: ParallelGroup = SINGLE
    """Ulysses group of this rank's forwards (set by ParallelPipeline; one process: no parallelism)."""

    def forward(self, items: Sequence[GenItem], lora: LoraWeights | None = None) -> GenOutput:
        """One transformer forward over `items` (any mix of requests and branches that share `lora`)."""
        return self.transformer(GenBatch.pack(items, config=self.config, device=self.device), self.sp, lora)

    def finish_step(self, states: Sequence[VideoRequestState], t0: float) -> None:
        """Synchronize the device and add the step's wall time to every state's "diffuse" stage."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        for s in states:
            s.stage_seconds["diffuse"] = s.stage_seconds.get("diffuse", 0.0) + elapsed

    def combine_and_step(
        self, s: VideoRequestState, v_video: list[Tensor], v_sound: list[Tensor] | None
    ) -> None:
        """[cond] or [cond, uncond] velocities (model dtype) -> float32 CFG combine -> UniPC step. The state's
        update is whole or none: computed first, then assigned together, `step_index` last (a failure between
        the video's and the sound's step had left the state half updated; engine/batch.py steps again alone a
        state whose step_index did not move)."""
        g = s.params.guidance_scale
        v_video = [v.float() for v in v_video]
        velocity = cfg_combine(v_video[0], v_video[1], g) if len(v_video) == 2 else v_video[0]
        latents, video_solver = unipc_step(s.schedule, s.video_solver, s.step_index, velocity, s.latents)
        sound, sound_solver = s.sound, s.sound_solver
        if s.sound is not None:
            assert v_sound is not None, "a request with sound needs its sound velocities"
            v_sound = [v.float() for v in v_sound]
            vs = cfg_combine(v_sound[0], v_sound[1], g) if len(v_sound) == 2 else v_sound[0]
            sound, sound_solver = unipc_step(s.schedule, s.sound_solver, s.step_index, vs, s.sound)
        s.latents, s.video_solver, s.sound, s.sound_solver = latents, video_solver, sound, sound_solver
        s.step_index += 1

    def free_cached_memory(self) -> None:
        """Give the device's cached free blocks back (engine/batch.py, before a failed batch's members step
        alone: out of memory at the batch's size, each alone may fit)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def decode(self, state: VideoRequestState, *, stream: bool = False) -> VideoResult:
        """The finished latents -> host frames + audio (runner/video_decode.py); `stream`: the frames as a
        FrameStream decoding as it is read (on this thread, under the caller's model lock, before `release`)."""
        return decode_video(self.vae, self.audio_vae, state, stream=stream, server_lora=self.loras.static)

    def release(self, state: VideoRequestState) -> None:
        state.und_caches = []
        state.lora = None
        state.latents = state.latents.new_empty(0)
        state.sound = None

    def close(self) -> None:
        """Nothing to stop in one process (ParallelPipeline stops its peers)."""

    # ------------------------------------------------------------------ one-shot
    def generate(
        self: SteppedBackend,
        params: VideoParams,
        request_id: str = "generate",
        on_step: Callable[[int, int], None] | None = None,
        *,
        stream: bool = False,
    ) -> tuple[VideoResult, VideoRequestState]:
        """Validate, prepare, run every step, decode (`stream`: as `decode`'s; read the frames before the
        next call). `on_step(done, total)` after each step. `params.upsample_prompt` is refused: the Reasoner
        writes the prompt in the server's engine (or `worldserve generate --upsample-prompt`), before a
        request reaches a pipeline; here it had been ignored in silence."""
        if params.upsample_prompt:
            raise ParamError("upsample_prompt", "VideoPipeline.generate does not upsample prompts (the server's "
                             "engine and `worldserve generate --upsample-prompt` do, with the Reasoner): "
                             "give the written prompt with upsample_prompt=False")  # fmt: skip
        self.validate(params)
        state = self.prepare(request_id, params)
        while not state.done:
            self.denoise([state])
            if on_step is not None:
                on_step(state.step_index, state.num_steps)
        result = self.decode(state, stream=stream)
        return result, state


def load_pipeline(
    path: str | Path | None = None,
    *,
    cfg_parallel_size: int = 1,
    ulysses_degree: int = 1,
    tensor_parallel_size: int = 1,
    **kwargs: Any,
) -> VideoPipeline | ParallelPipeline:
    """`VideoPipeline.from_pretrained(path, **kwargs)` on one device (`path`, and a `revision` among `kwargs`,
    resolved as there: None is the embedded tiny checkpoint, a repo id the HF cache); with
    `cfg_parallel_size == 2`, `ulysses_degree > 1` or `tensor_parallel_size > 1` a ParallelPipeline over the
    product of them in ranks (runner/parallel_layout.py). Callers `close()` it (or use it as a context
    manager)."""
    from worldserve.runner.parallel_layout import ParallelLayout

    layout = ParallelLayout(cfg=cfg_parallel_size, ulysses=ulysses_degree, tp=tensor_parallel_size)
    if layout.world == 1:
        check_device(kwargs.get("device"))  # (a parallel layout names the GPUs it needs itself)
        return VideoPipeline.from_pretrained(path, **kwargs)
    from worldserve.runner.parallel_pipeline import ParallelPipeline

    return ParallelPipeline.from_pretrained(path, layout, **kwargs)
