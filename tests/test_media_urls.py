"""http(s) media URLs downloaded by the server (api/media_urls.py), against a real HTTP server on localhost:
bodies, HTTP errors, redirects (followed, refused, leaving the allowlist), the size limit, dead hosts,
hosts on private / loopback / link-local addresses (refused at every hop), and a video request whose
image_reference is a URL."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import socket
import threading
import time
import zlib

import pytest
from serving_helpers import png_bytes, wait_until

from worldserve.api import media_urls
from worldserve.api.media_urls import MediaFetcher, allowed_domains, blocked_address
from worldserve.api.video_inputs import build_inputs
from worldserve.params import ParamError

pytestmark = pytest.mark.anyio
PNG = png_bytes(64, 48)


ENCODED = {
    "/gzipped.png": ("gzip", gzip.compress(PNG)),
    "/deflated.png": ("deflate", zlib.compress(PNG)),
    "/bomb.png": ("gzip", gzip.compress(bytes(8 << 20))),  # 8 MiB of zeros in ~8 KB
    "/broken.png": ("gzip", PNG),
    "/brotli.png": ("br", PNG),
}


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path in ("/ref.png", "/caf%C3%A9.png", "/sp%20ace%25.png?name=%C3%A9%20x"):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/ref.png")
            self.end_headers()
        elif self.path == "/elsewhere":
            self.send_response(302)
            self.send_header("Location", "http://media.example.org/ref.png")
            self.end_headers()
        elif self.path in ENCODED:  # compressed although http.client asks for identity (as S3 serves a
            encoding, body = ENCODED[self.path]  # gzipped object)
            self.send_response(200)
            self.send_header("Content-Encoding", encoding)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/chunked":  # no Content-Length: the limit is enforced while reading
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"x" * 5000)
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def _fetch(fetcher: MediaFetcher, url: str) -> bytes:
    return await fetcher.fetch(
        url, param="image_reference", what="image_reference.image_url", kind="image", timeout_s=5
    )


async def test_downloads_and_follows_redirects(base_url):
    fetcher = MediaFetcher(max_bytes=1 << 20)
    assert await _fetch(fetcher, f"{base_url}/ref.png") == PNG
    assert await _fetch(fetcher, f"{base_url}/moved") == PNG
    # a space or a non-ASCII character is percent-encoded (UTF-8) as curl and vLLM send it, an escape already
    # there kept: they were "failed to download" (http.client's UnicodeEncodeError / InvalidURL)
    assert await _fetch(fetcher, f"{base_url}/café.png") == PNG
    assert await _fetch(fetcher, f"{base_url}/caf%C3%A9.png") == PNG
    assert await _fetch(fetcher, f"{base_url}/sp ace%25.png?name=é x") == PNG


@pytest.mark.parametrize(
    ("path", "fetcher", "message"),
    [("/missing", MediaFetcher(1 << 20), "server returned HTTP 404."),
     ("/moved", MediaFetcher(1 << 20, allow_redirects=False), "redirect response was rejected"),
     ("/elsewhere", MediaFetcher(1 << 20, allowed_domains=("127.0.0.1",)), "'media.example.org' is not in"),
     ("/ref.png", MediaFetcher(100), "larger than what is left of the 0 MiB upload limit"),
     ("/chunked", MediaFetcher(4096), "larger than"),
     ("/ref.png", MediaFetcher(1 << 20, allowed_domains=("example.com",)), "'127.0.0.1' is not in")],
)  # fmt: skip
async def test_failures_are_400s_naming_the_field(base_url, path, fetcher, message):
    with pytest.raises(ParamError) as err:
        await _fetch(fetcher, base_url + path)
    assert err.value.param == "image_reference" and message in err.value.message
    assert err.value.message.startswith("Invalid image_reference.image_url: ")


async def test_a_compressed_body_is_decoded_within_the_limit(base_url):
    """A server that compresses the body unasked (Content-Encoding gzip or deflate): the image, as vLLM's
    download (aiohttp) decodes it; it had been the compressed bytes, "not a valid image". The decoded bytes
    count against the limit (a gzip bomb stops there); an encoding not decoded is a 400 that names it."""
    fetcher = MediaFetcher(max_bytes=1 << 20)
    assert await _fetch(fetcher, f"{base_url}/gzipped.png") == PNG
    assert await _fetch(fetcher, f"{base_url}/deflated.png") == PNG
    for path, message in [
        ("/bomb.png", "larger than what is left of the 1 MiB upload limit"),
        ("/broken.png", "its body is not the compressed data its Content-Encoding says"),
        ("/brotli.png", "Content-Encoding 'br', which is not decoded here"),
    ]:
        with pytest.raises(ParamError) as err:
            await _fetch(fetcher, base_url + path)
        assert err.value.param == "image_reference" and message in err.value.message


async def test_an_unreachable_host_is_a_400():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ParamError, match="failed to download image"):
        await _fetch(MediaFetcher(1 << 20), f"http://127.0.0.1:{port}/ref.png")


def test_allowed_domains_parse_commas_and_spaces():
    assert allowed_domains(["Example.com,cdn.example.org", " .media.net "]) == (
        "example.com", "cdn.example.org", "media.net",
    )  # fmt: skip
    assert allowed_domains(None) == ()
    fetcher = MediaFetcher(1, allowed_domains=("example.com",))
    fetcher.check("https://EXAMPLE.com./a.png", "x")
    for other in ("https://img.example.com/a.png", "https://badexample.com/a.png"):  # vLLM's exact match
        with pytest.raises(ParamError, match="allowed-media-domains"):
            fetcher.check(other, "x")


async def test_a_video_request_with_an_image_url(base_url):
    fields = {"prompt": "x", "num_frames": 5, "image_reference": {"image_url": f"{base_url}/ref.png"}}
    inputs = await build_inputs(fields, served_model="m", has_sound=False, fetcher=MediaFetcher(1 << 20))
    assert inputs.reference == PNG and inputs.params.image.shape == (48, 64, 3)
    with pytest.raises(ParamError, match="does not download URLs"):
        await build_inputs(dict(fields), served_model="m", has_sound=False)  # no fetcher: refused


class RawServer:
    """A TCP server answering every connection with `reply(conn)` (bytes it trickles, or garbage); `accepted`
    counts the connections, `ends` says how each reply ended, in order: "done" (it returned), or the name of
    the OSError that ended it (the client gone: BrokenPipeError, ConnectionResetError; `_hang` giving up:
    TimeoutError)."""

    def __init__(self, reply):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/x.png"
        self.reply = reply
        self.accepted, self.ends = 0, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            try:
                conn.recv(65536)
                self.reply(conn)
                self.ends.append("done")
            except OSError as exc:
                self.ends.append(type(exc).__name__)

    def close(self):
        self.sock.close()


def _trickle(data: bytes, gap: float):
    def reply(conn):
        for i in range(len(data)):
            conn.sendall(data[i : i + 1])
            time.sleep(gap)

    return reply


@pytest.mark.parametrize(
    ("reply", "message"),
    [(_trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000, 0.01), "timed out after 1s"),
     (_trickle(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 1000, 0.01), "timed out after 1s"),
     (lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 104),
      "closed the connection 99896 bytes before the end"),  # (had been reported as a timeout, at once)
     (lambda conn: conn.sendall(b"FOO BAR\r\n\r\n"), "failed to download"),
     (lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Length: 8\r\n\r\nabcdefgh"),
      "conflicting Content-Length headers \\(4, 8\\)"),  # (the first had been read: 4 bytes of 8)
     (lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nab"), "failed to download")],
)  # fmt: skip
def test_slow_or_broken_servers_are_400s_within_the_deadline(reply, message):
    """A trickle (10 s of bytes) is cut at the 1 s deadline however its bytes come: the download fails while
    the server is still sending (it never gets to the end); the broken ones fail for what they are."""
    server = RawServer(reply)
    try:
        with pytest.raises(ParamError, match=message):
            MediaFetcher(1 << 20).fetch_blocking(server.url, param="p", kind="image", timeout_s=1.0)
        if "timed out" in message:
            assert "done" not in server.ends, server.ends
    finally:
        server.close()


def test_a_response_that_closes_itself_at_its_end(base_url, monkeypatch):
    """From Python 3.12 http.client closes a response (and its socket's file) as soon as its Content-Length
    is read; the download must not touch the socket after that. Python 3.12's read1, reproduced on any."""
    import http.client

    read1 = http.client.HTTPResponse.read1

    def read1_312(self, n=-1):
        data = read1(self, n)
        if self.length == 0 and self.fp is not None:  # (on 3.12+ the real read1 has closed it already)
            self._close_conn()
        return data

    monkeypatch.setattr(http.client.HTTPResponse, "read1", read1_312)
    assert (
        MediaFetcher(1 << 20).fetch_blocking(base_url + "/ref.png", param="p", kind="image", timeout_s=5)
        == PNG
    )


def _fake_dns(
    monkeypatch, *, hang: threading.Event | None = None, ports: dict[str, tuple[int, ...]] | None = None
) -> list[str]:
    """Patch getaddrinfo: "slow-dns.example" hangs until `hang` is set (at most 10 s); a host in `ports`
    resolves to 127.0.0.1 at those ports, in that order; any other name as the system resolves it. Returns
    the names whose lookups have returned, in order."""
    real, answered = socket.getaddrinfo, []

    def lookup(host, *args, **kwargs):
        try:
            if host == "slow-dns.example" and hang is not None:
                hang.wait(10)
            if ports and host in ports:
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", p)) for p in ports[host]]
            return real(host, *args, **kwargs)
        finally:
            answered.append(host)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    return answered


def test_a_name_lookup_that_hangs_is_cut_at_the_deadline(monkeypatch):
    """getaddrinfo takes no timeout: the lookup is waited for only until the download's deadline (the
    download fails while its lookup still hangs)."""
    hang = threading.Event()
    answered = _fake_dns(monkeypatch, hang=hang)
    try:
        with pytest.raises(ParamError, match="image download timed out after 0.5s"):
            MediaFetcher(1 << 20).fetch_blocking(
                "http://slow-dns.example/x.png", param="p", kind="image", timeout_s=0.5
            )
        assert answered == []
    finally:
        hang.set()


def test_hung_lookups_do_not_hold_up_other_hosts(base_url, monkeypatch):
    """More hanging lookups than fetch threads: each fails at its deadline, and a good host still answers at
    once (lookups run on threads of their own, not on a pool the hung ones would fill): it is answered while
    they all still hang."""
    from concurrent.futures import ThreadPoolExecutor

    hang = threading.Event()
    answered = _fake_dns(monkeypatch, hang=hang)
    fetcher = MediaFetcher(1 << 20)

    def slow(_):
        with pytest.raises(ParamError):
            fetcher.fetch_blocking("http://slow-dns.example/x.png", param="p", kind="image", timeout_s=0.3)

    try:
        with ThreadPoolExecutor(10) as pool:
            list(pool.map(slow, range(10)))
        assert fetcher.fetch_blocking(base_url + "/ref.png", param="p", kind="image", timeout_s=5) == PNG
        assert "slow-dns.example" not in answered
    finally:
        hang.set()


def test_each_address_is_tried_in_turn(base_url, monkeypatch, caplog):
    """A name with several addresses: a refused one is skipped; when all fail, the log says why (the host,
    not the path or query, which may carry a signed URL's token)."""
    port = int(base_url.rsplit(":", 1)[1])
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]  # nothing listens there once closed
    _fake_dns(monkeypatch, ports={"two.example": (dead, port), "dead.example": (dead,)})
    fetcher = MediaFetcher(1 << 20)
    assert (
        fetcher.fetch_blocking(f"http://two.example:{port}/ref.png", param="p", kind="image", timeout_s=5)
        == PNG
    )
    with pytest.raises(ParamError, match="failed to download"):
        fetcher.fetch_blocking("http://dead.example/x.png?sig=SECRET", param="p", kind="image", timeout_s=5)
    assert "dead.example" in caplog.text and "ConnectionRefusedError" in caplog.text
    assert "SECRET" not in caplog.text


@pytest.fixture(scope="module")
def https_url(tmp_path_factory):
    """An HTTPS server on localhost with a self-signed certificate: (base URL, the certificate's path)."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://localhost:{server.server_address[1]}", d / "cert.pem"
    server.shutdown()


def test_https_checks_the_certificate(https_url, monkeypatch):
    import ssl

    from worldserve.api import media_connect

    url, cert = https_url
    with pytest.raises(ParamError, match="failed to download"):  # self-signed: not trusted by default
        MediaFetcher(1 << 20).fetch_blocking(url + "/ref.png", param="p", kind="image", timeout_s=5)
    trusting = ssl.create_default_context(cafile=str(cert))
    monkeypatch.setattr(media_connect, "tls_context", lambda: trusting)
    assert MediaFetcher(1 << 20).fetch_blocking(url + "/moved", param="p", kind="image", timeout_s=5) == PNG


@pytest.mark.parametrize(
    ("url", "message"),
    [("http://[::1/x.png", "not a valid URL"), ("http://a:b@127.0.0.1/x.png", "user info"),
     ("http://127.0.0.1:99999/x.png", "not a valid URL"), ("ftp://127.0.0.1/x.png", "must be an http")],
)  # fmt: skip
def test_malformed_urls_are_400s(url, message):
    with pytest.raises(ParamError, match=message):
        MediaFetcher(1 << 20).fetch_blocking(url, param="p", kind="image", timeout_s=1.0)


def test_hosts_compare_without_case_or_trailing_dot(base_url):
    fetcher = MediaFetcher(1 << 20, allowed_domains=allowed_domains(["127.0.0.1."]))
    assert fetcher.fetch_blocking(base_url.replace("http", "HTTP") + "/ref.png", param="p", kind="image",
                                  timeout_s=5) == PNG  # fmt: skip


def _chat(*urls: str):
    from worldserve.api.chat_protocol import ChatCompletionRequest

    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "hi"}]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})


async def test_a_chat_request_shares_one_download_budget(base_url):
    from worldserve.api.chat import build_params
    from worldserve.api.chat_media import prefetch_media

    url = f"{base_url}/ref.png"
    fetcher = MediaFetcher(max_bytes=len(PNG) * 2 + 10)  # room for two downloads of the PNG, not three
    fetched = await prefetch_media(_chat(url, url), fetcher)
    params = build_params(_chat(url, url), None, fetched)
    assert [p.image.shape for p in params.messages[0].content[:2]] == [(48, 64, 3)] * 2
    with pytest.raises(ParamError) as err:  # the three downloads run at once: one of them runs out
        await prefetch_media(_chat(url, url, url), fetcher)
    assert err.value.param.startswith("messages[0].content[") and "what is left" in err.value.message
    with pytest.raises(ParamError, match="not downloaded here"):
        build_params(_chat(url), None)  # not prefetched: refused, never fetched here


async def test_chat_downloads_run_at_once_on_the_fetch_pool():
    """Three image URLs whose server answers none before all three have asked: prefetch_media fetches them at
    once, on the fetcher's own threads (not the default pool the rest of the API uses). One at a time, the
    first would never be answered (its 5 s deadline, the barrier's 10 s)."""

    from worldserve.api.chat_media import prefetch_media

    all_asked = threading.Barrier(3, timeout=10)

    def png_once_all_asked(conn):
        all_asked.wait()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(PNG) + PNG)

    server = RawServer(png_once_all_asked)
    try:
        fetched = await prefetch_media(_chat(server.url, server.url, server.url), MediaFetcher(1 << 20))
        assert list(fetched.values()) == [PNG] * 3
    finally:
        server.close()


def _hang(conn):
    """A server that never answers: it waits (at most 10 s: then a TimeoutError) for the client to give up."""
    conn.settimeout(10)
    conn.recv(1)


NO_CHAT_DEADLINE = (3600.0, 3600.0)
"""Chat downloads' deadlines out of reach: a download to `_hang` then ends only when it is stopped."""


async def test_a_failed_download_fails_the_request_at_once_and_frees_the_others_threads(base_url):
    """One of a chat's downloads fails (404): the request fails then, not when the others time out (5 s),
    and the downloads still hanging are stopped, their pool threads free at once for other requests. (Their
    own deadlines are out of reach here: what ends them is the stop.)"""
    from concurrent.futures import ThreadPoolExecutor

    from worldserve.api.chat_media import prefetch_media

    server = RawServer(_hang)
    fetcher = MediaFetcher(1 << 20, pool=ThreadPoolExecutor(2), chat_timeouts_s=NO_CHAT_DEADLINE)
    try:
        with pytest.raises(ParamError, match="HTTP 404") as err:
            await prefetch_media(_chat(server.url, f"{base_url}/missing.png", server.url), fetcher)
        assert err.value.param == "messages[0].content[1].image_url"
        assert "TimeoutError" not in server.ends  # failed before the hanging server gave up on any (10 s)
        # the hanging downloads were stopped: the server sees them leave (else it gives up on them at 10 s)
        await asyncio.to_thread(wait_until, lambda: len(server.ends) == server.accepted, 5)
        # both threads free again: another request's image comes (it had waited for a thread past its 5 s)
        assert await _fetch(fetcher, f"{base_url}/ref.png") == PNG
    finally:
        server.close()


async def test_a_download_waiting_for_a_thread_is_on_its_deadline_and_a_left_client_stops_them(base_url):
    """The deadline counts from the request (vLLM's is a timeout on the request's download, which has no
    thread to wait for): an image stuck behind a full pool times out when its time is up. A request
    cancelled (its client left) stops its downloads."""
    from concurrent.futures import ThreadPoolExecutor

    from worldserve.api.chat_media import prefetch_media

    server = RawServer(_hang)
    fetcher = MediaFetcher(1 << 20, pool=ThreadPoolExecutor(1), chat_timeouts_s=NO_CHAT_DEADLINE)
    try:
        hung = asyncio.ensure_future(fetcher.fetch(server.url, param="a", kind="image", timeout_s=1.5))
        await asyncio.sleep(0.1)
        with pytest.raises(ParamError, match="timed out after 0.5s"):  # (still waiting for the thread)
            await fetcher.fetch(f"{base_url}/ref.png", param="b", kind="image", timeout_s=0.5)
        with pytest.raises(ParamError, match="timed out after 1.5s"):
            await hung
        assert "TimeoutError" not in server.ends  # its own deadline ended it, not the server giving up (10 s)
        chat = asyncio.ensure_future(prefetch_media(_chat(server.url), fetcher))
        await asyncio.sleep(0.3)
        chat.cancel()  # what unless_disconnected does when the client leaves
        # the pool's one thread is free again: the chat's download, whose own deadline is out of reach, was
        # stopped (else this waits for the thread past its 5 s deadline)
        assert await _fetch(fetcher, f"{base_url}/ref.png") == PNG
    finally:
        server.close()


async def test_limit_mm_per_prompt_is_checked_before_loading(base_url):
    from worldserve.api.chat import build_params
    from worldserve.api.chat_media import prefetch_media
    from worldserve.config import FlagValueError, MediaLimits

    limits = MediaLimits('{"image": 1, "video": 0}')
    assert dict(limits) == {"image": 1, "video": 0} and str(limits) == '{"image": 1, "video": 0}'
    newer = MediaLimits(
        '{"image": {"count": 1, "width": 512, "height": 512}, "video": {"count": 0, "num_frames": 32}}'
    )
    assert (
        newer == limits
    )  # newer vLLM's per-modality objects: their count (the size keys size its profiling)
    # an object without count counts 999, as vLLM's (vllm/config/multimodal.py BaseDummyOptions.count)
    assert dict(MediaLimits('{"video": {"num_frames": 8}}')) == {"video": 999}
    # vLLM's other modality, which the Reasoner takes none of: 0 is accepted (and dropped), more is refused
    assert MediaLimits('{"image": 1, "video": 0, "audio": 0}') == limits
    with pytest.raises(FlagValueError, match="^audio: 1: the Reasoner takes images and videos only"):
        MediaLimits('{"image": 1, "audio": 1}')
    bad_values = ('{"audio": 1}', '{"audio": {"num_frames": 8}}', '{"speech": 0}', '{"image": -1}', '{"image": 1.5}', "[1]", '{"image": {"count": -1}}',
                  '{"image": {"count": 2, "fps": 2}}', '{"video": {"count": 1.5}}')  # fmt: skip
    for bad in bad_values:
        with pytest.raises(FlagValueError):
            MediaLimits(bad)
    url = "http://127.0.0.1:9/never-fetched.png"  # refused before any download
    with pytest.raises(ParamError, match=r"At most 1 image\(s\) may be provided in one request"):
        await prefetch_media(_chat(url, url), MediaFetcher(1 << 20), dict(limits))
    one = _chat(f"{base_url}/ref.png")
    assert build_params(one, None, await prefetch_media(one, MediaFetcher(1 << 20), dict(limits)))


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf", "1e12"])
def test_bad_fetch_timeouts_stop_the_start_not_each_request(monkeypatch, tmp_path, value):
    from serving_helpers import make_client

    from worldserve.api.app import build_app

    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", value)
    with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT"):
        build_app(make_client(tmp_path))
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2.5")
    assert build_app(make_client(tmp_path / "b")).state.ws.media.chat_timeout_s("image") == 2.5


@pytest.mark.parametrize(
    ("ip", "blocked"),
    [("127.0.0.1", True), ("10.1.2.3", True), ("192.168.0.1", True), ("169.254.169.254", True), ("0.0.0.0", True),
     ("224.0.0.1", True), ("100.64.0.1", True), ("::1", True), ("fe80::1%eth0", True), ("fd00::1", True),
     ("::ffff:169.254.169.254", True), ("2002:7f00:1::", True), ("64:ff9b::7f00:1", True), ("fec0::1", True),
     ("8.8.8.8", False), ("2606:4700:4700::1111", False), ("::ffff:8.8.8.8", False)],
)  # fmt: skip
def test_blocked_addresses(ip, blocked):
    assert blocked_address(ip) is blocked


def test_private_addresses_are_blocked_by_default(monkeypatch):
    monkeypatch.delenv("WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES")
    assert MediaFetcher(1).block_private
    monkeypatch.setenv("WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES", "1")
    assert not MediaFetcher(1).block_private


async def test_a_private_host_the_allowlist_names_is_downloaded(base_url):
    """An operator's internal media server, named in --allowed-media-domains, is trusted by that name."""
    fetcher = MediaFetcher(1 << 20, block_private=True, allowed_domains=("localhost",))
    assert await _fetch(fetcher, base_url.replace("127.0.0.1", "localhost") + "/ref.png") == PNG
    with pytest.raises(ParamError, match="not in --allowed-media-domains"):
        await _fetch(fetcher, f"{base_url}/ref.png")  # 127.0.0.1 is not named


async def test_a_host_resolving_to_a_private_address_is_refused_at_every_hop(base_url, monkeypatch):
    fetcher = MediaFetcher(1 << 20, block_private=True)
    hits = []
    monkeypatch.setattr(Handler, "log_message", lambda self, *args: hits.append(self.path))
    for url in (f"{base_url}/ref.png", base_url.replace("127.0.0.1", "localhost") + "/ref.png"):
        with pytest.raises(ParamError, match="resolves to a private, loopback or link-local address") as err:
            await _fetch(fetcher, url)
        assert err.value.param == "image_reference" and "127.0.0.1" not in err.value.message
    assert hits == []  # refused before connecting
    checked = []  # the first hop passes, the redirect's target (127.0.0.1 too) is checked again and refused
    monkeypatch.setattr(media_urls, "blocked_address", lambda ip: checked.append(ip) or len(checked) > 1)
    with pytest.raises(ParamError, match="resolves to a private"):
        await _fetch(fetcher, f"{base_url}/moved")
    assert checked == ["127.0.0.1", "127.0.0.1"] and hits == ["/moved"]
