"""`worldserve serve [MODEL] --host H --port P [--omni] [--init-timeout S] ...`: the HTTP server.

Same command line as the recipe's `vllm serve nvidia/Cosmos3-Nano --omni --port 8000 --init-timeout 1800`.
Flags come from the config dataclasses (config.py). Startup: resolve the config and check --device, bind
--host / --port (or --uds) and open the job store (any of them failing stops the start before the model
loads), load the model within --init-timeout (no MODEL: the embedded tiny random checkpoint, loudly), wire
engine + client + app, log the routes, then listen on the bound socket and run uvicorn ("Application startup
complete." = ready).
SIGTERM / Ctrl-C: intake stops at once (503 for new jobs), running requests get --shutdown-timeout seconds
to finish, anything unfinished stays queued in the store and is re-run at the next start. A second Ctrl-C
ends the grace at once (uvicorn's force exit; the engine stops at its next step or decode chunk). The peer
ranks of a parallel backend stop after that; the exit status is then 0 after SIGTERM, 130 after Ctrl-C.
Engine death (the engine loop crashed, the Reasoner's chat worker stopped, a peer rank lost) stops the server
as SIGTERM does, exit status 1, unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 (engine_death.py).
SIGTERM during the start (the model load) ends it with one line, "worldserve serve: terminated", rc 143.
The Reasoner (POST /v1/chat/completions) shares the loaded transformer's und tower; its ViT loads from
vision_encoder/. `--backend fake` (hidden) serves numpy colour frames with no model and no chat: tests only.
Pasted vLLM / vLLM-Omni command lines run too (serve_compat.py): `--model` and `--stage-init-timeout` fold
into MODEL and --init-timeout, `--disable-mm-preprocessor-cache` into --mm-processor-cache-gb 0
(`engine_config`), `--log-file` is honoured (serve_logging.py); the other vLLM flags are accepted
with no effect (one log line each saying why) or, at values worldserve cannot honour, refused before the
model loads (exit 2).
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket
from pathlib import Path
from typing import Any

import uvicorn

from worldserve import __version__, envs
from worldserve.api.lora_field import LoraSettings
from worldserve.api.media_urls import allowed_domains
from worldserve.api.request_log import RequestLog
from worldserve.api.settings import AppSettings
from worldserve.commands import serve_backend, serve_http, serve_logging
from worldserve.commands.serve_checks import check_device_and_checkpoint, check_model_not_taken
from worldserve.commands.serve_compat import add_compat_arguments, check_compat_flags, log_compat
from worldserve.commands.serve_config_file import apply_config_file, record_given
from worldserve.config import CONFIG_CLASSES, TINY_SERVED_NAME, EngineConfig, MediaConfig
from worldserve.config_flags import add_config_arguments
from worldserve.config_values import JsonObject
from worldserve.weights.checkpoint import CheckpointError

log = logging.getLogger("worldserve.serve")
LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The config dataclasses' flags, vLLM's HTTP-server flags (serve_http.py), then the vLLM / vLLM-Omni
    compatibility group (serve_compat.py)."""
    for cls in CONFIG_CLASSES:
        add_config_arguments(parser, cls)
    serve_http.add_http_arguments(parser)
    add_compat_arguments(parser)
    record_given(parser)  # --config fills only the flags the command line did not give


def _fresh_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="worldserve serve")
    add_arguments(parser)
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed `serve` flags, vLLM's aliases folded in: `--model M` is MODEL (both given and
    different: ValueError), `--stage-init-timeout S` raises --init-timeout to S when larger and
    `--disable-mm-preprocessor-cache` sets --mm-processor-cache-gb to 0. A vLLM flag at a
    value worldserve cannot honour is a ValueError naming it (serve_compat.check_compat_flags). `--config FILE`
    fills the flags the command line left at their defaults first."""
    apply_config_file(args, _fresh_parser)
    check_compat_flags(args)
    values = vars(args).copy()
    option = values.pop("model_option", None)
    if option is not None:
        if values.get("model") not in (None, option):
            raise ValueError(f"the model is given twice, as MODEL {values['model']!r} and as --model {option!r}; "
                             "pass it once, as the positional MODEL")  # fmt: skip
        values["model"] = option
    if values.get("model") is None:
        check_model_not_taken(values)
    stage_timeout = values.pop("stage_init_timeout", None)
    if stage_timeout is not None:
        values["init_timeout"] = max(values["init_timeout"], stage_timeout)
    if values.pop("disable_mm_preprocessor_cache", None):  # (vLLM's deprecated spelling, winning as there)
        values["mm_processor_cache_gb"] = 0.0
    return EngineConfig.from_args(argparse.Namespace(**values))


def run(args: argparse.Namespace) -> int:
    """`worldserve serve`: its exit status (0 after serving; 1 when the checkpoint cannot be read, the model
    did not load, or the engine died while serving (engine_death.py); 2 for a bad flag value or environment
    variable, --host, --port, --uds or --storage-dir). The flags are checked
    (`_checked_config`) and the socket is bound before the model loads; it stays bound to the end of serving."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt="%m-%d %H:%M:%S")
    try:
        config, middlewares, log_file = _checked_config(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    except CheckpointError as exc:  # (the pre-load checks read the checkpoint: logged, --log-file too)
        log.error("could not load the model: %s", exc)
        return 1
    log.info("worldserve %s: serve %s", __version__, _non_default_args(args))
    log_compat(args, config)
    # before the (minutes-long) model load: a bad --host, a busy --port or --uds, or an unusable storage
    # directory fails the start at once
    server = config.server
    try:
        if server.uds:
            listener = serve_http.bind_unix_listener(server.uds)
        else:
            listener = serve_http.bind_listener(server.host, server.port)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    with listener, serve_http.unix_socket_removed(listener):
        return _load_and_serve(config, listener, log_file=log_file, http=(args, middlewares))


def _checked_config(args: argparse.Namespace) -> tuple[EngineConfig, list, logging.Handler | None]:
    """(the resolved config, the HTTP middlewares, the --log-file handler or None) of the parsed flags, every
    flag checked that can be before anything binds, loads or downloads: ValueError for a bad value (exit 2),
    CheckpointError for a checkpoint on disk that cannot load (exit 1). --config's file is applied first: it
    may name the --log-file, which then gets these checks' errors too."""
    apply_config_file(args, _fresh_parser)  # first: the file may name the --log-file
    # (before --log-file: the file's root handlers would replace that one)
    if getattr(args, "log_config_file", None):
        serve_logging.apply_log_config(args.log_config_file)
    elif envs.logging_config_path():  # (vLLM's variable; uvicorn then configures no logging of its own)
        args.log_config_file = envs.logging_config_path()
        serve_logging.apply_log_config(args.log_config_file, "VLLM_LOGGING_CONFIG_PATH")
    log_file = None
    if getattr(args, "log_file", None):
        log_file = serve_logging.log_to_file(args.log_file, LOG_FORMAT)
    config = engine_config(args).resolve()
    middlewares = serve_http.check_http_arguments(args)  # certificates load, middlewares import
    media = config.media.allowed_local_media_path
    if media and not Path(media).is_dir():  # (vLLM refuses it too; here every file:// URL got a 400)
        raise ValueError(f"--allowed-local-media-path {media}: "
                         + ("not a directory" if Path(media).exists() else "does not exist"))  # fmt: skip
    media_defaults(config.media)  # a bad --media-io-kwargs / --mm-processor-kwargs stops the start here
    envs.keep_alive_on_engine_death()  # (a malformed VLLM_KEEP_ALIVE_ON_ENGINE_DEATH too)
    template_defaults(config.chat.default_chat_template_kwargs)  # (and a bad --default-chat-template-kwargs)
    config.lora.check_path()  # (the adapter's own files are the backend's to check, per request)
    # a bad --generation-config folder or value stops the start before the load
    model = config.model.model
    serve_backend.chat_defaults(config.reasoner, Path(model) if model and Path(model).is_dir() else None)
    if config.model.backend != "fake":  # --device before anything binds, loads or downloads
        check_device_and_checkpoint(config)
    return config, middlewares, log_file


def _load_and_serve(
    config: EngineConfig,
    listener: socket.socket,
    *,
    log_file: logging.Handler | None,
    http: tuple[argparse.Namespace, list],
) -> int:
    """With `listener` bound: open the job store (exit 2 when it cannot be), load the model within
    --init-timeout (exit 1 when it does not, the store closed), then serve (`_serve`); the backend is closed
    (a parallel backend's peer ranks stopped) however serving ends."""
    from worldserve.engine.job_files import StorageError
    from worldserve.engine.jobs import JobStore

    assert config.video.storage_dir is not None, "resolve() sets the storage directory"
    try:
        store = JobStore(config.video.storage_dir)
    except StorageError as exc:  # (--storage-dir's value: a config error, exit 2 as a busy --port's)
        log.error("%s", exc)
        return 2
    loaded: tuple[Any, ...] | None = None
    try:  # (SIGTERM here, cli.Terminated, ends the start: the loader is a daemon thread, peers see us go)
        loaded = serve_backend.load_backend_within(
            config.model, config.parallel, config.scheduler, config.reasoner, config.lora
        )
    finally:
        if loaded is None:
            store.close()
    if loaded is None:
        return 1
    backend, gpu_memory, *chat = loaded
    try:
        return _serve(
            config,
            store,
            backend,
            gpu_memory,
            chat[0] if chat else None,
            listener,
            log_file=log_file,
            http=http,
        )
    finally:
        if hasattr(backend, "close"):  # CFG-parallel / Ulysses: stop the peer ranks
            backend.close()
        log.info("worldserve serve stopped")
        # the interpreter's exit collects every object left (the weights' modules, the compiled graphs):
        # 3.5-6 s of an idle tiny server's exit went there; frozen objects are left out of it
        gc.freeze()


def _serve(
    config: EngineConfig,
    store: Any,
    backend: Any,
    gpu_memory: Any,
    chat_backend: Any,
    listener: socket.socket,
    *,
    log_file: logging.Handler | None = None,
    http: tuple[argparse.Namespace, list] | None = None,
) -> int:
    """Wire engine + client + app over the loaded `backend` and serve on the bound `listener` until shutdown:
    0, 1 when an engine death stopped it (engine_death.py), or 2 when the socket cannot listen."""
    server_cfg = config.server
    http_args, middlewares = http or (argparse.Namespace(), [])
    client, metrics, settings = _engine_client(config, store, backend, gpu_memory, chat_backend)
    app = _http_app(config, client, metrics, settings, http_args, middlewares)
    uv_config = _uvicorn_config(config, app, http_args)
    scheme = "https" if getattr(http_args, "ssl_certfile", None) else "http"
    log.info("Starting worldserve API server on %s (HTTP: h11, event loop: %s)",
             serve_http.listen_address(listener, scheme, server_cfg.host), serve_http.event_loop(uv_config))  # fmt: skip
    if log_file is not None:  # uvicorn.Config has just (re)configured its loggers, which do not propagate
        # (its access logger too, even with access_log off: the file then got what the console did not; a
        # --log-config-file's loggers that propagate reach the file through the root logger already)
        for name in ("uvicorn", "uvicorn.access") if uv_config.access_log else ("uvicorn",):
            if not logging.getLogger(name).propagate:
                logging.getLogger(name).addHandler(log_file)
    try:
        serve_http.start_listening(listener, server_cfg.host)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    excluded = serve_logging.excluded_paths(getattr(http_args, "disable_access_log_for_endpoints", None))
    server = serve_http.GracefulServer(uv_config, client, config.scheduler.shutdown_timeout,
                                       keep_alive_on_engine_death=envs.keep_alive_on_engine_death())  # fmt: skip
    with serve_logging.access_log_excluded(excluded, getattr(http_args, "root_path", None)):
        server.run(sockets=[listener])
    return server.exit_status


def _engine_client(
    config: EngineConfig, store: Any, backend: Any, gpu_memory: Any, chat_backend: Any
) -> tuple[Any, Any, AppSettings]:
    """(EngineClient, Metrics, AppSettings): the engine over `backend` and the job store, its metrics, and
    the client the app serves (a warning when --default-sampling-params asks for sound the checkpoint cannot
    make)."""
    from worldserve.api.metrics import Metrics
    from worldserve.engine.client import EngineClient
    from worldserve.engine.engine import Engine

    video_cfg, served = config.video, config.model.served_model_name
    assert served is not None, "resolve() names the served model"
    log.info(
        "job store: %s (ttl: %s)", store.root, f"{video_cfg.job_ttl:g}s" if video_cfg.job_ttl else "none"
    )
    metrics = Metrics(served, gpu_memory_bytes=gpu_memory)
    engine = Engine(backend, store, config.scheduler, observer=metrics, job_ttl_s=video_cfg.job_ttl)
    settings = app_settings(config)
    client = EngineClient(engine, store, model_name=served, max_queued_requests=config.scheduler.max_queued_requests,
                          job_ttl_s=video_cfg.job_ttl, sweep_interval_s=video_cfg.job_sweep_interval,
                          chat_backend=chat_backend, max_num_seqs=config.scheduler.max_num_seqs,
                          restored_check=settings.lora.check_restored)  # fmt: skip
    if video_cfg.video_defaults.get("generate_sound") and not client.has_sound:
        log.warning("--default-sampling-params generate_sound true: this checkpoint has no sound tokenizer, so "
                    "videos are made without sound")  # fmt: skip
    return client, metrics, settings


def _http_app(
    config: EngineConfig, client: Any, metrics: Any, settings: AppSettings, http_args: argparse.Namespace,
    middlewares: list,
) -> Any:  # fmt: skip
    """The FastAPI app over `client`, vLLM's HTTP-server options installed (serve_http.py), with the log lines
    that name the model served and every route."""
    from worldserve.api.app import build_app, route_table

    server_cfg, video_cfg, served = config.server, config.video, config.model.served_model_name
    app = build_app(client, settings, metrics=metrics,
                    docs=not getattr(http_args, "disable_fastapi_docs", False))  # fmt: skip
    serve_http.install(app, root_path=getattr(http_args, "root_path", None), middlewares=middlewares,
                       max_header_count=getattr(http_args, "h11_max_header_count", None))  # fmt: skip
    log.info("serving model %r (max batch %d, queue %d, sync timeout %gs%s)", served, config.scheduler.max_batch_size,
             config.scheduler.max_queued_requests, video_cfg.sync_timeout,
             ", API key required on /v1" if server_cfg.api_key else ", no API key: /v1 is open to every client")  # fmt: skip
    log.info("Available routes are:")
    for path, methods in route_table(app):
        log.info("Route: %s, Methods: %s", path, ", ".join(methods))
    return app


def _uvicorn_config(config: EngineConfig, app: Any, http_args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's config for `app`: --host / --port, the graceful shutdown's bound past --shutdown-timeout, and
    vLLM's HTTP-server options (serve_http.uvicorn_options)."""
    server_cfg = config.server
    return uvicorn.Config(
        app, host=server_cfg.host, port=server_cfg.port, log_level=server_cfg.uvicorn_log_level,
        timeout_graceful_shutdown=int(config.scheduler.shutdown_timeout) + 10,
        # uvicorn annotates it int, but only ever passes it to loop.call_later: a fraction of a second works
        timeout_keep_alive=envs.http_timeout_keep_alive_s(),  # type: ignore[arg-type]
        **serve_http.uvicorn_options(http_args, server_cfg.max_upload_bytes),
    )  # fmt: skip


def app_settings(config: EngineConfig) -> AppSettings:
    """build_app's settings from a resolved config (api/settings.py; --disable-fastapi-docs is the HTTP
    layer's, given beside them)."""
    server, video, media, chat = config.server, config.video, config.media, config.chat
    # resolve()'s value, for a config not resolved (as tests pass one: they look at other settings)
    sync_timeout = video.sync_timeout if video.sync_timeout is not None else envs.sync_timeout_s()
    return AppSettings(
        api_keys=server.api_key or (), sync_timeout_s=sync_timeout, max_upload_bytes=server.max_upload_bytes,
        shutdown_timeout_s=config.scheduler.shutdown_timeout,
        # /v1/models' root: the model argument, as vLLM's; without one the embedded tiny default's own name
        model_root=config.model.model or TINY_SERVED_NAME,
        model_aliases=config.model.served_model_aliases,
        allowed_local_media_path=media.allowed_local_media_path, allowed_origins=server.allowed_origins,
        allowed_media_domains=allowed_domains(media.allowed_media_domains),
        server_load_tracking=server.enable_server_load_tracking,
        mm_limits=dict(media.limit_mm_per_prompt or ()),
        video_decode_pixels=int(media.max_video_decode_gpixels * 10**9),
        allowed_methods=server.allowed_methods, allowed_headers=server.allowed_headers,
        allow_credentials=server.allow_credentials, request_id_headers=server.enable_request_id_headers,
        default_flow_shift=video.flow_shift, video_defaults=video.video_defaults,
        failed_jobs_ok=video.openai_failed_job_status,
        lora=LoraSettings(config.lora.enable_lora, config.lora.static_lora),
        reasoning_parser=chat.reasoning_parser,
        prompt_tokens_details=chat.enable_prompt_tokens_details, response_role=chat.response_role,
        tokens_as_ids=chat.return_tokens_as_token_ids, force_include_usage=chat.enable_force_include_usage,
        request_log=RequestLog(server.max_log_len) if server.enable_log_requests else None,
        stats_interval_s=None if server.disable_log_stats else envs.log_stats_interval_s(),
        seed=chat.seed,
        media_defaults=media_defaults(media), template_defaults=template_defaults(chat.default_chat_template_kwargs),
        responses_store_bytes=int(chat.responses_store_mb * 2**20),
    )  # fmt: skip


def media_defaults(media: MediaConfig) -> Any:
    """--media-io-kwargs / --mm-processor-kwargs as the chat API's MediaDefaults; ValueError naming the flag
    when a request carrying them would be refused (checked before the model loads)."""
    from worldserve.api.chat import request_options
    from worldserve.api.chat_options import MediaDefaults
    from worldserve.api.chat_protocol import ChatCompletionRequest
    from worldserve.params import ParamError

    io, mm = dict(media.media_io_kwargs or {}), dict(media.mm_processor_kwargs or {})
    probe = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "-"}]})
    for flag, defaults in (("--media-io-kwargs", MediaDefaults(io, {})), ("--mm-processor-kwargs", MediaDefaults({}, mm)),
                           ("--media-io-kwargs with --mm-processor-kwargs", MediaDefaults(io, mm))):  # fmt: skip
        try:
            request_options(probe, media=defaults)
        except ParamError as exc:
            raise ValueError(f"{flag}: {exc.message}") from None
    return MediaDefaults(io, mm)


def template_defaults(kwargs: JsonObject | None) -> dict[str, Any]:
    """--default-chat-template-kwargs as the chat API's template defaults; ValueError naming the flag for what
    a request's chat_template_kwargs would be refused for (checked before the model loads)."""
    from worldserve.api.chat_options import template_kwargs
    from worldserve.params import ParamError

    try:
        return template_kwargs(kwargs.as_dict() if kwargs is not None else None)
    except ParamError as exc:
        raise ValueError(f"--default-chat-template-kwargs: {exc.message}") from None


def _non_default_args(args: argparse.Namespace) -> str:
    defaults = {}
    for cls in CONFIG_CLASSES:
        parser = argparse.ArgumentParser(add_help=False)
        add_config_arguments(parser, cls)
        defaults.update(vars(parser.parse_args([])))
    changed = {k: v for k, v in vars(args).items() if k in defaults and v != defaults[k]}
    if "api_key" in changed:
        changed["api_key"] = "***"
    return f"non-default args: {changed}" if changed else "all defaults"
