"""The HTTP-server flags of `vllm serve` that worldserve honours as vLLM does: `--root-path` (served behind a
proxy under a path prefix), `--ssl-keyfile` / `--ssl-certfile` / `--ssl-ca-certs` / `--ssl-cert-reqs` /
`--ssl-ciphers` (HTTPS, checked before the model loads; a certfile may hold the key too), the h11 limits
(`--h11-max-incomplete-event-size`, `--h11-max-header-count`), `--disable-uvicorn-access-log` /
`--disable-access-log-for-endpoints`, `--log-config-file` (serve_logging.py), `--disable-fastapi-docs` (no
/docs, /redoc, /openapi.json), `--middleware` (a class or `async def (request, call_next)` imported by its
dotted name, added outermost, as vLLM adds it) and `--config FILE` (serve_config_file.py). Also the listening
socket, TCP (--host / --port) or a Unix domain socket (--uds): bound before the model loads (`bind_listener`,
`bind_unix_listener`), listening once the app is ready (`start_listening`), as vLLM binds its API socket; and
`GracefulServer`, uvicorn's server that stops job intake the moment a shutdown signal arrives, and stops as
on one when the engine dies (engine_death.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import ipaddress
import logging
import os
import signal
import socket
import ssl
import stat
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import uvicorn

from worldserve.api.settings import DEFAULT_UPLOAD_BYTES
from worldserve.commands.compat_flag import POSITIVE_INT
from worldserve.commands.engine_death import EngineDeathWatch
from worldserve.commands.serve_logging import excluded_paths
from worldserve.config import FlagValueError

log = logging.getLogger("worldserve.serve")


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server (vLLM's flags)")
    group.add_argument("--config", metavar="FILE", help="A YAML file of flags (`max-model-len: 16384`, as "
                       "vLLM reads it); flags on the command line win.")  # fmt: skip
    group.add_argument("--root-path", metavar="PATH", help="The path prefix a proxy serves this server under "
                       "(requests may come with or without it; /docs links and redirects carry it).")  # fmt: skip
    group.add_argument("--ssl-keyfile", metavar="PATH", help="Serve HTTPS with this private key.")
    group.add_argument("--ssl-certfile", metavar="PATH", help="Serve HTTPS with this certificate (alone: a PEM "
                       "file holding the certificate and its private key).")  # fmt: skip
    group.add_argument(
        "--ssl-ca-certs", metavar="PATH", help="CA certificates to verify client certificates."
    )
    group.add_argument("--ssl-cert-reqs", metavar="N", type=int, default=0,
                       help="Client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*).")  # fmt: skip
    group.add_argument("--ssl-ciphers", metavar="CIPHERS", help="OpenSSL cipher list for TLS 1.2 and below "
                       "(e.g. ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305); default: uvicorn's "
                       "(TLSv1). TLS 1.3 suites are not affected.")  # fmt: skip
    group.add_argument("--h11-max-incomplete-event-size", metavar="BYTES", type=POSITIVE_INT,
                       help="h11's bound on a request's line and headers before they are complete (over it: "
                       "a 400 and the close); default: 1 MiB + 64 KiB. Headers are capped at 64 KiB in any "
                       "case (a 431).")  # fmt: skip
    group.add_argument("--h11-max-header-count", metavar="N", type=POSITIVE_INT,
                       help="Most headers a request may carry (more: a 431, a WebSocket handshake refused); "
                       "default: no count (the 64 KiB cap on headers bounds them).")  # fmt: skip
    group.add_argument(
        "--disable-uvicorn-access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="No access log line a request.",
    )
    group.add_argument("--disable-access-log-for-endpoints", metavar="PATHS",
                       help="Comma-separated paths whose requests log no access line (e.g. /health,/metrics; "
                       "a path matches with or without the --root-path prefix and any query).")  # fmt: skip
    group.add_argument("--log-config-file", metavar="PATH", help="A logging configuration (JSON, or YAML by "
                       "its .yaml name: Python's dictConfig schema) applied at startup to worldserve's and "
                       "uvicorn's loggers, as vLLM applies it (loggers it does not name keep logging).")  # fmt: skip
    group.add_argument(
        "--disable-fastapi-docs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Serve no /docs, /redoc, /openapi.json.",
    )
    group.add_argument("--middleware", metavar="DOTTED.NAME", action="append", default=[],
                       help="Add an ASGI middleware class or an `async def (request, call_next)` function, "
                       "imported by its dotted name (repeatable).")  # fmt: skip


def check_http_arguments(args: argparse.Namespace) -> list[Callable | type]:
    """Before the model loads: --root-path and --disable-access-log-for-endpoints' paths start with "/", the
    --ssl-* files load and --ssl-ciphers names ciphers OpenSSL has (FlagValueError otherwise), and every
    --middleware imports; the middlewares, in
    order. A certfile alone is a PEM holding the key too (as uvicorn and vLLM take it); a keyfile alone is
    refused."""
    root = getattr(args, "root_path", None)
    if root and not root.startswith("/"):  # (a prefix without its slash matched no request path)
        raise FlagValueError(f"--root-path {root!r} must start with '/' (e.g. /{root})")
    certfile, keyfile = getattr(args, "ssl_certfile", None), getattr(args, "ssl_keyfile", None)
    if keyfile and not certfile:
        raise FlagValueError("--ssl-keyfile needs --ssl-certfile (the certificate) for HTTPS; a certfile "
                             "alone may hold the key too")  # fmt: skip
    ca_certs, cert_reqs = getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", 0)
    ciphers = getattr(args, "ssl_ciphers", None)
    if cert_reqs not in (0, 1, 2):
        raise FlagValueError(
            f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}"
        )
    if (ca_certs or cert_reqs or ciphers) and not certfile:  # (they were silently unused)
        raise FlagValueError("--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers shape HTTPS: they need "
                             "--ssl-certfile (and --ssl-keyfile unless the certfile holds the key)")  # fmt: skip
    if certfile:
        context = _load_certificate(certfile, keyfile)
        if ca_certs:
            try:
                context.load_verify_locations(ca_certs)
            except (OSError, ValueError) as exc:
                raise FlagValueError(f"--ssl-ca-certs {ca_certs}: cannot load it ({exc})") from None
        if ciphers:
            try:
                context.set_ciphers(ciphers)
            except ssl.SSLError:
                raise FlagValueError(f"--ssl-ciphers {ciphers!r}: OpenSSL knows none of these ciphers (an "
                                     "OpenSSL cipher list, e.g. ECDHE-RSA-AES256-GCM-SHA384)") from None  # fmt: skip
    excluded_paths(getattr(args, "disable_access_log_for_endpoints", None))
    return [_import_middleware(name) for name in getattr(args, "middleware", None) or ()]


class _EncryptedKey(Exception):
    """Raised by the password callback: OpenSSL asked for the key's passphrase."""


def _no_passphrase() -> NoReturn:
    raise _EncryptedKey


def _load_certificate(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    """The certificate and key loaded as uvicorn will load them (its default protocol and ciphers; no
    keyfile: the key is in the certfile), but with a password callback that refuses: OpenSSL's own prompted
    on the terminal for an encrypted key's passphrase here, and uvicorn's prompted (or, with no terminal,
    blocked) again after the model load; worldserve has no passphrase flag (nor has vLLM), so an encrypted
    key is refused, with how to decrypt it."""
    from uvicorn.config import SSL_PROTOCOL_VERSION

    context = ssl.SSLContext(SSL_PROTOCOL_VERSION)
    key = keyfile or certfile
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except _EncryptedKey:
        flag = "--ssl-keyfile" if keyfile else "--ssl-certfile"
        raise FlagValueError(f"{flag} {key}: the private key is encrypted (passphrase-protected) and the "
                             "server has no way to take its passphrase; decrypt it (openssl pkey -in "
                             f"{key} -out {key}.plain) and pass the decrypted file") from None  # fmt: skip
    except (OSError, ValueError) as exc:
        what = (
            "--ssl-certfile / --ssl-keyfile: cannot load them"
            if keyfile
            else "--ssl-certfile: cannot load it"
        )
        raise FlagValueError(f"{what} ({exc})") from None
    context.set_ciphers("TLSv1")
    return context


def _import_middleware(name: str) -> Callable | type:
    module, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError) as exc:
        raise FlagValueError(f"--middleware {name}: cannot import it ({exc})") from None
    if not (inspect.isclass(found) or inspect.iscoroutinefunction(found)):
        raise FlagValueError(f"--middleware {name}: expected a middleware class or an async function")
    return found


def uvicorn_options(args: argparse.Namespace, max_upload_bytes: int = DEFAULT_UPLOAD_BYTES) -> dict[str, Any]:
    """uvicorn.Config keywords of these flags (the root path is the app's, as vLLM sets it: see install), and
    the HTTP protocol (api/http_protocol.py: h11 with header and body deadlines and a header cap).

    A WebSocket message may be as large as a request body (`max_upload_bytes`, --max-upload-mb) and a little
    more (api/realtime.py: ws_max_size): uvicorn's 16 MiB had closed a realtime session.start carrying an
    inline reference that POST /v1/videos takes with 1009.

    WebSockets never negotiate permessage-deflate (uvicorn's default offers it to every client that asks, as
    `websockets` clients do): /v1/realtime/video sends H.264 parts, which zlib cannot shrink (1.002x), and
    deflating a 7 MB part on the event loop takes 0.27-0.47 s, more than the VAE takes to decode it (0.33 s),
    so the parts fell behind the decode. An open WebSocket is not closed the moment a graceful shutdown
    begins (api/ws_protocol.py): a realtime stream gets the grace a running request has.

    With --log-config-file, uvicorn configures no logging of its own (log_config None): the file, applied
    at startup (serve_logging.py), configures its loggers too, as vLLM hands it to uvicorn."""
    from worldserve import envs
    from worldserve.api.http_protocol import H11_BUFFER_BYTES, header_guard_protocol
    from worldserve.api.realtime import ws_max_size
    from worldserve.api.ws_protocol import graceful_ws_protocol

    tls = {"ssl_ciphers": args.ssl_ciphers} if getattr(args, "ssl_ciphers", None) else {}
    logging_config = {"log_config": None} if getattr(args, "log_config_file", None) else {}
    return dict(
        http=header_guard_protocol(envs.http_header_timeout_s()),
        ws=graceful_ws_protocol(),
        ws_per_message_deflate=False,
        ws_max_size=ws_max_size(max_upload_bytes),
        # (below the 64 KiB header cap, h11's 400 answers first; above it, the cap's 431: http_protocol.py)
        h11_max_incomplete_event_size=getattr(args, "h11_max_incomplete_event_size", None) or H11_BUFFER_BYTES,
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        ssl_keyfile=getattr(args, "ssl_keyfile", None), ssl_certfile=getattr(args, "ssl_certfile", None),
        ssl_ca_certs=getattr(args, "ssl_ca_certs", None), ssl_cert_reqs=getattr(args, "ssl_cert_reqs", 0),
        **tls, **logging_config,
    )  # fmt: skip


def event_loop(config: Any) -> str:
    """The event loop uvicorn runs `config` on: "uvloop" (installed with worldserve) or "asyncio"."""
    factory = config.get_loop_factory()
    return "uvloop" if factory is not None and "uvloop" in factory.__module__ else "asyncio"


def install(
    app: Any,
    *,
    root_path: str | None,
    middlewares: list[Callable | type],
    max_header_count: int | None = None,
) -> None:
    """Add the --middleware ones (outermost, in order), then --h11-max-header-count's limit around all, and
    set the --root-path prefix.

    The prefix is the app's root_path, as vLLM sets it: FastAPI puts it in every request's scope, and
    Starlette matches routes on the path less the prefix when the path starts with it, on the path as it is
    otherwise, so a request is served with or without it (the API key is checked on that same route path:
    api/auth.py). The path itself is left whole: redirects (a trailing slash's 307), request.url (which a
    --middleware sees) and the access log carry the prefix the client sent, and /docs points at
    {prefix}/openapi.json, whose schema names {prefix} its server."""
    from worldserve.api.header_count import HeaderCountLimit

    for middleware in middlewares:
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
    if max_header_count is not None:
        app.add_middleware(HeaderCountLimit, limit=max_header_count)
    root = (root_path or "").rstrip("/")
    if root:
        app.root_path = root


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


def bind_unix_listener(path: str) -> socket.socket:
    """--uds: the server's Unix domain socket, bound before the model loads like the TCP one (vLLM's flag:
    --host and --port are then unused). A socket file left by a server that is gone (nothing accepts on it)
    is removed first, as uvicorn (asyncio) removes it; ValueError naming --uds when a server still listens
    there, when the path is another kind of file, or when it cannot be bound (a server bound there but still
    loading its model refuses connections too, so it is taken for gone, as uvicorn takes it). The file gets
    the process's umask permissions, as vLLM's does (uvicorn's own binding opens it to every local user)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ValueError(f"--uds {path}: cannot use it ({exc.strerror or exc})") from None
    if mode is not None and not stat.S_ISSOCK(mode):
        raise ValueError(f"--uds {path}: a file that is not a socket is there; remove it or give another one")
    if mode is not None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(path) == 0:
                raise ValueError(f"--uds {path}: another server is listening on it")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # (stale: its server is gone)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:  # (a missing folder, no permission, a path over the 107 bytes AF_UNIX takes)
        sock.close()
        raise ValueError(f"--uds {path}: cannot bind it ({exc.strerror or exc})") from None
    return sock


@contextlib.contextmanager
def unix_socket_removed(sock: socket.socket) -> Iterator[None]:
    """A --uds socket's file is removed when serving ends (a TCP socket: nothing to do), unless another
    server has bound the path meanwhile (its file is then another inode)."""
    path = sock.getsockname() if sock.family == socket.AF_UNIX else None
    inode = os.stat(path).st_ino if path else None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if path and os.stat(path).st_ino == inode:
                os.unlink(path)


def listen_address(sock: socket.socket, scheme: str, host: str | None) -> str:
    """Where the server listens, as vLLM logs it: `unix:PATH`, or `SCHEME://HOST:PORT` (an IPv6 address in
    brackets; every interface, '', as 0.0.0.0)."""
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host = host or "0.0.0.0"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"


def start_listening(sock: socket.socket, host: str | None) -> None:
    """listen() on the bound socket (uvicorn's backlog); ValueError when another process bound the same port
    meanwhile (two sockets with SO_REUSEADDR can both bind it while neither listens)."""
    try:
        sock.listen(2048)
    except OSError as exc:
        if sock.family == socket.AF_UNIX:
            raise ValueError(f"cannot listen on --uds {sock.getsockname()}: {exc.strerror or exc}") from None
        raise _cannot_listen(host, sock.getsockname()[1], exc) from None


def _cannot_listen(host: str | None, port: int, exc: OSError) -> ValueError:
    return ValueError(f"cannot listen on --host {host} --port {port}: {exc.strerror or exc}")


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that stops job intake the moment a shutdown signal arrives (then uvicorn's own), and
    shuts down as on SIGTERM when the engine dies, unless `keep_alive_on_engine_death` (engine_death.py;
    `exit_status` then 1)."""

    def __init__(
        self, config: uvicorn.Config, client: Any, shutdown_timeout: float, *,
        keep_alive_on_engine_death: bool = False,
    ):  # fmt: skip
        super().__init__(config)
        self._client = client
        self._shutdown_timeout = shutdown_timeout
        self.death = EngineDeathWatch(client, keep_alive=keep_alive_on_engine_death)

    @property
    def exit_status(self) -> int:
        """`worldserve serve`'s exit status once `run` returns: 1 after an engine death stopped it, else 0."""
        return self.death.exit_status

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s while serving), which first stops the server when the engine died."""
        if not self.should_exit and self.death.check():
            self._client.begin_shutdown(self._shutdown_timeout)
            self.should_exit = True
        return await super().on_tick(counter)

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
            # ...and the lifespan ends (its client.shutdown now returns at once), rather than being cancelled
            # with a logged traceback when the second interrupt's SIGINT is raised again after serve; unless
            # uvicorn ended it already (the second interrupt came during its lifespan shutdown)
            ended = getattr(self.lifespan, "shutdown_event", None)
            if ended is not None and not ended.is_set():
                await self.lifespan.shutdown()
