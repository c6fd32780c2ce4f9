"""The HTTP-server flags of `vllm serve` that worldserve honours as vLLM does: `--root-path` (served behind a
proxy under a path prefix), `--ssl-keyfile` / `--ssl-certfile` / `--ssl-ca-certs` / `--ssl-cert-reqs` (HTTPS,
checked before the model loads), `--disable-uvicorn-access-log`, `--disable-fastapi-docs` (no /docs, /redoc,
/openapi.json), `--middleware` (a class or `async def (request, call_next)` imported by its dotted name, added
outermost, as vLLM adds it) and `--config FILE` (a YAML file of flags, keys spelled as the flags without `--`;
a flag also given on the command line keeps the command line's value). Also the listening socket
(`bind_listener` before the model loads, `start_listening` once the app is ready, as vLLM binds its API
socket) and `GracefulServer`, uvicorn's server that stops job intake the moment a shutdown signal arrives.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import ipaddress
import json
import logging
import signal
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, cast

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from worldserve.api.settings import DEFAULT_UPLOAD_BYTES
from worldserve.config import FlagValueError

log = logging.getLogger("worldserve.serve")


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server (vLLM's flags)")
    group.add_argument("--config", metavar="FILE", help="A YAML file of flags (`max-model-len: 16384`, as "
                       "vLLM reads it); flags on the command line win.")  # fmt: skip
    group.add_argument("--root-path", metavar="PATH", help="The path prefix a proxy serves this server under "
                       "(requests may come with or without it; /docs links carry it).")  # fmt: skip
    group.add_argument("--ssl-keyfile", metavar="PATH", help="Serve HTTPS with this private key.")
    group.add_argument("--ssl-certfile", metavar="PATH", help="Serve HTTPS with this certificate.")
    group.add_argument(
        "--ssl-ca-certs", metavar="PATH", help="CA certificates to verify client certificates."
    )
    group.add_argument("--ssl-cert-reqs", metavar="N", type=int, default=0,
                       help="Client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*).")  # fmt: skip
    group.add_argument(
        "--disable-uvicorn-access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="No access log line a request.",
    )
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
    """Before the model loads: --root-path starts with "/", the --ssl-* files load (FlagValueError otherwise)
    and every --middleware imports; the middlewares, in order."""
    root = getattr(args, "root_path", None)
    if root and not root.startswith("/"):  # (a prefix without its slash matched no request path)
        raise FlagValueError(f"--root-path {root!r} must start with '/' (e.g. /{root})")
    if bool(getattr(args, "ssl_keyfile", None)) != bool(getattr(args, "ssl_certfile", None)):
        raise FlagValueError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS")
    ca_certs, cert_reqs = getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", 0)
    if cert_reqs not in (0, 1, 2):
        raise FlagValueError(
            f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}"
        )
    if (ca_certs or cert_reqs) and not getattr(args, "ssl_certfile", None):  # (they were silently unused)
        raise FlagValueError("--ssl-ca-certs and --ssl-cert-reqs check clients over HTTPS: they need "
                             "--ssl-certfile and --ssl-keyfile")  # fmt: skip
    if getattr(args, "ssl_certfile", None):
        context = _load_certificate(args.ssl_certfile, args.ssl_keyfile)
        if ca_certs:
            try:
                context.load_verify_locations(ca_certs)
            except (OSError, ValueError) as exc:
                raise FlagValueError(f"--ssl-ca-certs {ca_certs}: cannot load it ({exc})") from None
    return [_import_middleware(name) for name in getattr(args, "middleware", None) or ()]


class _EncryptedKey(Exception):
    """Raised by the password callback: OpenSSL asked for the key's passphrase."""


def _no_passphrase() -> NoReturn:
    raise _EncryptedKey


def _load_certificate(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The certificate and key loaded as uvicorn will load them (its default protocol and ciphers), but with a
    password callback that refuses: OpenSSL's own prompted on the terminal for an encrypted key's passphrase
    here, and uvicorn's prompted (or, with no terminal, blocked) again after the model load; worldserve has
    no passphrase flag (nor has vLLM), so an encrypted key is refused, with how to decrypt it."""
    from uvicorn.config import SSL_PROTOCOL_VERSION

    context = ssl.SSLContext(SSL_PROTOCOL_VERSION)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except _EncryptedKey:
        raise FlagValueError(f"--ssl-keyfile {keyfile}: the private key is encrypted (passphrase-protected) "
                             "and the server has no way to take its passphrase; decrypt it (openssl pkey -in "
                             f"{keyfile} -out {keyfile}.plain) and pass the decrypted file") from None  # fmt: skip
    except (OSError, ValueError) as exc:
        raise FlagValueError(f"--ssl-certfile / --ssl-keyfile: cannot load them ({exc})") from None
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
    begins (api/ws_protocol.py): a realtime stream gets the grace a running request has."""
    from worldserve import envs
    from worldserve.api.http_protocol import H11_BUFFER_BYTES, header_guard_protocol
    from worldserve.api.realtime import ws_max_size
    from worldserve.api.ws_protocol import graceful_ws_protocol

    return dict(
        http=header_guard_protocol(envs.http_header_timeout_s()),
        ws=graceful_ws_protocol(),
        ws_per_message_deflate=False,
        ws_max_size=ws_max_size(max_upload_bytes),
        h11_max_incomplete_event_size=H11_BUFFER_BYTES,  # (the header cap answers first: http_protocol.py)
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        ssl_keyfile=getattr(args, "ssl_keyfile", None), ssl_certfile=getattr(args, "ssl_certfile", None),
        ssl_ca_certs=getattr(args, "ssl_ca_certs", None), ssl_cert_reqs=getattr(args, "ssl_cert_reqs", 0),
    )  # fmt: skip


def event_loop(config: Any) -> str:
    """The event loop uvicorn runs `config` on: "uvloop" (installed with worldserve) or "asyncio"."""
    factory = config.get_loop_factory()
    return "uvloop" if factory is not None and "uvloop" in factory.__module__ else "asyncio"


def install(app: Any, *, root_path: str | None, middlewares: list[Callable | type]) -> None:
    """Add the --middleware ones (outermost, in order), then the root path's prefix handling around all."""
    for middleware in middlewares:
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
    root = (root_path or "").rstrip("/")
    if root:
        app.root_path = (
            root  # FastAPI: /docs points at {root}/openapi.json, the schema names {root} its server
        )
        app.add_middleware(RootPathMiddleware, root=root)


class RootPathMiddleware:
    """`--root-path /prefix`: a request for /prefix/v1/... is served (and checked for its API key, counted in
    the metrics...) as /v1/..., one without the prefix as it is."""

    def __init__(self, app: ASGIApp, root: str) -> None:
        self.app, self.root = app, root

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (path == self.root or path.startswith(self.root + "/")):
            scope = {**scope, "path": path[len(self.root) :] or "/", "root_path": self.root}
            if "raw_path" in scope and scope["raw_path"] is not None:
                scope["raw_path"] = scope["raw_path"][len(self.root.encode()) :] or b"/"
        await self.app(scope, receive, send)


GIVEN = "_given_on_command_line"
"""The namespace attribute record_given fills: the dests of the flags the command line gave."""
_RECORDING: dict[type, type] = {}


def record_given(parser: argparse.ArgumentParser) -> None:
    """Make every flag of `parser` note its dest in the namespace's GIVEN set when the command line gives it,
    so that --config fills only the others (a flag given at its default value still wins, as in vLLM, where
    the command line's flags come after the file's)."""
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            cls = type(action)
            if cls not in _RECORDING:
                _RECORDING[cls] = type(cls.__name__, (cls,), {"__call__": _recorded})
            action.__class__ = _RECORDING[cls]


def _recorded(
    self: argparse.Action, parser: Any, namespace: Any, values: Any, option_string: Any = None
) -> None:
    # record_given's subclass has one base, the flag's own Action class (store, append, BooleanOptional...)
    base = cast(type[argparse.Action], type(self).__bases__[0])
    base.__call__(self, parser, namespace, values, option_string)
    setattr(namespace, GIVEN, {*getattr(namespace, GIVEN, ()), self.dest})


def _config_argv(path: str, data: dict, parser: argparse.ArgumentParser, model_given: bool) -> list[str]:
    """The flags of a --config mapping as command-line words, as vLLM spells them: true is the switch, false
    the --no- form where the flag has one, a list the flag's values (repeated flag for a repeatable one)."""
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if flag not in ("--model", "--config") and (
            action is None or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            # (exactly a flag's name: argparse took `help: true` as --help, printed it and exited 0, and an
            # abbreviation as the flag it abbreviates)
            raise FlagValueError(f"--config {path}: {key!r} is not a `worldserve serve` option (a key is a "
                                 "flag's name without its --, as `worldserve serve --help` lists them)")  # fmt: skip
        if flag == "--model" and not model_given:
            argv.insert(0, str(value))  # the positional MODEL
        elif flag in ("--model", "--config"):
            continue  # the command line's MODEL wins; no nested config files
        elif value is True:
            argv.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in parser._option_string_actions:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, list):
            words = [json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value]
            if action is not None and action.nargs is None:  # one value a flag: each item its own flag
                if len(words) > 1 and not isinstance(action, argparse._AppendAction):
                    raise FlagValueError(f"--config {path}: {flag} takes one value, got the list {value}")
                argv += [w for word in words for w in (flag, word)]
            else:
                argv += [flag, *words]
        elif value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def apply_config_file(args: argparse.Namespace, parser_for: Callable[[], argparse.ArgumentParser]) -> None:
    """--config FILE: its flags fill `args` where the command line gave none (vLLM: the command line wins;
    a namespace from a parser without record_given: where the value is the default). FlagValueError naming
    the file for a file that cannot be read or a flag that does not parse."""
    path = getattr(args, "config", None)
    if not path:
        return
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        why = " ".join(str(exc).split())  # (YAML's errors span lines: one line, as every flag error)
        why = f"not UTF-8 text: {why}" if isinstance(exc, UnicodeDecodeError) else why
        raise FlagValueError(f"--config {path}: cannot read it ({why})") from None
    if not isinstance(data, dict):
        raise FlagValueError(f"--config {path}: expected a mapping of flags to values")
    parser = parser_for()
    argv = _config_argv(path, data, parser, getattr(args, "model", None) is not None)

    def refuse(message: str) -> NoReturn:
        raise FlagValueError(f"--config {path}: {message}")

    # argparse would exit naming the wrong command; mypy refuses any assignment to a method, which Python allows
    parser.error = refuse  # type: ignore[method-assign]
    defaults, given = vars(parser.parse_args([])), vars(parser.parse_args(argv))
    on_command_line = getattr(args, GIVEN, None)
    for dest, value in given.items():
        if dest == GIVEN or value == defaults.get(dest):
            continue
        if dest == "model" and getattr(args, "model", None) is not None:
            continue  # the command line's MODEL
        if dest in (on_command_line or ()) or (
            on_command_line is None and getattr(args, dest, None) != defaults.get(dest)
        ):
            continue
        setattr(args, dest, value)


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
            # ...and the lifespan ends (its client.shutdown now returns at once), rather than being cancelled
            # with a logged traceback when the second interrupt's SIGINT is raised again after serve; unless
            # uvicorn ended it already (the second interrupt came during its lifespan shutdown)
            ended = getattr(self.lifespan, "shutdown_event", None)
            if ended is not None and not ended.is_set():
                await self.lifespan.shutdown()
