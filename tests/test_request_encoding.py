"""Request bodies sent with a `Content-Encoding`: gzip and deflate (zlib or raw) undone on every route that
reads a body (JSON routes, /invocations' second read, the video forms), the --max-upload-mb limit counted on
the inflated bytes (a small bomb is a 413, never held), another encoding a 415 naming the header, bytes that
do not inflate a 400 (they had been read as the JSON itself: "Invalid JSON body: 'utf-8' codec can't
decode byte 0x8b")."""

from __future__ import annotations

import gzip
import json
import zlib

import httpx
import pytest
from serving_helpers import asgi_server, poll_job

pytestmark = pytest.mark.anyio
JSON = {"Content-Type": "application/json"}


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    "encoding, pack",
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", raw_deflate), ("GZIP", gzip.compress)],
)
def test_compressed_json_bodies_are_read_as_their_text(reasoner_url, encoding, pack):
    """Over a real uvicorn and the tiny Reasoner: /tokenize, and /invocations (its body read, then read again
    by the completion route it names: inflated once)."""
    sent = [
        ("/tokenize", {"model": "test-model", "prompt": "hello there"}),
        ("/invocations", {"model": "test-model", "prompt": "hello", "max_tokens": 3, "temperature": 0}),
    ]
    for path, body in sent:
        text = json.dumps(body).encode()
        plain = httpx.post(reasoner_url + path, content=text, headers=JSON, timeout=60)
        assert plain.status_code == 200, plain.text
        r = httpx.post(reasoner_url + path, content=pack(text), headers={**JSON, "Content-Encoding": encoding},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, (path, r.text)
        answer, expected = r.json(), plain.json()
        if path == "/invocations":
            answer, expected = answer["choices"][0]["text"], expected["choices"][0]["text"]
        assert answer == expected, path


async def test_a_gzipped_video_form_and_json_body_run_their_job(tmp_path):
    fields = {"prompt": "a gzipped form", "size": "64x48", "num_frames": "5", "num_inference_steps": "2"}
    form = "&".join(f"{k}={v.replace(' ', '+')}" for k, v in fields.items()).encode()
    async with asgi_server(tmp_path) as http:
        sent = [
            (form, "application/x-www-form-urlencoded"),
            (json.dumps({**fields, "num_frames": 5}).encode(), "application/json"),
        ]
        for body, ctype in sent:
            r = await http.post("/v1/videos", content=gzip.compress(body),
                                headers={"Content-Type": ctype, "Content-Encoding": "gzip"})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["prompt"] == "a gzipped form"
            assert (await poll_job(http, r.json()["id"]))["status"] == "completed"


async def test_the_upload_limit_counts_the_inflated_bytes(tmp_path):
    limit = 64 * 1024
    bomb = gzip.compress(json.dumps({"model": "test-model", "prompt": "x" * (50 * limit)}).encode())
    assert len(bomb) < limit
    async with asgi_server(tmp_path, max_upload_bytes=limit) as http:
        for path in ("/tokenize", "/v1/videos"):
            r = await http.post(path, content=bomb, headers={**JSON, "Content-Encoding": "gzip"})
            assert r.status_code == 413 and "--max-upload-mb" in r.json()["error"]["message"], (path, r.text)
        # under the limit inflated: taken (an unknown field pads it; it is ignored)
        job = {
            "prompt": "a",
            "size": "64x48",
            "num_frames": 5,
            "num_inference_steps": 2,
            "pad": "x" * (limit // 2),
        }
        r = await http.post("/v1/videos", content=gzip.compress(json.dumps(job).encode()),
                            headers={**JSON, "Content-Encoding": "gzip"})  # fmt: skip
        assert r.status_code == 200, r.text


async def test_another_encoding_is_a_415_and_bad_data_a_400_naming_the_header(tmp_path):
    body = json.dumps({"model": "test-model", "prompt": "hi"}).encode()
    async with asgi_server(tmp_path) as http:
        r = await http.post("/tokenize", content=body, headers={**JSON, "Content-Encoding": "br"})
        assert r.status_code == 415, r.text
        assert r.json()["error"]["param"] == "Content-Encoding" and "'br'" in r.json()["error"]["message"]
        assert r.headers["accept-encoding"] == "gzip, deflate"
        for encoding, data in (("gzip", body), ("deflate", gzip.compress(body)[:12]), ("gzip", b"")):
            r = await http.post("/v1/images/generations", content=data,
                                headers={**JSON, "Content-Encoding": encoding})  # fmt: skip
            assert r.status_code == 400, (encoding, r.text)
            error = r.json()["error"]
            assert error["param"] == "Content-Encoding" or "Invalid JSON" in error["message"], (
                encoding,
                r.text,
            )
        image = json.dumps({"prompt": "hi", "size": "64x48", "num_inference_steps": 2}).encode()
        r = await http.post("/v1/images/generations", content=image,
                            headers={**JSON, "Content-Encoding": "identity"})  # fmt: skip
        assert r.status_code == 200, r.text


async def test_a_cut_gzip_body_is_a_400_and_a_list_of_codings_is_read(tmp_path):
    """A gzip body cut before its end (a form's last field, a member without its CRC trailer) had run a job with
    the cut prompt: now a 400 as a cut deflate body; RFC 9110's list of codings, `gzip, identity`, is read
    (it was a 415); two stacked codings are a 415."""
    form = b"size=64x48&num_frames=5&num_inference_steps=2&prompt=a+red+cat+and+then+NOT+TRUNCATED+END"
    packed = gzip.compress(form)
    async with asgi_server(tmp_path) as http:
        for cut in (8, 16, 24, len(packed) - 1):
            r = await http.post("/v1/videos", content=packed[:-cut], headers={
                "Content-Type": "application/x-www-form-urlencoded", "Content-Encoding": "gzip"})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == "Content-Encoding", (cut, r.text)
        r = await http.post("/v1/videos", content=packed, headers={
            "Content-Type": "application/x-www-form-urlencoded", "Content-Encoding": "gzip, identity"})  # fmt: skip
        assert r.status_code == 200 and r.json()["prompt"] == "a red cat and then NOT TRUNCATED END", r.text
        r = await http.post("/v1/videos", content=gzip.compress(packed), headers={
            "Content-Type": "application/x-www-form-urlencoded", "Content-Encoding": "gzip, gzip"})  # fmt: skip
        assert r.status_code == 415, r.text
