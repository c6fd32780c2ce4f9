"""Engine and server configuration: small frozen dataclasses, one per concern, and the CLI generated from them.

`EngineConfig` = `ModelConfig` + `ParallelConfig` + `SchedulerConfig` + `ServerConfig`. Each field's one-line
attribute docstring is its `--help` text, its name is its flag (`max_batch_size` -> `--max-batch-size`) and
its default is the flag's default: one source of truth (config_flags.py).
Constructors validate and do no I/O; `EngineConfig.resolve()` fills the values that depend on the
environment (storage folder, sync timeout, API key, served name) and returns a new object.
Per-request knobs (steps, size, seed...) live in `params.VideoParams`, never here.
"""

from __future__ import annotations

import argparse
import math
import re
import typing
from dataclasses import dataclass, field, replace

from worldserve import envs
from worldserve.config_flags import config_from_args
from worldserve.config_values import (  # noqa: F401  (FlagValueError, json_flag: re-exported)
    FlagValueError,
    JsonObject,
    JsonStrList,
    MediaLimits,
    SamplingDefaults,
    TokenCount,
    check_seconds,
    json_flag,
)

TINY_SERVED_NAME = "worldserve/tiny-cosmos3"


MIN_UPLOAD_MB = 0.01
"""The smallest --max-upload-mb (10 KiB): below it even a short chat body is refused."""


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
    """Device to run on (cuda, cuda:1, cpu); default: cuda when available, else cpu."""
    dtype: str | None = field(
        default=None, metadata={"choices": ("auto", "bfloat16", "float16", "half", "float32", "float")}
    )
    """Weight and activation dtype (half: float16, float: float32, as vLLM); default (or auto): bfloat16 on GPU, float32 on CPU."""
    quantization: str | None = field(default=None, metadata={"choices": ("fp8",)})
    """fp8: gen-tower GEMMs in e4m3 with row-wise scales (H100/H200/B200 only; lossy, halves those weights); default: none."""
    fp8_attention: bool = False
    """Run the gen tower's attention in e4m3 through FlashAttention-3 (H100/H200 with `worldserve[hopper]`; lossy, about 1.2x a step)."""
    diffusion_attention_backend: str | None = field(
        default=None, metadata={"choices": ("FLASH_ATTN", "TORCH_SDPA", "CUDNN_ATTN", "auto")}
    )
    """Attention kernel: FLASH_ATTN (FlashAttention-3, from `pip install 'worldserve[hopper]'`), TORCH_SDPA / CUDNN_ATTN (PyTorch SDPA, cuDNN first); default: env DIFFUSION_ATTENTION_BACKEND, else FA3 where it runs (the gen tower FA4's cluster kernel where that runs too: FLASH_ATTN keeps FA3), else SDPA."""
    enforce_eager: bool = False
    """Run the transformer eagerly; by default the gen layers are torch.compile'd on GPU (first request per shape compiles, about 15 s)."""
    vae_tiling: bool = field(default=False, metadata={"aliases": ("--vae-use-tiling",)})
    """Decode the video in spatial tiles (less memory, a little slower)."""
    init_timeout: float = 600.0
    """Seconds allowed for loading the model before startup fails (the recipe uses 1800)."""
    warmup_shapes: str = "auto"
    """Output shapes generated once at startup (WIDTHxHEIGHTxFRAMES, comma separated; one denoising step each, CFG and audio as the defaults), so that the first request of each shape does not pay torch.compile and kernel selection; auto: the default shape (1280x720x189, or --default-sampling-params's) on GPU, none on CPU; none: skip."""
    auto_warmup_shape: str = field(default="1280x720x189", metadata={"no_flag": True})
    """What --warmup-shapes auto warms: the default shape of video requests (EngineConfig sets it from
    --default-sampling-params)."""
    max_model_len: TokenCount = 32768
    """Context length of Reasoner chat completions (prompt + completion tokens; vLLM's 32k = 32000, 32K = 32768; auto or -1: 32768)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes of the Reasoner's paged K/V cache, shared by all chats (at least --max-model-len tokens; 144 KiB a token on Cosmos3-Nano); default: room for 2 x --max-model-len tokens (1 x under --enable-layerwise-offload)."""
    enable_prefix_caching: bool = True
    """Reuse the K/V of prompt prefixes seen before (vLLM's automatic prefix caching, on by default as there): a chat whose first 64-token blocks match an earlier chat's (same tokens, images and videos) prefills only the rest; --no-enable-prefix-caching turns it off."""
    mm_processor_cache_gb: float = 4.0
    """GiB of host memory for recently processed chat images and videos, by content (vLLM's flag and default): the same image or video again (a conversation's next turn) is not decoded, resized or hashed again; 0 turns it off."""
    chat_sm_margin: int = 16
    """SMs a video step's FlashAttention-3 kernels leave free while Reasoner chats are live, so that they keep decoding beside it on one CUDA GPU (runner/chat_share.py; 8 chats beside a 720p step on an H200: 0 gives ~4 tokens/s a chat at full video speed, 16 ~26 tokens/s with the video step 1.10x as long, 32 ~57 tokens/s at 1.24x)."""
    generation_config: str = "auto"
    """Where Reasoner requests' omitted sampling fields (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens) get their values (vLLM's flag): auto, the model folder's generation_config.json when it has one; vllm, vLLM's neutral defaults (1.0, 1.0, off, 0, 1.0, up to the context); or a folder holding a generation_config.json (its max_new_tokens then bounds every request)."""
    override_generation_config: JsonObject | None = None
    """Generation config values laid over --generation-config's, a JSON object such as '{"temperature": 0.5}' (vLLM's flag; a max_new_tokens here bounds every request's completion)."""
    chat_template: str | None = field(default=None, metadata={"metavar": "PATH|TEMPLATE"})
    """The Reasoner's chat template instead of the checkpoint's (vLLM's flag): a file, or the Jinja template itself in one line (a text with {, } or a newline; backslash escapes such as \\n decoded); checked before the model loads. For images and videos it must write Qwen3-VL's vision placeholders as the checkpoint's does."""
    chat_template_text: str | None = field(default=None, repr=False, metadata={"no_flag": True})
    """--chat-template's template, read from its file or its text (set by __post_init__, from the flag's value)."""
    omni: bool = False
    """Accepted for `vllm serve ... --omni` compatibility; worldserve always serves the video API, so it changes nothing."""
    no_guardrails: bool = False
    """Accepted for vLLM-Omni compatibility: worldserve loads no guardrail models, so it changes nothing."""
    backend: str = field(default="auto", metadata={"hidden": True, "choices": ("auto", "fake")})
    """Tests only: `fake` serves deterministic colour frames from a numpy backend instead of the model."""
    fake_step_delay: float = field(default=0.0, metadata={"hidden": True})
    """Tests only: seconds the fake backend sleeps per denoising step."""

    def kernel_options(self, *, enable_layerwise_offload: bool = False):
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
        # vLLM's spellings: auto is the device's default dtype
        object.__setattr__(
            self, "dtype", {"auto": None, "half": "float16", "float": "float32"}.get(self.dtype, self.dtype)
        )
        check_seconds("--init-timeout", self.init_timeout, zero=False)
        if self.chat_template is not None:  # (a replace() reads the flag's file or text again: the same)
            from worldserve.runner.chat_template import load_chat_template

            object.__setattr__(self, "chat_template_text", load_chat_template(self.chat_template))
        if not self.generation_config:  # (`--generation-config "$DIR"` with DIR unset)
            raise ValueError("--generation-config: empty; give auto, vllm or a folder holding a "
                             "generation_config.json")  # fmt: skip
        if self.revision is not None and self.model is None:
            raise ValueError("--revision needs a MODEL (the embedded tiny checkpoint has no revisions)")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.fake_step_delay < 0:
            raise ValueError("--fake-step-delay must be >= 0")
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if not 0 <= self.chat_sm_margin <= 64:
            raise ValueError(f"--chat-sm-margin must be between 0 and 64 SMs, got {self.chat_sm_margin}")
        if not (math.isfinite(self.mm_processor_cache_gb) and self.mm_processor_cache_gb >= 0):
            raise ValueError(
                f"--mm-processor-cache-gb must be a number >= 0, got {self.mm_processor_cache_gb}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"--kv-cache-memory-bytes must be > 0, got {self.kv_cache_memory_bytes}")
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
    enable_cpu_offload: bool = False
    """vLLM-Omni's whole-model CPU offload: refused, as Cosmos3 refuses it there (use --enable-layerwise-offload)."""
    enable_layerwise_offload: bool = False
    """Keep the transformer's 72 blocks (und + gen, 25.9 GiB on Nano) in pinned host memory and stream each to the GPU just before it runs, overlapped with compute: 24 GiB less GPU memory, same 720p/480p step time on an H200; a Reasoner decode step streams the 36 und blocks (~0.25 s a token)."""

    def __post_init__(self) -> None:
        from worldserve.runner.parallel_layout import ParallelLayout

        for name in ("tensor_parallel_size", "ulysses_degree", "cfg_parallel_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.cfg_parallel_size > 2:
            raise ValueError(
                f"--cfg-parallel-size {self.cfg_parallel_size} is not supported: use 1 or 2 (the two CFG branches)"
            )
        ParallelLayout(cfg=self.cfg_parallel_size, ulysses=self.ulysses_degree, tp=self.tensor_parallel_size)
        if self.enable_cpu_offload:
            raise ValueError(
                "--enable-cpu-offload: CPU offloading of the whole Cosmos3 pipeline is not supported. "
                "Use --enable-layerwise-offload instead."
            )


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
    """Requests denoised together in one step (and held in memory at once); same-shape requests only."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Reasoner chats decoded together (continuous batching); more wait for a free slot."""
    max_num_batched_tokens: int = 8192
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
class ServerConfig:
    host: str = "0.0.0.0"
    """Address to bind."""
    port: int = 8000
    """Port to bind."""
    api_key: tuple[str, ...] | None = field(default=None, metadata={"nargs": "+"})
    """Require `Authorization: Bearer KEY` on /v1/*, KEY one of these (vLLM's flag: several keys may be given); default: $WORLDSERVE_API_KEY or $VLLM_API_KEY, else open."""
    storage_dir: str | None = None
    """Folder of the job database and the videos; default: $WORLDSERVE_STORAGE_DIR, else $VLLM_OMNI_SERVER_STORAGE__PATH (or the deprecated $VLLM_OMNI_STORAGE_PATH), else worldserve/storage under $XDG_CACHE_HOME or ~/.cache."""
    sync_timeout: float | None = None
    """Seconds /v1/videos/sync waits before 504 (the job goes on); default: $VLLM_OMNI_VIDEO_SYNC_TIMEOUT or 600."""
    max_upload_mb: float = 100.0
    """Largest request body accepted (every route that reads one: videos, images, chat, completions, tokenize; one
    request's media downloads share it too), in MiB (413 above)."""
    job_ttl: float | None = None
    """Delete finished jobs and their files this many seconds after completion; default: $VLLM_OMNI_SERVER_STORAGE__FILE_TTL, else keep forever."""
    job_sweep_interval: float | None = field(default=None, metadata={"no_flag": True})
    """Seconds between two expiry sweeps (resolve: $VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL; None: half the
    TTL, at most a minute)."""
    allowed_local_media_path: str | None = None
    """Folder whose files chat requests may reference as file:// image URLs; default: no local files."""
    limit_mm_per_prompt: MediaLimits | None = None
    """The most images / videos one chat request may carry, a JSON object such as '{"image": 4, "video": 1}' (vLLM's flag); default: no count limit (the request body and --max-model-len bound them)."""
    max_video_decode_gpixels: float = DEFAULT_VIDEO_DECODE_GPIXELS
    """The decode work one request's videos (chat videos, a video-to-video reference) may take, in G pixels: each decoded frame counts its pixels, each sampled or kept frame 11 times (converted and resized at full size); past it, a 400 naming the video part or reference, before decoding where the container tells its frames (the default: over 5 minutes of 1080p at 2 fps; ~1 s of CPU a G)."""
    allowed_media_domains: tuple[str, ...] | None = field(default=None, metadata={"nargs": "+"})
    """Hosts http(s) media URLs (video references, chat images and videos) may be downloaded from (exact host names, as vLLM; space- or comma-separated); default: any host (as vLLM: set it when clients are untrusted)."""
    uvicorn_log_level: str = field(
        default="info", metadata={"choices": ("critical", "error", "warning", "info", "debug", "trace")}
    )
    """Log level of the HTTP server."""
    allowed_origins: JsonStrList = JsonStrList(["*"])
    """CORS (as vLLM): origins whose browser pages may call the API, a JSON list; ["*"]: any origin."""
    allowed_methods: JsonStrList = JsonStrList(["*"])
    """CORS: HTTP methods allowed in cross-origin requests, a JSON list."""
    allowed_headers: JsonStrList = JsonStrList(["*"])
    """CORS: request headers allowed in cross-origin requests, a JSON list."""
    allow_credentials: bool = False
    """CORS: allow cookies and Authorization headers on cross-origin requests (Access-Control-Allow-Credentials)."""
    flow_shift: float | None = None
    """Flow shift for video and image requests that send none (vLLM-Omni's --flow-shift); default: Cosmos3's per resolution (10 at 720p, 5 at 480p, 3 at 256p; images 3.0)."""
    default_sampling_params: SamplingDefaults | None = None
    """Server defaults for the fields video requests omit, as vLLM-Omni's flag: '{"0": {"num_inference_steps": 20, "width": 832, "height": 480}}' (stage "0"; width, height, num_frames, fps, num_inference_steps, guidance_scale, flow_shift, seed, max_sequence_length, negative_prompt, generate_sound); a request's own values win; default: Cosmos3's (1280x720, 189 frames, 24 fps, 35 steps, guidance 6.0, seed 42)."""
    enable_prompt_tokens_details: bool = False
    """Chat and text completions' usage carries prompt_tokens_details.cached_tokens, the prompt tokens found in the Reasoner's prefix cache (vLLM's flag; the Responses API always reports them)."""
    reasoning_parser: str | None = field(default=None, metadata={"choices": ("qwen3",)})
    """Split an answer that opens with <think> into reasoning_content (the thoughts) and content (the text after </think>), as vLLM's qwen3 parser; an answer without <think> stays all content (default: every answer is content)."""
    media_io_kwargs: JsonObject | None = None
    """Chat media loading defaults a request's own media_io_kwargs lay over, per modality (vLLM's flag): '{"video": {"fps": 1.0}}' or '{"video": {"num_frames": 32}}' ({"video": {"num_frames": -1}}, the recipe's: Qwen3-VL's own 2 fps), '{"image": {"rgba_background_color": [0, 0, 0]}}'."""
    mm_processor_kwargs: JsonObject | None = None
    """Qwen3-VL processor defaults a request's own mm_processor_kwargs lay over, key by key (vLLM's flag): e.g. '{"max_pixels": 1003520}' to cap every image's vision tokens; size, min_pixels, max_pixels, fps, num_frames, images_kwargs, videos_kwargs."""
    seed: int | None = None
    """Seed of the sequence Reasoner requests without a seed (chats, text completions, Responses) take theirs from, in arrival order, so that a restarted server answers the same requests sent in the same order the same way (vLLM's flag); default: random seeds. Videos without a seed keep Cosmos3's 42 (--default-sampling-params sets another)."""
    disable_log_stats: bool = False
    """Do not log the stats line (chat throughputs, running / waiting chats and videos, K/V cache usage, prefix cache hit rate, denoising steps) every $VLLM_LOG_STATS_INTERVAL seconds (10) while there is work (vLLM's flag; /metrics serves the same figures either way)."""
    enable_log_requests: bool = False
    """Log each generating request once accepted (chat, text completion, Responses, video, image, realtime session): its id, prompt and parameters, at INFO on the worldserve.requests logger (vLLM's flag; prompts are users' data: off by default)."""
    max_log_len: int | None = None
    """With --enable-log-requests: the most characters of a prompt logged (vLLM's flag); default: whole prompts."""
    response_role: str = "assistant"
    """The role of chat answers after a generation prompt (vLLM's flag; with add_generation_prompt false an answer takes the last message's role, as vLLM's)."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name their tokens "token_id:<id>" for every chat and text completion that does not say otherwise in its own return_tokens_as_token_ids (vLLM's flag: for tokens that are no valid text)."""
    enable_force_include_usage: bool = False
    """Every streamed chat and text completion carries usage, in each chunk and in a final usage chunk, whatever its stream_options say (vLLM's flag)."""
    responses_store_mb: float = 256.0
    """Memory for stored Responses API responses (`store`, for previous_response_id and GET /v1/responses/{id}), in MiB; the least recently used go first past it; 0: none stored."""
    enable_server_load_tracking: bool = False
    """Count the requests using the model in flight (chat and text completions, video and image generation, realtime video sessions) and report them at GET /load as {"server_load": N} (vLLM's flag; off: always 0)."""
    enable_request_id_headers: bool = True
    """Send X-Request-Id on every response: the request's own X-Request-Id, else a new uuid4 hex (vLLM's flag; on by default here, --no-enable-request-id-headers turns it off; /v1/videos/sync always sends its video_sync-<hex>)."""

    def __post_init__(self) -> None:
        if self.api_key is not None:  # one key (a --config YAML string) or several
            keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)
            if not all(keys):  # (`--api-key "$KEY"` with KEY unset served /v1 open, its log saying "***")
                raise ValueError("--api-key: an empty key protects nothing; give a key, or leave the flag out "
                                 "to serve /v1 without one")  # fmt: skip
            object.__setattr__(self, "api_key", tuple(keys))
        if self.storage_dir == "":  # (`--storage-dir "$DIR"` with DIR unset had fallen back to the default)
            raise ValueError(
                "--storage-dir: an empty path; give a folder, or leave the flag out for the default"
            )
        domains = self.allowed_media_domains
        if domains is not None and not any(h.strip(" .") for v in domains for h in v.split(",")):
            # (no host had meant every host: `--allowed-media-domains "$DOMAINS"` with DOMAINS unset)
            raise ValueError("--allowed-media-domains: no domain given; name the hosts media may come from, or "
                             "leave the flag out to allow every public host")  # fmt: skip
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.sync_timeout is not None:
            check_seconds("--sync-timeout", self.sync_timeout, zero=False)
        if not (math.isfinite(self.max_upload_mb) and self.max_upload_mb >= MIN_UPLOAD_MB):
            raise ValueError(
                f"--max-upload-mb must be a number >= {MIN_UPLOAD_MB} (MiB), got {self.max_upload_mb}"
            )
        if not (math.isfinite(self.max_video_decode_gpixels) and self.max_video_decode_gpixels > 0):
            raise ValueError(
                f"--max-video-decode-gpixels must be a number > 0, got {self.max_video_decode_gpixels}"
            )
        if self.seed is not None:
            from worldserve.params import INT64

            if not -INT64 <= self.seed < INT64:
                raise ValueError(f"--seed must be in [-2**63, 2**63) (int64), got {self.seed}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if not self.response_role.strip():
            raise ValueError("--response-role: an empty role; give one, such as assistant")
        if not (math.isfinite(self.responses_store_mb) and self.responses_store_mb >= 0):
            raise ValueError("--responses-store-mb must be >= 0")
        if self.job_ttl is not None:
            check_seconds("--job-ttl", self.job_ttl, zero=False)
        if self.flow_shift is not None:
            from worldserve.params import FLOW_SHIFT_RANGE, flow_shift_ok

            if not flow_shift_ok(self.flow_shift):
                raise ValueError(f"--flow-shift must be in {FLOW_SHIFT_RANGE}, got {self.flow_shift}")
        if self.default_sampling_params:
            from worldserve.params import ParamError, VideoParams

            defaults = self.default_sampling_params.as_dict()
            # a request's 0 means "not given"; the server's would run the unconditional branch alone
            if defaults.get("guidance_scale") == 0:
                raise ValueError(
                    "--default-sampling-params: guidance_scale 0 would generate without the prompt; use 1 for "
                    "the conditional branch alone (no CFG), or a scale above 1"
                )
            try:  # the values together, as a request's (a 480p default with 400 frames fails here, not per request)
                VideoParams(prompt="x", **defaults).validate()
            except ParamError as exc:
                raise ValueError(f"--default-sampling-params: {exc.message}") from None

    @property
    def video_defaults(self) -> dict[str, typing.Any]:
        """The values of the fields video requests omit: --default-sampling-params's, and --flow-shift's where
        it sets no flow_shift."""
        shift = {} if self.flow_shift is None else {"flow_shift": self.flow_shift}
        return {**shift, **(self.default_sampling_params or SamplingDefaults()).as_dict()}

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        d = self.server.video_defaults  # --warmup-shapes auto warms the shape requests get by default
        shape = f"{d.get('width', 1280)}x{d.get('height', 720)}x{d.get('num_frames', 189)}"
        if shape != self.model.auto_warmup_shape:
            object.__setattr__(self, "model", replace(self.model, auto_warmup_shape=shape))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(
            model=config_from_args(ModelConfig, args),
            parallel=config_from_args(ParallelConfig, args),
            scheduler=config_from_args(SchedulerConfig, args),
            server=config_from_args(ServerConfig, args),
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
            self.server,
            api_key=self.server.api_key or ((key,) if (key := envs.api_key()) else None),
            storage_dir=self.server.storage_dir or str(envs.storage_dir()),
            sync_timeout=self.server.sync_timeout or envs.sync_timeout_s(),
            job_ttl=self.server.job_ttl or envs.storage_file_ttl_s(),
            job_sweep_interval=self.server.job_sweep_interval or envs.storage_sweep_interval_s(),
        )
        return replace(self, model=replace(self.model, served_model_name=served), server=server)


CONFIG_CLASSES = (ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig)
