"""build_app(client, settings) -> the FastAPI application (settings: the server flags, api/settings.py): video routes (and the /v1/realtime/video WebSocket),
/v1/images/generations, /v1/chat/completions, /v1/completions, /v1/responses, /tokenize and /detokenize
(a 400 without a chat backend), /invocations (SageMaker's: a chat or text completion by its body), /v1/models,
/health, /ping, /load, /version, /metrics.

The app only talks to an `EngineClient` (never to torch). Its lifespan starts the client (job recovery,
engine thread) and shuts it down; `httpx.ASGITransport` does not run lifespans, so tests enter
`app.router.lifespan_context(app)` themselves (or run a real uvicorn). Middlewares, outermost first, in
vLLM's order: request ids (`--enable-request-id-headers`, on by default here), the server load count
(`/load`, --enable-server-load-tracking), the /v1 API key, the HTTP metrics (inside the key check: a 401
is not counted, as in vLLM), then CORS (`--allowed-origins` ...: preflight OPTIONS answered,
Access-Control-* headers added; as in vLLM, a 401 from the key check carries none). Exception handlers turn
every error into the vLLM envelope (errors.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.routing import Mount
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocketClose

from worldserve import __version__
from worldserve.api.auth import APIKeyMiddleware, RequestIdMiddleware
from worldserve.api.chat import model_not_found
from worldserve.api.chat import router as chat_router
from worldserve.api.completions import router as completions_router
from worldserve.api.errors import install_error_handlers
from worldserve.api.http_metrics import HTTPMetricsMiddleware
from worldserve.api.images import router as images_router
from worldserve.api.invocations import router as invocations_router
from worldserve.api.metrics import Metrics
from worldserve.api.metrics_exposition import exposition_app
from worldserve.api.origins import OriginGuardMiddleware
from worldserve.api.protocol import ModelCard, ModelList, ModelPermission
from worldserve.api.realtime import router as realtime_router
from worldserve.api.responses import router as responses_router
from worldserve.api.responses_items import router as responses_items_router
from worldserve.api.responses_store import ResponseStore
from worldserve.api.server_load import ServerLoad, ServerLoadMiddleware
from worldserve.api.settings import AppSettings
from worldserve.api.state import AppState
from worldserve.api.stats_log import StatsLog
from worldserve.api.tokenize import router as tokenize_router
from worldserve.api.videos import router as videos_router
from worldserve.engine.client import EngineClient


def build_app(
    client: EngineClient,
    settings: AppSettings | None = None,
    *,
    metrics: Metrics | None = None,
    **changes: Any,
) -> FastAPI:
    """The application over `client` with the server flags `settings` (api/settings.py; default: a bare
    server's), `changes` replacing some of their fields (`build_app(client, shutdown_timeout_s=1.0)`)."""
    settings = dataclasses.replace(settings or AppSettings(), **changes)
    metrics = metrics or Metrics(client.model_name)
    load = ServerLoad()
    metrics.watch(client)
    docs: dict[str, Any] = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="worldserve",
        version=__version__,
        description="vLLM-Omni / OpenAI-Videos-compatible video generation for Cosmos3 models.",
        lifespan=_lifespan(client, metrics, settings),
        **docs,
    )
    app.state.ws = AppState.serving(
        client, metrics, settings,
        responses=ResponseStore(settings.responses_store_bytes) if settings.responses_store_bytes > 0 else None,
        load=load if settings.server_load_tracking else None,
    )  # fmt: skip
    install_error_handlers(app)
    _add_middlewares(app, settings, metrics, load)
    _include_routers(app)
    _add_model_routes(app, client, settings)
    _add_server_routes(app, client, load)
    app.routes.append(metrics_mount(metrics))
    return app


def _lifespan(
    client: EngineClient, metrics: Metrics, settings: AppSettings
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the client started (and the periodic stats log, unless --disable-log-stats) before
    the first request; on exit the stats log stopped and the client shut down (waiting at most
    --shutdown-timeout for running work)."""
    shutdown_timeout_s, stats_interval_s = settings.shutdown_timeout_s, settings.stats_interval_s

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        stats = None
        if stats_interval_s is not None:
            stats = asyncio.create_task(
                StatsLog(metrics.registry, stats_interval_s).run(), name="worldserve-stats"
            )
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            await client.shutdown(shutdown_timeout_s)

    return lifespan


def _add_middlewares(app: FastAPI, settings: AppSettings, metrics: Metrics, load: ServerLoad) -> None:
    """The middlewares in vLLM's order (the module docstring lists them, outermost first)."""
    # each add_middleware wraps the ones before it: CORS innermost, request ids outermost (vLLM's order)
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_credentials=settings.allow_credentials, allow_methods=list(settings.allowed_methods),
                       allow_headers=list(settings.allowed_headers))  # fmt: skip
    # inside auth: 401s not counted (vLLM's)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics.http)
    # (--allowed-origins kept)
    app.add_middleware(OriginGuardMiddleware, allowed_origins=settings.allowed_origins)
    app.add_middleware(APIKeyMiddleware, api_keys=settings.api_keys)
    if settings.server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=load)
    if settings.request_id_headers:
        app.add_middleware(RequestIdMiddleware)


def _include_routers(app: FastAPI) -> None:
    """The API's routes, each module's router (in the order the route log and OpenAPI list them)."""
    app.include_router(videos_router)
    app.include_router(realtime_router)
    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(responses_router)
    app.include_router(responses_items_router)
    app.include_router(tokenize_router)
    app.include_router(images_router)
    app.include_router(invocations_router)


def _add_model_routes(app: FastAPI, client: EngineClient, settings: AppSettings) -> None:
    """GET /v1/models (a card per served name, created when the app is built) and GET /v1/models/{model}."""
    created = int(time.time())

    @app.get("/v1/models", response_model=ModelList, tags=["models"])
    async def list_models() -> ModelList:
        name = client.model_name
        permission = ModelPermission(id=f"modelperm-{uuid.uuid4().hex}", created=created)  # (as vLLM: random)
        # vLLM's card carries the context length; None where no chat is served (vLLM-Omni's diffusion cards)
        max_len = app.state.ws.max_model_len
        # one card per --served-model-name, as vLLM lists them
        return ModelList(data=[ModelCard(id=n, created=created, root=settings.model_root or name, max_model_len=max_len,
                                         permission=[permission]) for n in (name, *settings.model_aliases)])  # fmt: skip

    @app.get("/v1/models/{model:path}", response_model=ModelCard, tags=["models"])
    async def retrieve_model(model: str) -> ModelCard | JSONResponse:
        """OpenAI's GET /v1/models/{model} (the SDK's models.retrieve; vLLM serves only the list): the card of
        a served name, else vLLM's unknown-model 404 naming `model`."""
        cards = (await list_models()).data
        return next((card for card in cards if card.id == model), None) or model_not_found(model)


def _add_server_routes(app: FastAPI, client: EngineClient, load: ServerLoad) -> None:
    """The server's probes: /health, /ping (GET and POST), /load and /version."""

    @app.get("/health", tags=["server"])
    async def health() -> JSONResponse:
        ok, reason = client.health()
        if ok:
            return JSONResponse({"status": "healthy"})
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    async def ping() -> Response:
        """vLLM's /ping (SageMaker-style probes): an empty 200 while healthy, else /health's 503."""
        ok, _ = client.health()
        return Response(status_code=200) if ok else await health()

    app.add_api_route("/ping", ping, methods=["GET"], tags=["server"], operation_id="ping_get")
    app.add_api_route("/ping", ping, methods=["POST"], tags=["server"], operation_id="ping_post")

    @app.get("/load", tags=["server"])
    async def server_load() -> dict[str, int]:
        """vLLM's /load: requests using the model in flight, and async video jobs not ended (0 unless
        --enable-server-load-tracking; api/server_load.py)."""
        return {"server_load": load.value}

    @app.get("/version", tags=["server"])
    async def version() -> dict[str, str]:
        return {"version": __version__}


def metrics_mount(metrics: Metrics) -> Mount:
    """/metrics as vLLM mounts it: prometheus_client's ASGI app on every path that starts with /metrics
    (/metrics/ too, any method), so a scrape gets the format its Accept header asks for (OpenMetrics or
    text), only the families it names with `?name[]=` and a gzip body when it accepts one (the app's
    OpenMetrics sample names fixed: api/metrics_exposition.py)."""
    exposition = exposition_app(metrics.registry)

    async def http_only(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await exposition(scope, receive, send)
        else:  # (prometheus_client's app asserts an HTTP scope: a WebSocket handshake had raised there)
            await WebSocketClose()(scope, receive, send)

    mount = Mount("/metrics", http_only)
    # vLLM's override: without it /metrics answers a 307 to /metrics/
    mount.path_regex = re.compile("^/metrics(?P<path>.*)$")
    return mount


def route_table(app: FastAPI) -> list[tuple[str, list[str]]]:
    """(path, methods) of every HTTP route, for the startup log (included routers are expanded via OpenAPI;
    mounts, /metrics's, are left out as vLLM's route log leaves them)."""
    table: dict[str, set[str]] = defaultdict(set)  # a path served by several routes (GET + HEAD) lists all
    for r in app.routes:
        if (methods := getattr(r, "methods", None)) and hasattr(r, "path"):
            # `{model:path}` as OpenAPI writes it, `{model}` (it was listed twice)
            table[re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path)] |= methods
    for path, operations in app.openapi()["paths"].items():
        table[path] |= {m.upper() for m in operations}
    return sorted((path, sorted(methods)) for path, methods in table.items())
