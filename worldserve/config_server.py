"""The HTTP server's configuration and its video job API's: `ServerConfig` (address or Unix socket, API keys, body size, CORS,
request logging, load tracking, request id headers) and `VideoApiConfig` (job storage, /v1/videos/sync's
wait, job expiry, the server's defaults for the video fields requests omit).

Separate from config.py, which composes every config into `EngineConfig` and holds the model, parallel and
scheduler ones: these two shape what the HTTP side accepts and keeps, not how the model runs. Same rules
(config_flags.py): a field's name is its flag, its attribute docstring the --help text, its default the
flag's; constructors validate and do no I/O; the environment's defaults are filled by `EngineConfig.resolve()`.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field

from worldserve.config_values import JsonStrList, SamplingDefaults, check_seconds

MIN_UPLOAD_MB = 0.01
"""The smallest --max-upload-mb (10 KiB): below it even a short chat body is refused."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "0.0.0.0"
    """Address to bind."""
    port: int = 8000
    """Port to bind."""
    uds: str | None = field(default=None, metadata={"metavar": "PATH"})
    """Serve on this Unix domain socket path instead of --host / --port (vLLM's flag; a stale socket file there is replaced)."""
    api_key: tuple[str, ...] | None = field(default=None, metadata={"nargs": "+"})
    """Require `Authorization: Bearer KEY` on /v1/*, KEY one of these (vLLM's flag: several keys may be given); default: $WORLDSERVE_API_KEY or $VLLM_API_KEY, else open."""
    max_upload_mb: float = 100.0
    """Largest request body accepted (every route that reads one: videos, images, chat, completions, tokenize; one
    request's media downloads share it too), in MiB (413 above)."""
    uvicorn_log_level: str = field(
        default="info", metadata={"choices": ("critical", "error", "warning", "info", "debug", "trace")}
    )
    """Log level of the HTTP server."""
    allowed_origins: JsonStrList = JsonStrList(["*"])
    """CORS (as vLLM): origins whose browser pages may call the API, a JSON list; ["*"]: any origin. A list is enforced: another origin's requests get a 403."""
    allowed_methods: JsonStrList = JsonStrList(["*"])
    """CORS: HTTP methods allowed in cross-origin requests, a JSON list."""
    allowed_headers: JsonStrList = JsonStrList(["*"])
    """CORS: request headers allowed in cross-origin requests, a JSON list."""
    allow_credentials: bool = False
    """CORS: allow cookies and Authorization headers on cross-origin requests (Access-Control-Allow-Credentials)."""
    disable_log_stats: bool = field(default=False, metadata={"store_true": True})  # (vLLM's is so)
    """Do not log the stats line (chat throughputs, running / waiting chats and videos, K/V cache usage, prefix cache hit rate, denoising steps) every $VLLM_LOG_STATS_INTERVAL seconds (10) while there is work (vLLM's flag; /metrics serves the same figures either way)."""
    enable_log_requests: bool = False
    """Log each generating request once accepted (chat, text completion, Responses, video, image, realtime session): its id, prompt and parameters, at INFO on the worldserve.requests logger (vLLM's flag; prompts are users' data: off by default)."""
    max_log_len: int | None = None
    """With --enable-log-requests: the most characters of a prompt logged (vLLM's flag); default: whole prompts."""
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
            for key in keys:  # (HTTP strips a header's trailing blanks: `Bearer <key>` could never match)
                if key != key.rstrip():
                    what = "a key of only blanks" if not key.strip() else f"the key ending in {key[-1]!r}"
                    raise ValueError(f"--api-key: {what} can never match a request's bearer token (HTTP "
                                     "strips the blanks ending a header); give a key without them")  # fmt: skip
            object.__setattr__(self, "api_key", tuple(keys))
        if self.uds == "":  # (`--uds "$SOCK"` with SOCK unset)
            raise ValueError(
                "--uds: an empty path; give a socket path, or leave the flag out for --host / --port"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not (math.isfinite(self.max_upload_mb) and self.max_upload_mb >= MIN_UPLOAD_MB):
            raise ValueError(
                f"--max-upload-mb must be a number >= {MIN_UPLOAD_MB} (MiB), got {self.max_upload_mb}"
            )
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoApiConfig:
    storage_dir: str | None = None
    """Folder of the job database and the videos; default: $WORLDSERVE_STORAGE_DIR, else $VLLM_OMNI_SERVER_STORAGE__PATH (or the deprecated $VLLM_OMNI_STORAGE_PATH), else worldserve/storage under $XDG_CACHE_HOME or ~/.cache."""
    sync_timeout: float | None = None
    """Seconds /v1/videos/sync waits before 504 (the job goes on); default: $VLLM_OMNI_VIDEO_SYNC_TIMEOUT or 600."""
    job_ttl: float | None = None
    """Delete finished jobs and their files this many seconds after completion; default: $VLLM_OMNI_SERVER_STORAGE__FILE_TTL, else keep forever."""
    openai_failed_job_status: bool = False
    """GET /v1/videos/{id} answers a failed job with 200 and its `status: "failed"` and `error`, as OpenAI does (the openai SDK's videos.retrieve / poll / create_and_poll then return it instead of raising); default: the failure's own status code, as vLLM-Omni answers it."""
    job_sweep_interval: float | None = field(default=None, metadata={"no_flag": True})
    """Seconds between two expiry sweeps (resolve: $VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL; None: half the
    TTL, at most a minute)."""
    flow_shift: float | None = None
    """Flow shift for video and image requests that send none (vLLM-Omni's --flow-shift); default: Cosmos3's per resolution (10 at 720p, 5 at 480p, 3 at 256p; images 3.0)."""
    default_sampling_params: SamplingDefaults | None = None
    """Server defaults for the fields video requests omit, as vLLM-Omni's flag: '{"0": {"num_inference_steps": 20, "width": 832, "height": 480}}' (stage "0"; width, height, num_frames, fps, num_inference_steps, guidance_scale, flow_shift, seed, max_sequence_length, negative_prompt, generate_sound); a request's own values win; default: Cosmos3's (1280x720, 189 frames, 24 fps, 35 steps, guidance 6.0, seed 42)."""

    def __post_init__(self) -> None:
        if self.storage_dir == "":  # (`--storage-dir "$DIR"` with DIR unset had fallen back to the default)
            raise ValueError(
                "--storage-dir: an empty path; give a folder, or leave the flag out for the default"
            )
        if self.sync_timeout is not None:
            check_seconds("--sync-timeout", self.sync_timeout, zero=False)
        if self.job_ttl is not None:
            check_seconds("--job-ttl", self.job_ttl, zero=False)
        if self.flow_shift is not None:
            from worldserve.resolution_tiers import FLOW_SHIFT_RANGE, flow_shift_ok

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
