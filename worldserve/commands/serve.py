"""`worldserve serve [MODEL] --host H --port P [--omni] [--init-timeout S] ...`: the HTTP server.

Same command line as the recipe's `vllm serve nvidia/Cosmos3-Nano --omni --port 8000 --init-timeout 1800`.
Flags come from the config dataclasses (config.py). Startup: resolve the config and check --device, bind
--host / --port and open the job store (any of them failing stops the start before the model loads), load
the model within --init-timeout (no MODEL: the embedded tiny random checkpoint, loudly), wire engine + client
+ app, log the routes, then listen on the bound socket and run uvicorn ("Application startup complete." =
ready).
SIGTERM / Ctrl-C: intake stops at once (503 for new jobs), running requests get --shutdown-timeout seconds
to finish, anything unfinished stays queued in the store and is re-run at the next start. A second Ctrl-C
ends the grace at once (uvicorn's force exit; the engine stops at its next step or decode chunk). The peer
ranks of a parallel backend stop after that; the exit status is then 0 after SIGTERM, 130 after Ctrl-C.
The Reasoner (POST /v1/chat/completions) shares the loaded transformer's und tower; its ViT loads from
vision_encoder/. `--backend fake` (hidden) serves numpy colour frames with no model and no chat: tests only.
Pasted vLLM / vLLM-Omni command lines run too (serve_compat.py): `--model` and `--stage-init-timeout` fold
into MODEL and --init-timeout (`engine_config`), `--log-file` is honoured; the other vLLM flags are accepted
with no effect (one log line each saying why) or, at values worldserve cannot honour, refused before the
model loads (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from worldserve import __version__, envs
from worldserve.api.media_urls import allowed_domains
from worldserve.api.request_log import RequestLog
from worldserve.commands import serve_backend, serve_http
from worldserve.commands.serve_compat import add_compat_arguments, check_compat_flags, log_compat, log_to_file
from worldserve.config import (
    CONFIG_CLASSES,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
)
from worldserve.config_flags import add_config_arguments
from worldserve.sampling.chat_defaults import RequestSeeds

log = logging.getLogger("worldserve.serve")
LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The config dataclasses' flags, vLLM's HTTP-server flags (serve_http.py), then the vLLM / vLLM-Omni
    compatibility group (serve_compat.py)."""
    for cls in CONFIG_CLASSES:
        add_config_arguments(parser, cls)
    serve_http.add_http_arguments(parser)
    add_compat_arguments(parser)
    serve_http.record_given(parser)  # --config fills only the flags the command line did not give


def _fresh_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="worldserve serve")
    add_arguments(parser)
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed `serve` flags, vLLM's aliases folded in: `--model M` is MODEL (both given and
    different: ValueError) and `--stage-init-timeout S` raises --init-timeout to S when larger. A vLLM flag at a
    value worldserve cannot honour is a ValueError naming it (serve_compat.check_compat_flags). `--config FILE`
    fills the flags the command line left at their defaults first."""
    serve_http.apply_config_file(args, _fresh_parser)
    check_compat_flags(args)
    values = vars(args).copy()
    option = values.pop("model_option", None)
    if option is not None:
        if values.get("model") not in (None, option):
            raise ValueError(f"the model is given twice, as MODEL {values['model']!r} and as --model {option!r}; "
                             "pass it once, as the positional MODEL")  # fmt: skip
        values["model"] = option
    if values.get("model") is None:
        _check_model_not_taken(values)
    stage_timeout = values.pop("stage_init_timeout", None)
    if stage_timeout is not None:
        values["init_timeout"] = max(values["init_timeout"], stage_timeout)
    return EngineConfig.from_args(argparse.Namespace(**values))


def _check_model_not_taken(values: dict) -> None:
    """No MODEL was parsed: ValueError when a many-valued flag took a checkpoint folder as one of its values
    (`serve --api-key K ./ckpt`: the folder became a second key and the tiny default was served)."""
    for flag in ("api_key", "served_model_name"):
        given = values.get(flag)
        for value in [given] if isinstance(given, str) else given or ():
            if Path(value).is_dir():
                raise ValueError(f"--{flag.replace('_', '-')} took {value!r}, a folder, as one of its values, so "
                                 "no MODEL was given: put MODEL first (serve MODEL --options)")  # fmt: skip


def _check_kernels(config: EngineConfig) -> None:
    """--quantization fp8 / --fp8-attention / FLASH_ATTN where they cannot run: ValueError before the model
    loads (as generate; serve found it after loading, exit 1). Nano's head_dim: FA3's support does not vary
    with the checkpoint's size otherwise."""
    import torch

    from worldserve.runner.devices import default_device, default_dtype

    device = torch.device(config.model.device) if config.model.device else default_device()
    dtype = getattr(torch, config.model.dtype) if config.model.dtype else default_dtype(device)
    config.model.kernel_options(enable_layerwise_offload=config.parallel.enable_layerwise_offload).check(
        device, dtype
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt="%m-%d %H:%M:%S")
    log_file = None
    try:
        serve_http.apply_config_file(args, _fresh_parser)  # first: the file may name the --log-file
        if getattr(args, "log_file", None):
            log_file = log_to_file(args.log_file, LOG_FORMAT)
        config = engine_config(args).resolve()
        middlewares = serve_http.check_http_arguments(args)  # certificates load, middlewares import
        media = config.server.allowed_local_media_path
        if media and not Path(media).is_dir():  # (vLLM refuses it too; here every file:// URL got a 400)
            raise ValueError(f"--allowed-local-media-path {media}: "
                             + ("not a directory" if Path(media).exists() else "does not exist"))  # fmt: skip
        media_defaults(config.server)  # a bad --media-io-kwargs / --mm-processor-kwargs stops the start here
        # a bad --generation-config folder or value stops the start before the load
        model = config.model.model
        serve_backend.chat_defaults(config.model, Path(model) if model and Path(model).is_dir() else None)
        if config.model.backend != "fake":  # --device before anything binds, loads or downloads
            from worldserve.runner.devices import check_layout_device

            par = config.parallel
            check_layout_device(
                config.model.device,
                cfg_parallel_size=par.cfg_parallel_size,
                ulysses_degree=par.ulysses_degree,
                tensor_parallel_size=par.tensor_parallel_size,
            )
            _check_kernels(config)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    log.info("worldserve %s: serve %s", __version__, _non_default_args(args))
    log_compat(args, config)
    if config.model.omni:
        log.info("--omni accepted: worldserve always serves the omni video API")
    from worldserve.engine.job_files import StorageError
    from worldserve.engine.jobs import JobStore

    # before the (minutes-long) model load: a bad --host, a busy --port or an unusable storage directory
    # fails the start at once
    try:
        listener = bind_listener(config.server.host, config.server.port)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    with listener:
        try:
            store = JobStore(config.server.storage_dir)
        except StorageError as exc:
            log.error("%s", exc)
            return 1
        loaded = _load_backend_within(config.model, config.parallel, config.scheduler)
        if loaded is None:
            store.close()
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
                http=(args, middlewares),
            )
        finally:
            if hasattr(backend, "close"):  # CFG-parallel / Ulysses: stop the peer ranks
                backend.close()
            log.info("worldserve serve stopped")


def bind_listener(host: str | None, port: int) -> socket.socket:
    """The server's socket, bound before the model loads and listening only once the app is ready (until
    then connections are refused, so readiness probes wait); ValueError naming --host / --port when it cannot
    be bound. Bound as vLLM binds its API socket: an IPv6 literal gets an IPv6 socket (`::` is dual-stack),
    anything else (an IPv4 address, a name such as localhost, empty for every interface) an IPv4 one."""
    try:
        ipv6 = ipaddress.ip_address(host or "").version == 6
    except ValueError:
        ipv6 = False
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (proto 0 left Nagle on,
    # and a response's body, written after its headers, waited ~40 ms for the client's delayed ACK)
    sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # as uvicorn: a restart reuses the port at once (its old connections may still be in TIME_WAIT)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host or "", port))
    except (socket.gaierror, UnicodeError) as exc:
        sock.close()
        raise ValueError(f"--host {host!r} is not an address of this machine: {exc}") from None
    except OSError as exc:
        sock.close()
        raise _cannot_listen(host, port, exc) from None
    return sock


def start_listening(sock: socket.socket, host: str | None) -> None:
    """listen() on the bound socket (uvicorn's backlog); ValueError when another process bound the same port
    meanwhile (two sockets with SO_REUSEADDR can both bind it while neither listens)."""
    try:
        sock.listen(2048)
    except OSError as exc:
        raise _cannot_listen(host, sock.getsockname()[1], exc) from None


def _cannot_listen(host: str | None, port: int, exc: OSError) -> ValueError:
    return ValueError(f"cannot listen on --host {host} --port {port}: {exc.strerror or exc}")


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
    from worldserve.api.app import build_app, route_table
    from worldserve.api.metrics import Metrics
    from worldserve.engine.client import EngineClient
    from worldserve.engine.engine import Engine

    server_cfg, served = config.server, config.model.served_model_name
    log.info(
        "job store: %s (ttl: %s)", store.root, f"{server_cfg.job_ttl:g}s" if server_cfg.job_ttl else "none"
    )
    metrics = Metrics(served, gpu_memory_bytes=gpu_memory)
    engine = Engine(backend, store, config.scheduler, observer=metrics, job_ttl_s=server_cfg.job_ttl)
    client = EngineClient(engine, store, model_name=served, max_queued_requests=config.scheduler.max_queued_requests,
                          job_ttl_s=server_cfg.job_ttl, sweep_interval_s=server_cfg.job_sweep_interval,
                          chat_backend=chat_backend,
                          max_num_seqs=config.scheduler.max_num_seqs)  # fmt: skip
    if server_cfg.video_defaults.get("generate_sound") and not client.has_sound:
        log.warning("--default-sampling-params generate_sound true: this checkpoint has no sound tokenizer, so "
                    "videos are made without sound")  # fmt: skip
    http_args, middlewares = http or (argparse.Namespace(), [])
    app = build_app(client, metrics=metrics, **app_options(config),
                    docs=not getattr(http_args, "disable_fastapi_docs", False))  # fmt: skip
    serve_http.install(app, root_path=getattr(http_args, "root_path", None), middlewares=middlewares)
    log.info("serving model %r (max batch %d, queue %d, sync timeout %gs%s)", served, config.scheduler.max_batch_size,
             config.scheduler.max_queued_requests, server_cfg.sync_timeout,
             ", API key required on /v1" if server_cfg.api_key else ", no API key: /v1 is open to every client")  # fmt: skip
    scheme = "https" if getattr(http_args, "ssl_certfile", None) else "http"
    log.info("Available routes are:")
    for path, methods in route_table(app):
        log.info("Route: %s, Methods: %s", path, ", ".join(methods))
    uv_config = uvicorn.Config(
        app, host=server_cfg.host, port=server_cfg.port, log_level=server_cfg.uvicorn_log_level,
        timeout_graceful_shutdown=int(config.scheduler.shutdown_timeout) + 10,
        timeout_keep_alive=envs.http_timeout_keep_alive_s(),
        **serve_http.uvicorn_options(http_args),
    )  # fmt: skip
    host = server_cfg.host or "0.0.0.0"  # ('' binds every address); an IPv6 address goes in brackets in a URL
    log.info(
        "Starting worldserve API server on %s://%s:%d (HTTP: h11, event loop: %s)", scheme,
        f"[{host}]" if ":" in host else host, listener.getsockname()[1], serve_http.event_loop(uv_config),
    )  # fmt: skip
    if log_file is not None:  # uvicorn.Config has just (re)configured its loggers, which do not propagate
        for name in ("uvicorn", "uvicorn.access"):
            logging.getLogger(name).addHandler(log_file)
    try:
        start_listening(listener, server_cfg.host)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    GracefulServer(uv_config, client, config.scheduler.shutdown_timeout).run(sockets=[listener])
    return 0


def app_options(config: EngineConfig) -> dict[str, Any]:
    """build_app's keyword arguments from a resolved config (everything but the client and the metrics)."""
    server = config.server
    return dict(
        api_keys=server.api_key or (), sync_timeout_s=server.sync_timeout, max_upload_bytes=server.max_upload_bytes,
        shutdown_timeout_s=config.scheduler.shutdown_timeout, model_root=config.model.model,
        model_aliases=config.model.served_model_aliases,
        allowed_local_media_path=server.allowed_local_media_path, allowed_origins=server.allowed_origins,
        allowed_media_domains=allowed_domains(server.allowed_media_domains),
        server_load_tracking=server.enable_server_load_tracking,
        mm_limits=dict(server.limit_mm_per_prompt or ()),
        video_decode_pixels=int(server.max_video_decode_gpixels * 10**9),
        allowed_methods=server.allowed_methods, allowed_headers=server.allowed_headers,
        allow_credentials=server.allow_credentials, request_id_headers=server.enable_request_id_headers,
        default_flow_shift=server.flow_shift, video_defaults=server.video_defaults,
        reasoning_parser=server.reasoning_parser,
        prompt_tokens_details=server.enable_prompt_tokens_details, response_role=server.response_role,
        tokens_as_ids=server.return_tokens_as_token_ids, force_include_usage=server.enable_force_include_usage,
        request_log=RequestLog(server.max_log_len) if server.enable_log_requests else None,
        stats_interval_s=None if server.disable_log_stats else envs.log_stats_interval_s(),
        request_seeds=None if server.seed is None else RequestSeeds(server.seed),
        media_defaults=media_defaults(server),
        responses_store_bytes=int(server.responses_store_mb * 2**20),
    )  # fmt: skip


def media_defaults(server: ServerConfig) -> Any:
    """--media-io-kwargs / --mm-processor-kwargs as the chat API's MediaDefaults; ValueError naming the flag
    when a request carrying them would be refused (checked before the model loads)."""
    from worldserve.api.chat import request_options
    from worldserve.api.chat_options import MediaDefaults
    from worldserve.api.chat_protocol import ChatCompletionRequest
    from worldserve.params import ParamError

    io, mm = dict(server.media_io_kwargs or {}), dict(server.mm_processor_kwargs or {})
    probe = ChatCompletionRequest(messages=[{"role": "user", "content": "-"}])
    for flag, defaults in (("--media-io-kwargs", MediaDefaults(io, {})), ("--mm-processor-kwargs", MediaDefaults({}, mm)),
                           ("--media-io-kwargs with --mm-processor-kwargs", MediaDefaults(io, mm))):  # fmt: skip
        try:
            request_options(probe, media=defaults)
        except ParamError as exc:
            raise ValueError(f"{flag}: {exc.message}") from None
    return MediaDefaults(io, mm)


def _load_backend_within(
    cfg: ModelConfig, parallel: ParallelConfig = ParallelConfig(), scheduler: SchedulerConfig | None = None
) -> tuple[Any, Any] | None:
    """serve_backend.load_backend in a thread, bounded by --init-timeout; None (after logging why) on failure."""
    from worldserve.weights.checkpoint import CheckpointError

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = serve_backend.load_backend(cfg, parallel, scheduler or SchedulerConfig())
        except BaseException as exc:
            outcome["error"] = exc

    started = time.monotonic()
    loader = threading.Thread(target=target, name="worldserve-load", daemon=True)
    loader.start()
    loader.join(cfg.init_timeout)
    if loader.is_alive():
        log.error(
            "Model did not become ready within %gs (--init-timeout); raise it for cold caches",
            cfg.init_timeout,
        )
        return None
    if "error" in outcome:
        err = outcome["error"]
        # A bad checkpoint or an unsupported option is the user's to fix, a peer rank that died at start-up
        # has its own log above: one line; anything else: traceback.
        from worldserve.parallel.comm import PeerError

        expected = isinstance(err, (CheckpointError, ValueError, PeerError))
        log.error("could not load the model: %s", err, exc_info=None if expected else err)
        return None
    log.info("model ready in %.1fs", time.monotonic() - started)
    return outcome["value"]


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


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that stops job intake the moment a shutdown signal arrives (then uvicorn's own)."""

    def __init__(self, config: uvicorn.Config, client: Any, shutdown_timeout: float):
        super().__init__(config)
        self._client = client
        self._shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            log.info(
                "shutdown requested: no new jobs; running ones get %gs to finish", self._shutdown_timeout
            )
            self._client.begin_shutdown(self._shutdown_timeout)
        elif sig == signal.SIGINT:  # uvicorn's force exit: stops waiting for connections; the engine too
            log.warning("second interrupt: stopping now; running jobs are queued again for the next start")
            self._client.stop_now()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, but a SIGTERM ends `run` once the graceful shutdown is done: uvicorn raises it again
        there, and the default handler killed the process before the peer ranks were stopped (exit 0)."""
        with super().capture_signals():
            yield
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    async def shutdown(self, sockets: Any = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the app's lifespan shutdown then: the engine still parks its
            await self._client.shutdown(0.0)  # running jobs and the store closes (or they count interrupted)
