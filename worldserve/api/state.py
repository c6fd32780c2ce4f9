"""What every route shares, hung on `app.state.ws` by `build_app`: the engine client, settings, metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from worldserve.api.chat_options import MediaDefaults
from worldserve.api.errors import APIError
from worldserve.api.lora_field import LoraSettings
from worldserve.api.media_urls import MediaFetcher
from worldserve.api.metrics import Metrics
from worldserve.api.request_log import AbortLogged, RequestLog
from worldserve.api.responses_store import ResponseStore
from worldserve.api.server_load import ServerLoad
from worldserve.chat_params import ChatParams
from worldserve.engine.client import EngineClient, QueueFullError
from worldserve.media.decode_budget import DEFAULT_MAX_PIXELS
from worldserve.sampling.chat_defaults import NEUTRAL, ChatDefaults, RequestSeeds


@dataclass(frozen=True, slots=True, kw_only=True)
class AppState:
    client: EngineClient
    metrics: Metrics
    served_model_name: str
    """The name answers carry (`--served-model-name`'s first)."""
    model_aliases: tuple[str, ...] = ()
    """`--served-model-name`'s other names: requests may send them too."""
    sync_timeout_s: float
    max_upload_bytes: int
    allowed_local_media_path: str | None = None
    """Folder whose files chat requests may reference as file:// URLs (None: no local files)."""
    default_flow_shift: float | None = None
    """`--flow-shift`: the flow shift of image requests that send none (None: Cosmos3's T2I 3.0)."""
    video_defaults: Mapping[str, Any] = field(default_factory=dict)
    """The values of the fields video requests omit (--default-sampling-params, --flow-shift: VideoParams
    field names); absent: Cosmos3's defaults."""
    lora: LoraSettings = LoraSettings()
    """`--enable-lora` and `--lora-path` / `--lora-scale`: the adapter video and image requests run with."""
    media: MediaFetcher | None = None
    """Downloads http(s) media URLs (video references, chat media) within the upload limit."""
    mm_limits: Mapping[str, int] = field(default_factory=dict)
    """`--limit-mm-per-prompt`: the most images / videos one chat request may carry (absent: no limit)."""
    video_decode_pixels: int = DEFAULT_MAX_PIXELS
    """`--max-video-decode-gpixels` in pixels: the decode work a chat request's videos may take."""
    prompt_tokens_details: bool = False
    """`--enable-prompt-tokens-details`: chat and text completions' usage carries prompt_tokens_details."""
    reasoning_parser: str | None = None
    """`--reasoning-parser`: "qwen3" splits <think> answers into reasoning_content (api/reasoning.py)."""
    response_role: str = "assistant"
    """`--response-role`: the role of chat answers after a generation prompt."""
    tokens_as_ids: bool = False
    """`--return-tokens-as-token-ids`: logprobs name tokens "token_id:<id>" unless a request says otherwise."""
    force_include_usage: bool = False
    """`--enable-force-include-usage`: every streamed chat and text completion carries usage (every chunk's
    and a final chunk's)."""
    media_defaults: MediaDefaults = MediaDefaults()
    """`--media-io-kwargs` / `--mm-processor-kwargs`: what chat requests' own media options lay over."""
    request_seeds: RequestSeeds | None = None
    """`--seed`: where Reasoner requests without a seed get theirs; None: random seeds."""
    request_log: RequestLog | None = None
    """`--enable-log-requests`: where accepted requests are logged (api/request_log.py); None: not logged."""
    responses: ResponseStore | None = None
    """Stored Responses API responses (api/responses_store.py); None: `--responses-store-mb 0`, none kept."""
    load: ServerLoad | None = None
    """`--enable-server-load-tracking`'s count (api/server_load.py: async video jobs count until they end);
    None: off."""

    @property
    def max_model_len(self) -> int | None:
        """The Reasoner's context length in tokens; None where no chat is served."""
        worker = self.client.chat_worker
        return worker.backend.max_model_len if worker is not None else None

    @property
    def chat_defaults(self) -> ChatDefaults:
        """What Reasoner requests' omitted sampling fields take (--generation-config: the Reasoner's; vLLM's
        neutral values for a chat backend that sets none)."""
        worker = self.client.chat_worker
        return worker.backend.sampling_defaults if worker is not None else NEUTRAL

    def seeded(self, params: ChatParams) -> ChatParams:
        """`params` with the next seed of --seed's sequence when the request sent none (one a prompt)."""
        if params.seed is None and self.request_seeds is not None:
            return dataclasses.replace(params, seed=self.request_seeds.next())
        return params

    def chat_meter(self, request_id: str):
        """Where a request's chats are counted: the metrics, and with --enable-log-requests its abort logged."""
        if self.request_log is None:
            return self.metrics
        return AbortLogged(self.metrics, self.request_log, request_id)

    def serves(self, model: str | None) -> bool:
        """Whether a request's `model` names this server's model (None or "": not given, as vLLM takes it)."""
        return not model or model == self.served_model_name or model in self.model_aliases

    def refusal(self, exc: Exception, headers: dict[str, str] | None = None) -> APIError:
        """The answer to the engine client refusing new work (QueueFullError: 429 with Retry-After, else the
        ShuttingDownError: 503), counted in the metrics."""
        if isinstance(exc, QueueFullError):
            self.metrics.on_rejected("queue_full")
            return APIError(429, f"Too many queued requests ({self.client.max_queued_requests}); retry later.",
                            headers={**(headers or {}), "Retry-After": str(exc.retry_after_s)})  # fmt: skip
        self.metrics.on_rejected("shutting_down")
        return APIError(503, str(exc), headers=headers)


def app_state(request: Request) -> AppState:
    return request.app.state.ws
