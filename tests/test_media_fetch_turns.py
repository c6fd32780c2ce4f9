"""How media downloads share the fetcher's pool (api/media_urls.py), against real servers on localhost: a video
request's URL download stops when its client leaves (over a real uvicorn), one request holds at most
REQUEST_FETCH_THREADS pool threads, and a download waiting for a thread fails on its deadline and never runs
after it."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving_helpers import png_bytes, uvicorn_thread, wait_until
from test_media_urls import RawServer

from worldserve.api.chat_protocol import ChatCompletionRequest
from worldserve.api.media_urls import FETCH_THREADS, REQUEST_FETCH_THREADS, MediaFetcher
from worldserve.params import ParamError

pytestmark = pytest.mark.anyio
PNG = png_bytes(8, 8)
NO_CHAT_DEADLINE = (3600.0, 3600.0)
"""Chat downloads' deadlines out of reach: a download from `hanging` then ends only when it is stopped."""


def _until_the_client_leaves(conn: socket.socket) -> None:
    """A reply of nothing: it waits (at most 10 s, then RawServer's "TimeoutError") for the client to leave
    ("done": the download's socket shut)."""
    conn.settimeout(10)
    while conn.recv(65536):
        pass


class PngHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args):
        pass


@pytest.fixture
def hanging():
    server = RawServer(_until_the_client_leaves)
    yield server
    server.close()


@pytest.fixture
def fast():
    """A server answering every GET with a PNG at once; `.paths` lists the paths asked for."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PngHandler)
    server.paths = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield server
    server.shutdown()


def _chat(*urls: str) -> ChatCompletionRequest:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "hi"}]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})


@pytest.mark.parametrize(("route", "field"), [("/v1/videos", "video"), ("/v1/videos/sync", "image")])
def test_a_video_requests_download_stops_when_its_client_leaves(tmp_path, hanging, route, field):
    """The reference's download (vLLM-Omni's 60 s deadline) is stopped as soon as the client hangs up, its
    connection shut and its pool thread free: it had run on to its deadline (the video routes fetched without
    a budget, and cancelling the await left the thread downloading), 34 such clients holding every thread."""
    body = b'{"prompt": "x", "%s_reference": {"%s_url": "%s"}}' % (field.encode(), field.encode(),
                                                                  hanging.url.encode())  # fmt: skip
    with uvicorn_thread(tmp_path) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (route.encode(), len(body), body))  # fmt: skip
            wait_until(lambda: hanging.accepted == 1)
        # the client has left: the download's socket is shut (else it waits on, and the server gives up at 10 s)
        wait_until(lambda: hanging.ends, timeout=5)
        assert hanging.ends == ["done"]


async def test_one_request_takes_its_share_of_the_pool_not_all_of_it(hanging, fast):
    """A chat with a URL part for each pool thread, at a host that never answers: it holds only
    REQUEST_FETCH_THREADS threads (its other downloads wait their turn), so another request's image still
    comes at once (it had waited behind all FETCH_THREADS, and timed out)."""
    from worldserve.api.chat_media import prefetch_media

    fetcher = MediaFetcher(1 << 20, chat_timeouts_s=NO_CHAT_DEADLINE)
    hog = asyncio.ensure_future(prefetch_media(_chat(*[hanging.url] * FETCH_THREADS), fetcher))
    try:
        await asyncio.to_thread(wait_until, lambda: hanging.accepted == REQUEST_FETCH_THREADS)
        image = await fetcher.fetch(
            f"{fast.url}/other.png", param="image_reference", kind="image", timeout_s=5
        )
        assert image == PNG and not hog.done()
        assert (
            hanging.accepted == REQUEST_FETCH_THREADS
        )  # the rest of the chat's downloads still wait their turn
    finally:
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
    await asyncio.to_thread(wait_until, lambda: len(hanging.ends) == hanging.accepted)
    # the chat's cancellation stopped them; the waiting ones never started
    assert set(hanging.ends) == {"done"}


class CountingPool(ThreadPoolExecutor):
    """A pool that counts the calls it ran (started)."""

    ran = 0

    def submit(self, fn, /, *args, **kwargs):
        def counted():
            self.ran += 1
            return fn(*args, **kwargs)

        return super().submit(counted)


async def test_a_download_waiting_for_a_thread_fails_on_its_deadline_and_never_runs(hanging, fast):
    """The deadline holds while a download waits for a pool thread: it fails when its time is up, while the
    thread's holder still runs (it had waited until a thread came free, 29 s for a 5 s image), and its job,
    dropped from the pool's queue, never runs once a thread is free."""
    pool = CountingPool(1)
    fetcher = MediaFetcher(1 << 20, pool=pool)
    holder = asyncio.ensure_future(fetcher.fetch(hanging.url, param="a", kind="video", timeout_s=3600))
    try:
        await asyncio.to_thread(wait_until, lambda: hanging.accepted == 1)
        with pytest.raises(ParamError, match=r"^Invalid b: the image download timed out after 0.2s") as err:
            await fetcher.fetch(f"{fast.url}/late.png", param="b", kind="image", timeout_s=0.2)
        assert err.value.param == "b" and not holder.done()
    finally:
        holder.cancel()  # its own budget, cancelled: the thread is free at once
        await asyncio.gather(holder, return_exceptions=True)
    image = await fetcher.fetch(f"{fast.url}/next.png", param="c", kind="image", timeout_s=5)
    assert image == PNG and fast.paths == ["/next.png"] and pool.ran == 2  # the holder and this one
    assert hanging.ends == ["done"]
    pool.shutdown()


class SlowPngHandler(PngHandler):
    def do_GET(self):  # noqa: N802
        import time

        time.sleep(0.4)
        super().do_GET()


async def test_a_requests_own_queue_of_downloads_does_not_spend_their_deadlines():
    """A request with three times REQUEST_FETCH_THREADS images, each 0.4 s from its host, under a 1 s deadline:
    all arrive. Each deadline runs from the download's turn in its request (counted from the call, the third
    wave, starting at ~0.8 s, timed out: the request's own cap was its undoing)."""
    from worldserve.api.media_urls import DownloadBudget

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowPngHandler)
    server.paths = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        fetcher, budget = MediaFetcher(1 << 20), DownloadBudget(1 << 20)
        many = 3 * REQUEST_FETCH_THREADS
        got = await asyncio.gather(*(
            fetcher.fetch(f"{url}/{i}.png", param=f"p{i}", kind="image", timeout_s=1.0, budget=budget)
            for i in range(many)
        ))  # fmt: skip
        assert got == [PNG] * many
    finally:
        server.shutdown()
