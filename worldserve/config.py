"""Engine and server configuration: small frozen dataclasses, one per concern, and the CLI generated from them.

`EngineConfig` = `ModelConfig` + `ReasonerConfig` + `ParallelConfig` + `SchedulerConfig` + `ServerConfig` +
`VideoApiConfig` + `LoraConfig` + `MediaConfig` + `ChatApiConfig` (the Reasoner's two in config_chat.py, the
LoRA flags in config_lora.py, the HTTP server's and the video API's in config_server.py). Each
field's one-line attribute docstring is its `--help` text, its name is its flag (`max_batch_size` ->
`--max-batch-size`) and its default is the flag's default: one source of truth (config_flags.py); each class
is one --help group. Constructors validate and do no I/O (serve checks that --lora-path exists:
`LoraConfig.check_path`); `EngineConfig.resolve()` fills the values that depend on the environment (storage
folder, sync timeout, API key, served name) and returns a new object. Per-request knobs (steps, size,
seed...) live in `params.VideoParams`, never here.
"""

from __future__ import annotations

import argparse
import math
import re
import typing
from dataclasses import dataclass, field, replace

from worldserve import envs
from worldserve.config_chat import ChatApiConfig, ReasonerConfig
from worldserve.config_flags import config_from_args
from worldserve.config_lora import LoraConfig
from worldserve.config_server import ServerConfig, VideoApiConfig
from worldserve.config_values import (  # noqa: F401  (FlagValueError, json_flag: re-exported)
    FlagValueError,
    HumanInt,
    JsonObject,
    MediaLimits,
    check_seconds,
    json_flag,
)

if typing.TYPE_CHECKING:
    from worldserve.runner.kernel_options import KernelOptions

TINY_SERVED_NAME = "worldserve/tiny-cosmos3"


_DTYPE_ALIASES: dict[str, str | None] = {"auto": None, "half": "float16", "float": "float32"}
"""--dtype's vLLM spellings: auto is the device's default dtype (None)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    model: str | None = field(default=None, metadata={"positional": True})
    """Checkpoint folder or Hugging Face repo id (e.g. nvidia/Cosmos3-Nano); omitted: the embedded tiny random checkpoint, whose output is noise."""
    revision: str | None = None
    """Hugging Face revision (branch, tag or commit) of MODEL."""
    served_model_name: str | None = field(default=None, metadata={"nargs": "+"})
    """Name clients must send in `model` and that /v1/models lists; default: MODEL. Several names (vLLM's): requests may send any of them, answers and metrics carry the first."""
    served_model_aliases: tuple[str, ...] = field(default=(), metadata={"no_flag": True})
    """The names after the first of `--served-model-name A B ...` (set from that flag)."""
    device: str | None = None
    """Device to run on (cuda, cuda:1, cpu); default: cuda when available, else cpu (a multi-rank run,
    --cfg-parallel-size / --ulysses-degree / --tensor-parallel-size, takes cuda:0..N-1; its ranks run on the
    CPU only with --device cpu)."""
    dtype: str | None = field(
        default=None, metadata={"choices": ("auto", "bfloat16", "float16", "half", "float32", "float")}
    )
    """Weight and activation dtype (half: float16, float: float32, as vLLM); default (or auto): bfloat16 on GPU, float32 on CPU."""
    quantization: str | None = field(default=None, metadata={"choices": ("fp8",), "aliases": ("-q",)})
    """fp8: gen-tower GEMMs in e4m3 with row-wise scales (H100/H200/B200 only; lossy, halves those weights); default: none."""
    fp8_attention: bool = field(default=False, metadata={"store_true": True})
    """Run the gen tower's attention in e4m3 through FlashAttention-3 (H100/H200 with `worldserve[hopper]`; lossy, about 1.2x a step)."""
    diffusion_attention_backend: str | None = field(
        default=None, metadata={"choices": ("FLASH_ATTN", "TORCH_SDPA", "CUDNN_ATTN", "auto")}
    )
    """Attention kernel: FLASH_ATTN (FlashAttention-3, from `pip install 'worldserve[hopper]'`), TORCH_SDPA / CUDNN_ATTN (PyTorch SDPA: cuDNN first for the gen tower, flash first for prompts and images); default: env DIFFUSION_ATTENTION_BACKEND, else FA3 where it runs (the gen tower FA4's cluster kernel where that runs too: FLASH_ATTN keeps FA3), else SDPA."""
    enforce_eager: bool = False
    """Run the transformer eagerly: by default on GPU the gen layers are torch.compile'd (the first request of a shape compiles, about 15 s) and the Reasoner's prefill and decode steps run as CUDA graphs."""
    vae_tiling: bool = field(default=False, metadata={"aliases": ("--vae-use-tiling",), "store_true": True})
    """Decode the video in spatial tiles (less memory, a little slower)."""
    init_timeout: float = 600.0
    """Seconds allowed for loading the model before startup fails (the recipe uses 1800)."""
    warmup_shapes: str = "auto"
    """Output shapes generated once at startup (WIDTHxHEIGHTxFRAMES, comma separated; one denoising step each, CFG and audio as the defaults), so that the first request of each shape does not pay torch.compile and kernel selection; auto: the default shape (1280x720x189, or --default-sampling-params's) on GPU, none on CPU; none: skip."""
    auto_warmup_shape: str = field(default="1280x720x189", metadata={"no_flag": True})
    """What --warmup-shapes auto warms: the default shape of video requests (EngineConfig sets it from
    --default-sampling-params)."""
    backend: str = field(default="auto", metadata={"hidden": True, "choices": ("auto", "fake")})
    """Tests only: `fake` serves deterministic colour frames from a numpy backend instead of the model."""
    fake_step_delay: float = field(default=0.0, metadata={"hidden": True})
    """Tests only: seconds the fake backend sleeps per denoising step."""

    def kernel_options(self, *, enable_layerwise_offload: bool = False) -> KernelOptions:
        """The runner's KernelOptions for these flags (compile unless --enforce-eager) and ParallelConfig's
        --enable-layerwise-offload."""
        from worldserve.runner.kernel_options import KernelOptions

        return KernelOptions.from_flags(
            enforce_eager=self.enforce_eager, quantization=self.quantization,
            diffusion_attention_backend=self.diffusion_attention_backend, fp8_attention=self.fp8_attention,
            enable_layerwise_offload=enable_layerwise_offload,
        )  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, list):  # --served-model-name A B: A, and B an alias
            names = list(dict.fromkeys(self.served_model_name))
            if not all(names):  # ('' was listed in the log, while the default name was served)
                raise ValueError("--served-model-name: a name must not be empty")
            object.__setattr__(self, "served_model_name", names[0])
            object.__setattr__(self, "served_model_aliases", tuple(names[1:]))
        if self.dtype is not None:  # vLLM's spellings: auto is the device's default dtype
            object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        check_seconds("--init-timeout", self.init_timeout, zero=False)
        if self.revision is not None and self.model is None:
            raise ValueError("--revision needs a MODEL (the embedded tiny checkpoint has no revisions)")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.fake_step_delay < 0:
            raise ValueError("--fake-step-delay must be >= 0")
        self.warmup_shape_list(on_gpu=True)  # raises on a malformed or unsupported shape

    def warmup_shape_list(self, *, on_gpu: bool) -> list[tuple[int, int, int]]:
        """--warmup-shapes as (width, height, num_frames) triples, "auto" resolved for this device kind."""
        spec = self.warmup_shapes.strip().lower()
        if spec == "none" or (spec == "auto" and not on_gpu):
            return []
        if spec == "auto":
            spec = self.auto_warmup_shape
        from worldserve.params import ParamError, VideoParams

        shapes = []
        for item in spec.split(","):
            try:
                w, h, f = (int(x) for x in item.strip().split("x"))
                VideoParams(prompt="warm-up", width=w, height=h, num_frames=f).validate()
            except ValueError as e:  # a ParamError too
                detail = f": {e}" if isinstance(e, ParamError) else ""
                raise ValueError(
                    f"--warmup-shapes {item.strip()!r} is not a valid WIDTHxHEIGHTxFRAMES{detail}"
                ) from None
            shapes.append((w, h, f))
        return shapes


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",)})
    """Tensor parallelism: every weight matrix split over this many GPUs (cuda:0..N-1; 1, 2, 4, 8; alone only). The Reasoner chat API is off with it."""
    ulysses_degree: int = field(default=1, metadata={"aliases": ("--usp",)})
    """Ulysses sequence parallelism: split every denoising forward over this many GPUs (cuda:0..N-1; must divide the 32 query / 8 KV heads: 1, 2, 4, 8)."""
    cfg_parallel_size: int = 1
    """Run the CFG branches on separate GPUs: 1, or 2 (cond on the first half of the GPUs, uncond on the second; a full model on each GPU; combines with --ulysses-degree, using cfg x ulysses GPUs)."""
    enable_layerwise_offload: bool = field(default=False, metadata={"store_true": True})  # (vLLM-Omni's)
    """Keep the transformer's 72 blocks (und + gen, 25.9 GiB on Nano) in pinned host memory and stream each to the GPU just before it runs, overlapped with compute: 24 GiB less GPU memory, same 720p/480p step time on an H200; a Reasoner decode step streams the 36 und blocks (~0.25 s a token)."""

    def __post_init__(self) -> None:
        from worldserve.runner.parallel_layout import ParallelLayout

        ParallelLayout(cfg=self.cfg_parallel_size, ulysses=self.ulysses_degree, tp=self.tensor_parallel_size)


DEFAULT_MAX_NUM_SEQS = 128
"""Reasoner chats decoded together by default. At full size on an H200 (`bench/serve_chat.py`, 128 streamed
chats at once): 4,369-5,425 tok/s at 10.5-10.9 ms a token, where 32 (the earlier default) served them in four
waves at the 32-chat rate, 2,949 tok/s (4.5 ms a token). vLLM's API server takes 256."""

DEFAULT_VIDEO_DECODE_GPIXELS = 48.0
"""The decode work a request's videos (chat videos, a video reference) may take by default, in G pixels (media/decode_budget.py: each
decoded frame its pixels, each sampled frame 11 times): 8.5 minutes of 1080p at 30 fps or 4.8 at 60 fps,
sampled at Qwen3-VL's default 2 fps (5 minutes of 1080p30 take 31 G); about a minute of one core at most."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    max_queued_requests: int = 256
    """Jobs waiting for admission beyond this answer 429 with Retry-After."""
    max_batch_size: int = 1
    """Requests denoised together in one step (and held in memory at once); same-shape requests only. A seed gives the same video alone or batched up to float rounding (a batch's GEMMs sum in another order), as diffusers' and vLLM's batches do; 1 keeps every seeded request bit-identical to its run alone."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Reasoner chats decoded together (continuous batching); more wait for a free slot."""
    max_num_batched_tokens: HumanInt = HumanInt(8192)
    """Reasoner tokens one iteration (an admission pass and a step) computes at most (vLLM's): the running chats' decodes, the next chunk of a prompt being prefilled, resumed chats and new prompts share it; with chunked prefill a prompt longer than what is left is prefilled in chunks, one an iteration, while running chats keep decoding."""
    enable_chunked_prefill: bool = True
    """Prefill Reasoner prompts that do not fit what an iteration's --max-num-batched-tokens leaves in chunks, one an iteration, interleaved with the running chats' decode steps (vLLM's default); --no-enable-chunked-prefill prefills every prompt whole."""
    encode_workers: int = 2
    """Threads that encode finished videos to MP4 while the next request denoises."""
    shutdown_timeout: float = 30.0
    """On SIGTERM, seconds to let running requests finish; the rest stay queued and resume at restart."""

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= --max-num-seqs "
                f"({self.max_num_seqs}): a step decodes a token for each running chat"
            )
        if self.encode_workers < 1:
            raise ValueError("--encode-workers must be >= 1")
        check_seconds("--shutdown-timeout", self.shutdown_timeout, zero=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaConfig:
    allowed_local_media_path: str | None = None
    """Folder whose files chat requests (and /tokenize's chat form) may reference as file:// image or video URLs; default: no local files."""
    limit_mm_per_prompt: MediaLimits | None = None
    """The most images / videos one chat request may carry, a JSON object such as '{"image": 4, "video": 1}' (vLLM's flag); default: no count limit (the request body and --max-model-len bound them)."""
    max_video_decode_gpixels: float = DEFAULT_VIDEO_DECODE_GPIXELS
    """The decode work one request's videos (chat videos, a video-to-video reference) may take, in G pixels: each decoded frame counts its pixels, each sampled or kept frame 11 times (converted and resized at full size); past it, a 400 naming the video part or reference, before decoding where the container tells its frames (the default: over 5 minutes of 1080p at 2 fps; ~1 s of CPU a G)."""
    allowed_media_domains: tuple[str, ...] | None = field(default=None, metadata={"nargs": "+"})
    """Hosts http(s) media URLs (video references, chat images and videos) may be downloaded from (exact host names, as vLLM; space- or comma-separated); default: any host (as vLLM: set it when clients are untrusted)."""
    media_io_kwargs: JsonObject | None = None
    """Chat media loading defaults a request's own media_io_kwargs lay over, per modality (vLLM's flag): '{"video": {"fps": 1.0}}' or '{"video": {"num_frames": 32}}' ({"video": {"num_frames": -1}}, the recipe's: Qwen3-VL's own 2 fps), '{"image": {"rgba_background_color": [0, 0, 0]}}'."""
    mm_processor_kwargs: JsonObject | None = None
    """Qwen3-VL processor defaults a request's own mm_processor_kwargs lay over, key by key (vLLM's flag): e.g. '{"max_pixels": 1003520}' to cap every image's vision tokens; size, min_pixels, max_pixels, fps, num_frames, images_kwargs, videos_kwargs."""

    def __post_init__(self) -> None:
        domains = self.allowed_media_domains
        if domains is not None and not any(h.strip(" .") for v in domains for h in v.split(",")):
            # (no host had meant every host: `--allowed-media-domains "$DOMAINS"` with DOMAINS unset)
            raise ValueError("--allowed-media-domains: no domain given; name the hosts media may come from, or "
                             "leave the flag out to allow every public host")  # fmt: skip
        if not (math.isfinite(self.max_video_decode_gpixels) and self.max_video_decode_gpixels > 0):
            raise ValueError(
                f"--max-video-decode-gpixels must be a number > 0, got {self.max_video_decode_gpixels}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    reasoner: ReasonerConfig = field(default_factory=ReasonerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    video: VideoApiConfig = field(default_factory=VideoApiConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    chat: ChatApiConfig = field(default_factory=ChatApiConfig)

    def __post_init__(self) -> None:
        d = self.video.video_defaults  # --warmup-shapes auto warms the shape requests get by default
        shape = f"{d.get('width', 1280)}x{d.get('height', 720)}x{d.get('num_frames', 189)}"
        if shape != self.model.auto_warmup_shape:
            object.__setattr__(self, "model", replace(self.model, auto_warmup_shape=shape))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(
            model=config_from_args(ModelConfig, args),
            reasoner=config_from_args(ReasonerConfig, args),
            parallel=config_from_args(ParallelConfig, args),
            scheduler=config_from_args(SchedulerConfig, args),
            server=config_from_args(ServerConfig, args),
            video=config_from_args(VideoApiConfig, args),
            lora=config_from_args(LoraConfig, args),
            media=config_from_args(MediaConfig, args),
            chat=config_from_args(ChatApiConfig, args),
        )

    def resolve(self) -> EngineConfig:
        """Fill environment-dependent defaults; the result has no None left in those fields."""
        served = self.model.served_model_name or self.model.model or TINY_SERVED_NAME
        # a malformed media fetch timeout stops the start now, not after the load
        for kind in ("image", "video"):
            envs.media_fetch_timeout_s(kind)
        envs.http_timeout_keep_alive_s()
        envs.http_header_timeout_s()
        envs.log_stats_interval_s()
        envs.max_completion_prompts()
        server = replace(
            self.server, api_key=self.server.api_key or ((key,) if (key := envs.api_key()) else None)
        )
        video = replace(
            self.video,
            storage_dir=self.video.storage_dir or str(envs.storage_dir()),
            sync_timeout=self.video.sync_timeout or envs.sync_timeout_s(),
            job_ttl=self.video.job_ttl or envs.storage_file_ttl_s(),
            job_sweep_interval=self.video.job_sweep_interval or envs.storage_sweep_interval_s(),
        )
        return replace(self, model=replace(self.model, served_model_name=served), server=server, video=video)


CONFIG_CLASSES = (
    ModelConfig, ReasonerConfig, ParallelConfig, SchedulerConfig, ServerConfig, VideoApiConfig, LoraConfig,
    MediaConfig, ChatApiConfig,
)  # fmt: skip
"""The config classes in --help order (one group each); serve's flags and its `non-default args` line."""
