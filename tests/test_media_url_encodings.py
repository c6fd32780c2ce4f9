"""Compressed bodies of downloaded media (api/content_encoding.py through api/media_urls.py), from a real HTTP
server on localhost: `Content-Encoding: deflate` as the zlib format and as the raw deflate some servers send
(browsers, curl, httpx and urllib3 read both), each within the upload limit that stops a compression bomb."""

from __future__ import annotations

import gzip
import http.server
import threading
import zlib

import pytest
from serving_helpers import png_bytes

from worldserve.api.content_encoding import BodyDecoder, body_decoder
from worldserve.api.media_urls import DownloadBudget, MediaFetcher
from worldserve.params import ParamError

PNG = png_bytes(64, 48)
BOMB = bytes(8 << 20)
"""8 MiB of zeros: ~8 KB compressed, eight times the 1 MiB limit of the fetchers below."""


def raw_deflate(data: bytes) -> bytes:
    """Deflate data with no zlib header or checksum (RFC 1951), as some servers label `deflate`."""
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


BODIES = {
    "/zlib.png": ("deflate", zlib.compress(PNG)),
    "/raw.png": ("deflate", raw_deflate(PNG)),
    "/gzip-as-deflate.png": ("deflate", gzip.compress(PNG)),
    "/raw-bomb.png": ("deflate", raw_deflate(BOMB)),
    "/zlib-bomb.png": ("deflate", zlib.compress(BOMB)),
    "/not-deflate.png": ("deflate", PNG),
    "/one-byte.png": ("deflate", b"\x03"),
    "/cut-raw.png": ("deflate", raw_deflate(PNG)[:-3]),
    "/empty-raw.png": ("deflate", raw_deflate(b"")),
    "/two-members.png": ("gzip", gzip.compress(PNG[:100]) + gzip.compress(PNG[100:])),
    "/member-bomb.png": ("gzip", gzip.compress(PNG[:100]) + gzip.compress(BOMB)),
}


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path not in BODIES:
            self.send_error(404)
            return
        encoding, body = BODIES[self.path]
        self.send_response(200)
        self.send_header("Content-Encoding", encoding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _fetch(url: str, budget: DownloadBudget | None = None) -> bytes:
    return MediaFetcher(max_bytes=1 << 20).fetch_blocking(
        url,
        param="image_reference",
        what="image_reference.image_url",
        kind="image",
        timeout_s=5,
        budget=budget,
    )


@pytest.mark.parametrize("path", ["/zlib.png", "/raw.png", "/gzip-as-deflate.png"])
def test_deflate_is_read_with_or_without_its_zlib_header(base_url, path):
    """Raw deflate had been refused ("not the compressed data its Content-Encoding says") where browsers,
    curl and httpx show the image."""
    assert _fetch(base_url + path) == PNG


@pytest.mark.parametrize("path", ["/raw-bomb.png", "/zlib-bomb.png"])
def test_a_deflate_bomb_stops_at_the_upload_limit_either_way(base_url, path):
    """8 KB that inflate to 8 MiB: refused at the 1 MiB limit, raw or zlib-wrapped, and the bytes it had
    taken are given back to the request's budget."""
    budget = DownloadBudget(1 << 20)
    with pytest.raises(ParamError) as err:
        _fetch(base_url + path, budget)
    assert "larger than what is left of the 1 MiB upload limit" in err.value.message
    assert budget.left == 1 << 20


@pytest.mark.parametrize("path", ["/not-deflate.png", "/one-byte.png", "/cut-raw.png"])
def test_a_body_that_is_deflate_neither_way_or_cut_short_is_a_400(base_url, path):
    """Not deflate data, or a deflate stream the body stops inside (as aiohttp, vLLM's download, refuses it):
    a 400 that says so, not the bytes that came."""
    with pytest.raises(ParamError) as err:
        _fetch(base_url + path)
    assert err.value.param == "image_reference"
    assert "its body is not the compressed data its Content-Encoding says" in err.value.message


def test_an_empty_raw_deflate_stream_is_an_empty_body(base_url):
    assert _fetch(base_url + "/empty-raw.png") == b""


@pytest.mark.parametrize("body", [zlib.compress(PNG), raw_deflate(PNG)], ids=["zlib", "raw"])
def test_deflate_split_a_byte_a_read_decodes_the_same(body):
    """However the body is cut into reads (here a byte each: the zlib header is judged once both its bytes
    are in), the image is the same."""
    decoder = body_decoder("deflate")
    assert isinstance(decoder, BodyDecoder)
    out = b"".join(decoder.decode(body[i : i + 1], 1 << 20) for i in range(len(body)))
    assert out + decoder.finish(1 << 20) == PNG


def test_each_chunk_inflates_to_at_most_its_limit():
    """What a raw chunk inflates to is cut at `limit` (the caller's budget, plus one byte), fallback or not."""
    for body in (raw_deflate(BOMB), zlib.compress(BOMB)):
        decoder = body_decoder("deflate")
        assert decoder is not None and len(decoder.decode(body, 1000)) == 1000


def test_a_gzip_body_of_several_members_is_read_whole(base_url):
    """A gzip body of two members (`gzip -c a b`): both read, as Python's gzip, curl and browsers read them
    (the bytes after the first member were dropped: a truncated image); a bomb in a later member stops at the
    upload limit as a first one does."""
    assert _fetch(base_url + "/two-members.png") == PNG
    with pytest.raises(ParamError, match="limit|large|MB"):
        _fetch(base_url + "/member-bomb.png")


def test_members_split_a_byte_a_read_decode_the_same():
    body = gzip.compress(PNG[:100]) + gzip.compress(PNG[100:])
    decoder = body_decoder("gzip")
    assert isinstance(decoder, BodyDecoder)
    out = b"".join(decoder.decode(body[i : i + 1], 1 << 20) for i in range(len(body)))
    assert out + decoder.finish(1 << 20) == PNG
