"""Request ids on errors: an unhandled error's 500 (Starlette answers it outside every middleware) carries the
X-Request-Id header and its log line names the id, a storage error's log line too; an engine failure's
body carries vLLM-Omni's `error.request_id` and `error.error_stage_id` (serving-api.md §3.2; vllm-omni
entrypoints/serve/utils/errors.py), on /v1/videos/sync and /v1/images/generations."""

from __future__ import annotations

import logging

import httpx
import pytest
from serving_helpers import SMALL_FORM, asgi_server, make_client, serve_app
from test_storage_faults import FullDisk

from worldserve.engine.fake_backend import FakeBackend
from worldserve.params import VideoParams


class BuggyBackend(FakeBackend):
    """A FakeBackend whose validation has a bug for the prompt "bug": a RuntimeError, no ParamError."""

    def validate(self, params: VideoParams) -> VideoParams:
        if params.prompt == "bug":
            raise RuntimeError("a bug in the validation")
        return super().validate(params)


@pytest.mark.parametrize("ids", [True, False])
def test_an_unhandled_error_answers_with_its_request_id(tmp_path, caplog, ids):
    from worldserve.api.app import build_app

    app = build_app(make_client(tmp_path, backend=BuggyBackend()), request_id_headers=ids)
    with caplog.at_level(logging.ERROR, logger="worldserve.api.errors"), serve_app(app) as url:
        r = httpx.post(url + "/v1/videos", json={"prompt": "bug", **SMALL_FORM},
                       headers={"X-Request-Id": "rid-unhandled"}, timeout=30)  # fmt: skip
        generated = httpx.post(url + "/v1/videos", json={"prompt": "bug", **SMALL_FORM}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "Internal Server Error", r.text
    assert "a bug" not in r.text  # the exception's text stays in the log
    lines = [rec.getMessage() for rec in caplog.records if "unhandled error" in rec.getMessage()]
    assert len(lines) == 2, lines
    if ids:  # echoed, or generated (a uuid4 hex), in the header and the log line alike
        assert r.headers["x-request-id"] == "rid-unhandled"
        assert lines[0] == "unhandled error on POST /v1/videos (request rid-unhandled)"
        rid = generated.headers["x-request-id"]
        assert len(rid) == 32 and lines[1] == f"unhandled error on POST /v1/videos (request {rid})"
    else:  # --enable-request-id-headers off: none
        assert "x-request-id" not in r.headers and lines[0] == "unhandled error on POST /v1/videos"


@pytest.mark.anyio
async def test_a_storage_errors_log_line_names_its_request(tmp_path, monkeypatch, caplog):
    async with asgi_server(tmp_path) as http:
        disk = FullDisk(http.engine_client.store, monkeypatch)
        disk.full = True
        with caplog.at_level(logging.ERROR, logger="worldserve.api.errors"):
            r = await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM},
                                headers={"X-Request-Id": "rid-disk"})  # fmt: skip
        disk.full = False
    assert r.status_code == 507 and r.headers["x-request-id"] == "rid-disk"
    (line,) = [rec.getMessage() for rec in caplog.records if "storage" in rec.getMessage()]
    assert line.startswith("POST /v1/videos (request rid-disk): "), line


@pytest.mark.anyio
async def test_engine_failures_carry_the_request_id_in_the_body(tmp_path, monkeypatch):
    async with asgi_server(tmp_path) as http:
        disk = FullDisk(http.engine_client.store, monkeypatch)
        disk.files_full = True  # the job is created; its MP4 cannot be saved
        r = await http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM})
        disk.files_full = False
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["request_id"] == r.headers["x-request-id"] and error["request_id"].startswith(
            "video_sync-"
        )
        assert (
            error["error_stage_id"] == 0 and error["code"] == 507 and error["type"] == "Insufficient Storage"
        )
        r = await http.post("/v1/videos/sync", data={"prompt": "__fail__:denoise", **SMALL_FORM})
        assert r.status_code == 500 and r.json()["error"]["request_id"] == r.headers["x-request-id"]
        r = await http.post("/v1/images/generations", json={"prompt": "__fail__:prepare", "size": "32x32",
                                                              "num_inference_steps": 2})  # fmt: skip
        error = r.json()["error"]
        assert r.status_code == 500 and error["request_id"] == r.headers["x-request-id"], r.text
        assert error["request_id"].startswith("img_gen-") and error["error_stage_id"] == 0
        # a request the server refused is no engine failure: the plain envelope
        r = await http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM, "size": "640x"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
