"""http(s) media URLs in requests, downloaded by the server (serving-api.md §4.3 for video references,
§11.2 for chat parts), as vLLM-Omni and vLLM do.

`MediaFetcher.fetch(url, ...)` downloads off the event loop, on its own thread pool (slow remote servers
cannot starve the threads the rest of the API uses); `fetch_blocking` does the same on the calling thread.
The downloads of one request share a `DownloadBudget`: its bytes; its turns on the pool (at most
REQUEST_FETCH_THREADS of its downloads hold a thread at once, so one request's slow hosts cannot take every
thread from the others); and `cancel()`, which ends every download of the request at once (its socket shut,
the thread freed) when one has failed or the client has left. `fetch` given no budget makes one of its own,
cancelled when `fetch` is (a video request's reference, its client gone). The deadline counts from the
download's turn in its request and is kept while waiting for a pool thread too: a download still waiting
when it passes fails then, and never starts. The standard library's
http.client does the HTTP (no new dependency; environment proxies are not used). A download has a total deadline, `timeout_s` (vLLM-Omni's 60 s for references; vLLM's
`VLLM_IMAGE_FETCH_TIMEOUT` / `VLLM_VIDEO_FETCH_TIMEOUT` for chat media), enforced across the name lookup
(on a thread of its own: getaddrinfo takes no timeout), each address's connect, the TLS handshake, every
redirect hop, the headers and the body: a timer shuts the sockets down when it passes, so a server that
trickles bytes is cut off too. Bodies are limited to `max_bytes` (the upload limit), redirects followed
(at most 10, each target checked again) unless `VLLM_MEDIA_URL_ALLOW_REDIRECTS=0`. Every failure is a
ParamError (a 400) naming the field, in vLLM-Omni's words: `Invalid image_reference.image_url: failed to
download image.`, `... server returned HTTP 404.`, `... redirect response was rejected ...`. A body sent
compressed (gzip; deflate, zlib-wrapped or raw) is decoded within the same byte limit (api/content_encoding.py).
The name lookup, the address checks and the connect live in api/media_connect.py.

Security: like vLLM, `--allowed-media-domains` names the hosts allowed, exactly (any other host, a subdomain
of a named one and redirects included, is a 400). Stricter than vLLM (which fetches any address by default: vllm-project/vllm#57157), a host that
resolves to a private, loopback, link-local (cloud metadata), multicast or reserved address is refused at
every hop unless the allowlist names it (an operator's internal object store) or the operator sets
WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES=1; the addresses checked are the ones connected to (no second
lookup a DNS rebinding could change). Deployments that take requests from untrusted clients should still set
the allowlist: public hosts are fetched too.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import logging
import socket
import threading
import time
import urllib.parse
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from worldserve import __version__, envs
from worldserve.api.content_encoding import BodyDecoder, UnsupportedEncoding, body_decoder
from worldserve.api.media_connect import blocked_address, connect, expire, resolve, time_left, tls_context
from worldserve.lasting_pool import LastingThreadPool
from worldserve.params import ParamError

log = logging.getLogger(__name__)

CHUNK = 1 << 16
MAX_REDIRECTS = 10
FETCH_THREADS = 32
"""Downloads in flight at once, all requests together (more wait for a thread, their deadline running)."""
REQUEST_FETCH_THREADS = 8
"""Pool threads the downloads of one request hold at once (its others wait their turn, their deadlines running):
a chat of 32 video URLs at a host that trickles its bytes held all FETCH_THREADS, and every other request's
downloads waited behind it (vLLM's aiohttp fetch shares one session's 100 connections, no per-request share)."""


def is_http_url(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


class _Failed(Exception):
    """A download failure; its message is the client-facing reason."""


URL_SAFE = "/%:@!$&'()*+,;=-._~?"
"""What a request target keeps as it is (RFC 3986's reserved and unreserved characters and the % of an escape
already there); a space, a non-ASCII character and the like are percent-encoded (UTF-8), as vLLM's, curl's and
browsers' requests send them."""


def request_target(parts: urllib.parse.SplitResult) -> str:
    """The path and query of `parts` as the GET's request target: `/café.jpg` as `/caf%C3%A9.jpg` (it failed,
    "failed to download", a UnicodeEncodeError in http.client; a space an InvalidURL)."""
    path = urllib.parse.quote(parts.path or "/", safe=URL_SAFE)
    query = urllib.parse.quote(parts.query, safe=URL_SAFE)
    return path + ("?" + query if query else "")


@dataclass(frozen=True, slots=True)
class MediaFetcher:
    max_bytes: int
    """The largest download accepted (the server's upload limit)."""
    allowed_domains: tuple[str, ...] = ()
    """Hosts media may come from (exact names, as vLLM matches them); empty: any host."""
    allow_redirects: bool = True
    chat_timeouts_s: tuple[float, float] = field(
        default_factory=lambda: (envs.media_fetch_timeout_s("image"), envs.media_fetch_timeout_s("video"))
    )
    """Deadlines of a chat's image and video downloads (vLLM's VLLM_IMAGE_FETCH_TIMEOUT / VIDEO_FETCH)."""
    block_private: bool = field(default_factory=lambda: not envs.media_allow_private_addresses())
    """Refuse hosts outside `allowed_domains` that resolve to a non-public address (blocked_address)."""
    pool: ThreadPoolExecutor = field(
        # (serving through the interpreter's exit: an offline Engine's chat in a thread Python waits for)
        default_factory=lambda: LastingThreadPool(FETCH_THREADS, thread_name_prefix="media-fetch"),
        compare=False,
    )

    def chat_timeout_s(self, kind: str) -> float:
        return self.chat_timeouts_s[0] if kind == "image" else self.chat_timeouts_s[1]

    def check(self, url: str, param: str, what: str | None = None) -> urllib.parse.SplitResult:
        """The parts of `url`; ParamError(param) unless it is http(s) with a host the allowlist admits."""
        what = what or param
        try:
            parts = urllib.parse.urlsplit(url)
            host = (parts.hostname or "").rstrip(".").lower()
            parts.port  # noqa: B018  (a bad port raises here)
        except ValueError:
            raise ParamError(param, f"Invalid {what}: not a valid URL.") from None
        if parts.scheme.lower() not in ("http", "https") or not host:
            raise ParamError(param, f"Invalid {what}: must be an http(s) URL or data URL.")
        if parts.username is not None or parts.password is not None:
            raise ParamError(param, f"Invalid {what}: URLs with user info (user@host) are not fetched.")
        if self.allowed_domains and not self._named(host):
            raise ParamError(param, f"Invalid {what}: host {host!r} is not in --allowed-media-domains.")
        return parts

    def _named(self, host: str) -> bool:
        """Whether --allowed-media-domains names `host` (vLLM's exact match: a subdomain is not named)."""
        return host in self.allowed_domains

    async def fetch(
        self, url: str, *, param: str, kind: str, timeout_s: float, what: str | None = None,
        budget: DownloadBudget | None = None,
    ) -> bytes:  # fmt: skip
        """The body at `url`, downloaded on the fetcher's own threads; `kind` is the media ("image",
        "video"), `what` names the URL in messages (default `param`; e.g. "image_reference.image_url" for the
        field "image_reference"), `budget` the bytes and pool turns it shares with its request's other
        downloads (none: a budget of its own, cancelled, its download stopped, when this is cancelled; a
        shared one is its owner's to cancel). ParamError(param) (a 400) on any failure. `timeout_s` counts
        from its request's turn (the request's own earlier downloads are not another's to wait for: a chat of
        20 images from a slow host would have timed out its last ones), waiting for a pool thread included."""
        self.check(url, param, what)
        own = budget is None
        budget = DownloadBudget(self.max_bytes) if budget is None else budget
        try:
            async with budget.turns:
                deadline = time.monotonic() + timeout_s
                download = functools.partial(
                    self.fetch_blocking, url, param=param, kind=kind, timeout_s=timeout_s, what=what,
                    budget=budget, deadline=deadline,
                )  # fmt: skip
                # (cancelled while still queued, the job never runs: the pool drops a cancelled future; and
                # past its deadline, or its budget cancelled, it would fail before connecting)
                # (a second past it: one that started fails on its own deadline, with its own words)
                return await asyncio.wait_for(
                    asyncio.wrap_future(self.pool.submit(download)), timeout_s + 1.0
                )
        except TimeoutError:
            # (still waiting for a thread: a download that had started fails on its own deadline)
            log.warning("%s: timed out waiting for a download thread", what or param)
            raise ParamError(param, _timed_out(what or param, kind, timeout_s)) from None
        except asyncio.CancelledError:
            if own:
                budget.cancel()
            raise

    def fetch_blocking(
        self, url: str, *, param: str, kind: str, timeout_s: float, what: str | None = None,
        budget: DownloadBudget | None = None, deadline: float | None = None,
    ) -> bytes:  # fmt: skip
        """`fetch` on the calling thread; `budget`: bytes shared with the request's other downloads (default:
        this download alone may take the fetcher's `max_bytes`); `deadline` (monotonic): `timeout_s` from now
        unless given."""
        what = what or param
        budget = budget if budget is not None else DownloadBudget(self.max_bytes)
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        try:
            for _ in range(MAX_REDIRECTS + 1):
                parts = self.check(url, param, what)
                status, location, body = self._get(parts, deadline, what, kind, budget)
                if location is None:
                    if status >= 400:
                        raise _Failed(f"Invalid {what}: server returned HTTP {status}.")
                    return body
                if not self.allow_redirects:
                    raise _Failed(
                        f"Invalid {what}: redirect response was rejected (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)."
                    )
                url = urllib.parse.urljoin(url, location)
            raise _Failed(f"Invalid {what}: more than {MAX_REDIRECTS} redirects.")
        except ParamError:
            raise
        except _Failed as exc:
            raise ParamError(param, str(exc)) from None
        except (OSError, ValueError, OverflowError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or time.monotonic() >= deadline:  # (the timer's shutdown: any)
                log.warning("%s: GET from %s timed out", what, urllib.parse.urlsplit(url).hostname)
                raise ParamError(param, _timed_out(what, kind, timeout_s)) from None
            # the client hears only that it failed; the log keeps why (the host, not the URL's path or query)
            strerror = getattr(exc, "strerror", None)  # (OSError's; the others have none)
            why = f"{type(exc).__name__}: {strerror}" if strerror else type(exc).__name__
            log.warning("%s: GET from %s failed (%s)", what, urllib.parse.urlsplit(url).hostname, why)
            raise ParamError(param, f"Invalid {what}: failed to download {kind}.") from None

    def _get(
        self, parts: urllib.parse.SplitResult, deadline: float, what: str, kind: str, budget: DownloadBudget
    ) -> tuple[int, str | None, bytes]:
        """One GET: (status, redirect location or None, body). Past `deadline` it fails: the name lookup,
        each connect attempt and the TLS handshake get the time left, and a timer shuts the socket down under
        any blocked read, which also gets at most the time left."""
        remaining = time_left(deadline)
        assert parts.hostname is not None  # check() refused a URL without a host
        host = parts.hostname.rstrip(".")
        https = parts.scheme.lower() == "https"
        port = parts.port or (443 if https else 80)
        conn: http.client.HTTPConnection
        if https:  # (given the context: its own default one would load the CA store again, unused)
            conn = http.client.HTTPSConnection(host, port, context=tls_context())
        else:
            conn = http.client.HTTPConnection(host, port)
        held: list[socket.socket] = []  # the sockets made (the response may own the last one)
        expired = threading.Event()
        stop = functools.partial(expire, held, expired)
        if not budget.attach(stop):
            raise _Failed(f"Invalid {what}: cancelled (another download of the request failed).")
        timer = threading.Timer(remaining, stop)
        timer.daemon = True
        timer.start()
        try:
            addresses = resolve(host, port, deadline)
            private = self.block_private and not self._named(host)
            if private and (blocked := [a[4][0] for a in addresses if blocked_address(a[4][0])]):
                log.warning("%s: %s resolves to %s: not downloaded (a private, loopback or link-local address; "
                            "name the host in --allowed-media-domains, or set "
                            "WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES=1)", what, host, blocked[0])  # fmt: skip
                raise _Failed(f"Invalid {what}: its host resolves to a private, loopback or link-local address, "
                              "from which media are not downloaded.")  # fmt: skip
            # (connected here, to the addresses checked: http.client connects no more)
            conn.sock = sock = connect(host, addresses, https, deadline, held)
            if expired.is_set() or time.monotonic() > deadline:  # the timer fired before there was a socket
                raise TimeoutError
            path = request_target(parts)
            conn.request("GET", path, headers={"User-Agent": f"worldserve/{__version__}", "Accept": "*/*"})
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                return resp.status, resp.getheader("Location"), b""
            if resp.status >= 400:
                return resp.status, None, b""
            lengths = {v.strip() for v in resp.msg.get_all("Content-Length") or ()}
            if len(lengths) > 1:  # (RFC 9112 §6.3: an unrecoverable error; http.client read the first)
                raise _Failed(f"Invalid {what}: the server sent conflicting Content-Length headers "
                              f"({', '.join(sorted(lengths))[:100]}).")  # fmt: skip
            declared = resp.getheader("Content-Length")
            if declared is not None and declared.strip().isdigit() and int(declared) > budget.left:
                raise _Failed(self._too_large(what, kind))
            decoder = _body_decoder(resp.getheader("Content-Encoding"), what)
            return (
                resp.status,
                None,
                self._read_body(resp, sock, decoder, deadline, expired, budget, what, kind),
            )
        finally:
            budget.detach(stop)
            timer.cancel()
            conn.close()

    def _read_body(
        self, resp: http.client.HTTPResponse, sock: socket.socket, decoder: BodyDecoder | None, deadline: float,
        expired: threading.Event, budget: DownloadBudget, what: str, kind: str,
    ) -> bytes:  # fmt: skip
        """The body, decoded by `decoder` (its Content-Encoding's), its bytes taken from `budget` as they
        come (all given back when it fails: a failed download frees what it had taken); each read gets the
        time left to `deadline`, and the timer's shutdown (`expired`) is a TimeoutError."""
        chunks: list[bytes] = []

        def keep(data: bytes) -> None:
            if not budget.take(len(data)):
                raise _Failed(self._too_large(what, kind))
            chunks.append(data)

        try:
            # From Python 3.12 the response closes itself, and the socket's file, once its Content-Length is
            # read: a settimeout after that is EBADF (every download failed on 3.12 before this check).
            while not resp.isclosed():
                if expired.is_set():
                    raise TimeoutError
                sock.settimeout(time_left(deadline))
                chunk = resp.read1(CHUNK)
                if not chunk:  # the end, or the timer's shutdown, or the server hung up early
                    if expired.is_set():
                        raise TimeoutError
                    if resp.length:  # bytes Content-Length still promised: cut short, not slow
                        raise _Failed(f"Invalid {what}: the server closed the connection {resp.length} bytes "
                                      f"before the end of the {kind} it announced.")  # fmt: skip
                    break
                # (a compressed chunk inflates to at most one byte past the budget: a bomb stops there)
                keep(chunk if decoder is None else _decoded(decoder, chunk, budget.left + 1, what))
            if decoder is not None:
                keep(_decoded(decoder, None, budget.left + 1, what))
        except BaseException:
            budget.give_back(sum(map(len, chunks)))
            raise
        return b"".join(chunks)

    def _too_large(self, what: str, kind: str) -> str:
        return (f"Invalid {what}: the {kind} is larger than what is left of the {self.max_bytes >> 20} MiB "
                "upload limit (one request's downloads share it).")  # fmt: skip


def _timed_out(what: str, kind: str, timeout_s: float) -> str:
    return (f"Invalid {what}: the {kind} download timed out after {timeout_s:g}s (the server did not send it "
            "whole in time).")  # fmt: skip


def _body_decoder(encoding: str | None, what: str) -> BodyDecoder | None:
    """The decoder of a body sent with `Content-Encoding: encoding` (api/content_encoding.py: gzip, and
    deflate with or without its zlib header), None for one sent as it is; another encoding (br, zstd, ...) is
    a _Failed that names it."""
    try:
        return body_decoder(encoding)
    except UnsupportedEncoding:
        raise _Failed(f"Invalid {what}: the server sent it with Content-Encoding {encoding!r}, which is not "
                      "decoded here (gzip and deflate are).") from None  # fmt: skip


def _decoded(decoder: BodyDecoder, chunk: bytes | None, limit: int, what: str) -> bytes:
    """`chunk` of a compressed body decompressed (None: what is left once the body has ended), at most
    `limit` bytes of it (`limit` reached: the caller's budget refuses it, so a small body that inflates to
    gigabytes is never held); _Failed when it is not the compressed data its Content-Encoding says."""
    try:
        return decoder.take(chunk, limit)
    except zlib.error:
        raise _Failed(
            f"Invalid {what}: its body is not the compressed data its Content-Encoding says."
        ) from None


class DownloadBudget:
    """What the downloads of one request share (thread-safe: they run concurrently): the bytes they may take
    together, their `turns` on the fetcher's pool (REQUEST_FETCH_THREADS at once; taken on the event loop),
    and `cancel()`, which stops them all (a download started after it fails at once)."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.turns = asyncio.Semaphore(REQUEST_FETCH_THREADS)
        self._lock = threading.Lock()
        self._stops: set[functools.partial] = set()  # each live download's media_connect.expire
        self.cancelled = False

    def attach(self, stop: functools.partial) -> bool:
        """Register a starting download's stop; False once the request is cancelled."""
        with self._lock:
            if not self.cancelled:
                self._stops.add(stop)
            return not self.cancelled

    def detach(self, stop: functools.partial) -> None:
        with self._lock:
            self._stops.discard(stop)

    def cancel(self) -> None:
        """Stop every download of the request: its socket is shut, so its thread is free at once."""
        with self._lock:
            self.cancelled, stops = True, list(self._stops)
        for stop in stops:
            stop()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self.left += n


def allowed_domains(values: Sequence[str] | None) -> tuple[str, ...]:
    """`--allowed-media-domains` values (space- or comma-separated) as lower-case hosts."""
    hosts = [h.strip().lower().strip(".") for v in values or () for h in v.split(",")]
    return tuple(h for h in hosts if h)
