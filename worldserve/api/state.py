"""What every route shares, hung on `app.state.ws` by `build_app`: the engine client, settings, metrics."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends
from starlette.requests import Request

from worldserve.api.errors import APIError
from worldserve.api.media_urls import MediaFetcher
from worldserve.api.metrics import Metrics
from worldserve.api.request_log import AbortLogged
from worldserve.api.responses_store import ResponseStore
from worldserve.api.server_load import ServerLoad
from worldserve.api.settings import AppSettings
from worldserve.chat_params import ChatParams
from worldserve.engine.client import EngineClient, QueueFullError
from worldserve.sampling.chat_defaults import NEUTRAL, ChatDefaults, RequestSeeds

if TYPE_CHECKING:
    from worldserve.engine.client import ChatMeter


@dataclass(frozen=True, slots=True, kw_only=True)
class AppState:
    client: EngineClient
    metrics: Metrics
    served_model_name: str
    """The name answers carry (`--served-model-name`'s first)."""
    settings: AppSettings = AppSettings()
    """The server flags the routes read (api/settings.py)."""
    media: MediaFetcher | None = None
    """Downloads http(s) media URLs (video references, chat media) within the upload limit."""
    responses: ResponseStore | None = None
    """Stored Responses API responses (api/responses_store.py); None: `--responses-store-mb 0`, none kept."""
    request_seeds: RequestSeeds | None = None
    """`--seed`'s sequence of this app (from `settings.seed`), the seeds of Reasoner requests that send none."""
    load: ServerLoad | None = None
    """`--enable-server-load-tracking`'s count (api/server_load.py: async video jobs count until they end);
    None: off."""

    @classmethod
    def serving(
        cls, client: EngineClient, metrics: Metrics, settings: AppSettings, *,
        responses: ResponseStore | None = None, load: ServerLoad | None = None,
    ) -> AppState:  # fmt: skip
        """The state of an app serving `client` with `settings`: the media fetcher and the request seeds they
        call for (the environment read now: a malformed media timeout stops the start), with `responses` and
        `load`. build_app's and the offline Engine's chat calls' (offline/chat_requests.py)."""
        from worldserve import envs

        return cls(
            client=client, metrics=metrics, served_model_name=client.model_name, settings=settings,
            media=MediaFetcher(settings.max_upload_bytes, settings.allowed_media_domains,
                               envs.media_url_allow_redirects()),
            request_seeds=None if settings.seed is None else RequestSeeds(settings.seed), responses=responses,
            load=load,
        )  # fmt: skip

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

    def chat_meter(self, request_id: str) -> ChatMeter:
        """Where a request's chats are counted: the metrics, and with --enable-log-requests its abort logged."""
        if self.settings.request_log is None:
            return self.metrics
        return AbortLogged(self.metrics, self.settings.request_log, request_id)

    def serves(self, model: str | None) -> bool:
        """Whether a request's `model` names this server's model (None or "": not given, as vLLM takes it)."""
        return not model or model == self.served_model_name or model in self.settings.model_aliases

    @contextlib.contextmanager
    def counting_too_large(self) -> Iterator[None]:
        """A body past --max-upload-mb read in the with-body (its 413 raised through) counts as a too_large
        rejection (the video and image routes)."""
        try:
            yield
        except APIError as exc:
            if exc.status == 413:
                self.metrics.on_rejected("too_large")
            raise

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


State = Annotated[AppState, Depends(app_state)]
"""A route's application state as FastAPI hands it (`st: State`)."""
