"""`AppSettings`: the server flags the HTTP application reads, one frozen value (`build_app(client, settings)`).

`commands/serve.py` `app_settings(config)` makes it from the parsed flags; tests build one with the few fields
they change (`build_app(client, shutdown_timeout_s=1.0)` replaces those fields of the defaults). The routes
read it as `app_state(request).settings`; what the app builds from it (the media downloader, the Responses
store, the load count) lives beside it in AppState.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from worldserve.api.chat_options import MediaDefaults
from worldserve.api.lora_field import LoraSettings
from worldserve.api.request_log import RequestLog
from worldserve.media.decode_budget import DEFAULT_MAX_PIXELS

DEFAULT_UPLOAD_BYTES = 100 * 2**20
"""`--max-upload-mb`'s default (100), in bytes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AppSettings:
    api_keys: tuple[str, ...] = ()
    """`--api-key`: the bearer keys /v1 routes require (empty: open)."""
    sync_timeout_s: float = 600.0
    """`--sync-timeout`: seconds /v1/videos/sync (and the images route) wait before 504."""
    max_upload_bytes: int = DEFAULT_UPLOAD_BYTES
    """`--max-upload-mb` in bytes: the largest request body (and one request's media downloads together)."""
    shutdown_timeout_s: float = 30.0
    """`--shutdown-timeout`: how long the lifespan's shutdown waits for running work."""
    model_root: str | None = None
    """The model argument, /v1/models' `root` (None: the served name)."""
    model_aliases: tuple[str, ...] = ()
    """`--served-model-name`'s other names: requests may send them too."""
    allowed_local_media_path: str | None = None
    """Folder whose files chat requests may reference as file:// URLs (None: no local files)."""
    allowed_origins: tuple[str, ...] = ("*",)
    """CORS, as vLLM's `--allowed-origins`."""
    allowed_methods: tuple[str, ...] = ("*",)
    """CORS, `--allowed-methods`."""
    allowed_headers: tuple[str, ...] = ("*",)
    """CORS, `--allowed-headers`."""
    allow_credentials: bool = False
    """CORS, `--allow-credentials`."""
    request_id_headers: bool = True
    """`--enable-request-id-headers`: X-Request-Id on every answer."""
    default_flow_shift: float | None = None
    """`--flow-shift`: the flow shift of image requests that send none (None: Cosmos3's T2I 3.0)."""
    video_defaults: Mapping[str, Any] = field(default_factory=dict)
    """The values of the fields video requests omit (VideoApiConfig.video_defaults: --default-sampling-params,
    --flow-shift; VideoParams field names); absent: Cosmos3's defaults."""
    failed_jobs_ok: bool = False
    """`--openai-failed-job-status`: a failed job's GET answers 200, as OpenAI's (else its failure code)."""
    lora: LoraSettings = LoraSettings()
    """`--enable-lora` and `--lora-path` / `--lora-scale`: the adapter video and image requests run with."""
    allowed_media_domains: tuple[str, ...] = ()
    """`--allowed-media-domains`: hosts http(s) media may come from (empty: any public host)."""
    server_load_tracking: bool = False
    """`--enable-server-load-tracking`: /load counts the requests using the model."""
    mm_limits: Mapping[str, int] = field(default_factory=dict)
    """`--limit-mm-per-prompt`: the most images / videos one chat request may carry (absent: no limit)."""
    video_decode_pixels: int = DEFAULT_MAX_PIXELS
    """`--max-video-decode-gpixels` in pixels: the decode work a request's videos may take."""
    reasoning_parser: str | None = None
    """`--reasoning-parser`: "qwen3" splits <think> answers into reasoning_content (api/reasoning.py)."""
    prompt_tokens_details: bool = False
    """`--enable-prompt-tokens-details`: chat and text completions' usage carries prompt_tokens_details."""
    response_role: str = "assistant"
    """`--response-role`: the role of chat answers after a generation prompt."""
    tokens_as_ids: bool = False
    """`--return-tokens-as-token-ids`: logprobs name tokens "token_id:<id>" unless a request says otherwise."""
    force_include_usage: bool = False
    """`--enable-force-include-usage`: every streamed chat and text completion carries usage."""
    request_log: RequestLog | None = None
    """`--enable-log-requests`: where accepted requests are logged (api/request_log.py); None: not logged."""
    stats_interval_s: float | None = None
    """The stats line's period (None: `--disable-log-stats`)."""
    seed: int | None = None
    """`--seed`: the start of the sequence Reasoner requests without a seed take theirs from (each app starts
    its own: AppState.request_seeds); None: random seeds."""
    media_defaults: MediaDefaults = MediaDefaults()
    """`--media-io-kwargs` / `--mm-processor-kwargs`: what chat requests' own media options lay over."""
    template_defaults: Mapping[str, Any] = field(default_factory=dict)
    """`--default-chat-template-kwargs`: what chat requests' own chat_template_kwargs lay over, key by key."""
    responses_store_bytes: int = 256 * 2**20
    """`--responses-store-mb` in bytes: stored Responses API responses (0: none kept)."""
    docs: bool = True
    """False: vLLM's `--disable-fastapi-docs` (no /docs, /redoc or /openapi.json)."""

    def __post_init__(self) -> None:
        for name in ("api_keys", "model_aliases", "allowed_origins", "allowed_methods", "allowed_headers",
                     "allowed_media_domains"):  # fmt: skip
            object.__setattr__(
                self, name, tuple(getattr(self, name))
            )  # (a list given: the flags' JSON lists)
        object.__setattr__(self, "video_defaults", dict(self.video_defaults or {}))
        object.__setattr__(self, "mm_limits", dict(self.mm_limits or {}))
