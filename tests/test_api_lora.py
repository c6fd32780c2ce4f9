"""LoRA adapters over HTTP (api/lora_field.py) on the FakeBackend: the `lora` field of /v1/videos, /v1/videos/sync,
/v1/realtime/video and /v1/images/generations, in every body type and under each of vLLM-Omni's key names, reaches
the backend as `VideoParams.lora`; a malformed one, and any adapter a request names without --enable-lora, is a 400
naming `lora`; --lora-path's static adapter runs for the requests that name none and a request's own replaces it;
a job's adapter survives the store's record and a restart."""

from __future__ import annotations

import asyncio
import json

import pytest
from serving_helpers import SMALL_FORM, asgi_server, poll_job, realtime_session, uvicorn_thread, wait_until
from test_api_videos import RecordingBackend

from worldserve.api.lora_field import PER_REQUEST_OFF, LoraSettings
from worldserve.engine.client import EncodeOptions
from worldserve.engine.fake_backend import FakeBackend
from worldserve.engine.job_files import inputs_from_record, inputs_record
from worldserve.params import LoraRequest, VideoParams

pytestmark = pytest.mark.anyio
ON = {"lora": LoraSettings(per_request=True)}
"""build_app's options of a server started with --enable-lora."""
STATIC = LoraRequest(name="static", path="/srv/loras/house-style", scale=0.7)
IMAGE = {"prompt": "a fox", "size": "64x48", "num_inference_steps": 1}


def multipart(fields: dict[str, str]) -> dict:
    """httpx's keyword for a multipart/form-data body of text fields only."""
    return {"files": {k: (None, v) for k, v in fields.items()}}


async def made(http, backend: RecordingBackend, route: str, **body) -> LoraRequest | None:
    """POST a small video request to `route` (`body`: httpx's data= / json= / files=), wait for it, and return
    the adapter the backend was asked to run."""
    before = len(backend.params)
    r = await http.post(route, **body)
    assert r.status_code == 200, r.text
    if route == "/v1/videos":
        assert (await poll_job(http, r.json()["id"]))["status"] == "completed"
    assert len(backend.params) == before + 1
    return backend.params[-1].lora


async def test_every_body_type_and_key_name_reaches_the_backend(tmp_path):
    """Multipart and urlencoded forms (JSON text), JSON bodies (an object or its text), async and sync routes;
    vLLM-Omni's aliases, `local_path` first of the paths, a scale given as a number or a numeric string
    (default 1.0, 0 kept: the base model), int_id accepted."""
    backend = RecordingBackend()
    style = {"name": "style", "path": "/srv/loras/style", "scale": 0.5}
    async with asgi_server(tmp_path, backend=backend, app_kw=ON) as http:
        form = {"prompt": "a cat", **SMALL_FORM}
        want = LoraRequest(name="style", path="/srv/loras/style", scale=0.5)
        assert (
            await made(http, backend, "/v1/videos", **multipart({**form, "lora": json.dumps(style)})) == want
        )
        assert await made(http, backend, "/v1/videos", data={**form, "lora": json.dumps(style)}) == want
        assert await made(http, backend, "/v1/videos/sync", data={**form, "lora": json.dumps(style)}) == want
        body = {"prompt": "a cat", **SMALL_FORM}
        assert await made(http, backend, "/v1/videos", json={**body, "lora": style}) == want
        assert await made(http, backend, "/v1/videos/sync", json={**body, "lora": json.dumps(style)}) == want
        aliases = [
            ({"lora_name": "a", "lora_path": "/l/a", "lora_scale": "0.25"}, LoraRequest("a", "/l/a", 0.25)),
            ({"adapter": "b", "path": "/l/p", "local_path": "/l/local", "lora_int_id": 3}, LoraRequest("b", "/l/local")),
            ({"name": "c", "lora_local_path": "/l/c", "scale": 0, "int_id": 9}, LoraRequest("c", "/l/c", 0.0)),
            ({"name": "d", "path": "", "lora_path": "/l/d", "scale": " 2 "}, LoraRequest("d", "/l/d", 2.0)),
            ({"name": "e", "path": "/l/e", "scale": None, "lora_scale": -1}, LoraRequest("e", "/l/e", -1.0)),
        ]  # fmt: skip
        for given, expected in aliases:
            got = await made(http, backend, "/v1/videos", json={**body, "lora": given})
            assert got == expected and isinstance(got.scale, float), given
        assert (
            await made(http, backend, "/v1/videos", json={**body, "lora": None}) is None
        )  # (null: not given)
        assert (
            await made(http, backend, "/v1/videos", data={**form, "lora": ""}) is None
        )  # (a form's "": too)


BAD = [
    ("not JSON", "{name: a}", "Invalid lora object: not valid JSON."),
    ("nested too deep", "[" * 100_000, "Invalid lora object: not valid JSON."),
    ("a list", '[{"name": "a", "path": "/a"}]', "Invalid lora object: expected a JSON object."),
    ("a string", '"style"', "Invalid lora object: expected a JSON object."),
    ("no path", '{"name": "a"}', "Invalid lora object: both name and path are required."),
    ("no name", '{"lora_path": "/a", "scale": 1}', "Invalid lora object: both name and path are required."),
    ("empty name", '{"name": "", "path": "/a"}', "Invalid lora object: both name and path are required."),
    ("name a number", '{"name": 5, "path": "/a"}', "Invalid lora object: name and path must be strings."),
    ("path an object", '{"name": "a", "path": {"p": 1}}', "Invalid lora object: name and path must be strings."),
    ("scale text", '{"name": "a", "path": "/a", "scale": "high"}', "scale must be a finite number, got 'high'"),
    ("scale nan", '{"name": "a", "path": "/a", "scale": "nan"}', "scale must be a finite number, got 'nan'"),
    ("scale inf", '{"name": "a", "path": "/a", "lora_scale": "-inf"}', "scale must be a finite number"),
    ("scale 1e999", '{"name": "a", "path": "/a", "scale": 1e999}', "scale must be a finite number, got inf"),
    ("scale huge int", '{"name": "a", "path": "/a", "scale": 1%s}' % ("0" * 400), "a 401-digit number"),
    ("scale bool", '{"name": "a", "path": "/a", "scale": true}', "scale must be a finite number, got a boolean"),
    ("scale list", '{"name": "a", "path": "/a", "scale": [1]}', "scale must be a finite number, got an array"),
    ("int_id text", '{"name": "a", "path": "/a", "int_id": "1"}', "int_id must be an integer, got '1'"),
    ("a URL", '{"name": "a", "path": "https://huggingface.co/org/style"}', "path must be a file or folder on the server, not a URL"),
    ("int_id float", '{"name": "a", "path": "/a", "lora_int_id": 1.5}', "int_id must be an integer, got 1.5"),
]  # fmt: skip


TEXT_ONLY = ("not JSON", "nested too deep", "scale 1e999", "a string")
"""The cases sent as text only: their text is no JSON value a body carries (not JSON, too deep to parse, an
infinity), or its value is a string, which a JSON body's `lora` takes as the object's text (another case)."""


@pytest.mark.parametrize(("name", "text", "message"), BAD, ids=[b[0] for b in BAD])
async def test_a_malformed_lora_is_a_400_naming_it_on_every_route(tmp_path, name, text, message):
    """The same 400 (param `lora`) for a form's text, a JSON body's text and, where it parses, its value, on the
    video and image routes, with --enable-lora (the checks do not depend on it): no job made."""
    backend = RecordingBackend()
    async with asgi_server(tmp_path, backend=backend, app_kw=ON) as http:
        form = {"prompt": "x", **SMALL_FORM, "lora": text}
        sends = [("/v1/videos", {"data": form}), ("/v1/videos/sync", multipart(form)),
                 ("/v1/videos", {"json": form}), ("/v1/images/generations", {"json": {**IMAGE, "lora": text}})]  # fmt: skip
        if name not in TEXT_ONLY:
            value = json.loads(text)
            sends += [("/v1/videos", {"json": {**form, "lora": value}}),
                      ("/v1/images/generations", {"json": {**IMAGE, "lora": value}})]  # fmt: skip
        for route, body in sends:
            r = await http.post(route, **body)
            error = r.json()["error"]
            assert (r.status_code, error["param"]) == (400, "lora"), (route, r.text)
            assert message in error["message"], (route, error["message"])
        assert (await http.get("/v1/videos")).json()["data"] == [] and backend.params == []


async def test_a_requests_own_adapter_needs_enable_lora(tmp_path):
    """Without --enable-lora any adapter a request names is a 400 naming `lora` (they are read from the server's
    disk), also beside a static one; requests without one run (the static adapter, or none)."""
    backend = RecordingBackend()
    own = {"name": "mine", "path": "/srv/loras/mine"}
    for folder, app_kw, default in (
        ("plain", {}, None),
        ("static", {"lora": LoraSettings(static=STATIC)}, STATIC),
    ):
        async with asgi_server(tmp_path / folder, backend=backend, app_kw=app_kw) as http:
            body = {"prompt": "x", **SMALL_FORM}
            for route, send in (("/v1/videos", {"data": {**body, "lora": json.dumps(own)}}),
                                ("/v1/videos/sync", {"json": {**body, "lora": own}}),
                                ("/v1/images/generations", {"json": {**IMAGE, "lora": own}})):  # fmt: skip
                r = await http.post(route, **send)
                assert r.status_code == 400 and r.json()["error"] == {
                    "message": PER_REQUEST_OFF, "type": "Bad Request", "param": "lora", "code": 400
                }, r.text  # fmt: skip
            assert await made(http, backend, "/v1/videos", data=body) == default
    assert PER_REQUEST_OFF == "per-request LoRA adapters are off on this server: start it with --enable-lora"


async def test_the_static_adapter_runs_unless_a_request_names_its_own(tmp_path):
    """--lora-path / --lora-scale: every video and image request naming no adapter runs the static one; with
    --enable-lora a request's own replaces it (a scale of 0: the base model, the static one not applied)."""
    backend = RecordingBackend()
    async with asgi_server(
        tmp_path, backend=backend, app_kw={"lora": LoraSettings(per_request=True, static=STATIC)}
    ) as http:
        body = {"prompt": "x", **SMALL_FORM}
        assert await made(http, backend, "/v1/videos", data=body) == STATIC
        assert await made(http, backend, "/v1/videos/sync", json=body) == STATIC
        own = {"name": "mine", "path": "/srv/loras/mine", "scale": 0}
        assert await made(http, backend, "/v1/videos", json={**body, "lora": own}) == LoraRequest(
            "mine", "/srv/loras/mine", 0.0
        )
        r = await http.post("/v1/images/generations", json={**IMAGE, "n": 2})
        assert r.status_code == 200, r.text
        assert [p.lora for p in backend.params[-2:]] == [STATIC, STATIC]
        r = await http.post("/v1/images/generations", json={**IMAGE, "lora": {**own, "scale": "1.5"}})
        assert r.status_code == 200 and backend.params[-1].lora == LoraRequest("mine", "/srv/loras/mine", 1.5)


async def test_a_realtime_session_runs_the_adapter(tmp_path):
    """/v1/realtime/video's session.start takes `lora` as POST /v1/videos does (and refuses it the same way)."""
    backend = RecordingBackend()
    start = {"type": "session.start", "prompt": "a cat", "size": "64x48", "num_frames": 5, "fps": 8,
             "num_inference_steps": 1, "lora": {"name": "a", "path": "/l/a", "scale": 0.5}}  # fmt: skip
    with uvicorn_thread(tmp_path, backend=backend, app_kw=ON) as (url, _):
        messages, _, _ = await realtime_session(url, start)
        assert messages[-1]["type"] == "session.done", messages
    assert backend.params[-1].lora == LoraRequest("a", "/l/a", 0.5)
    with uvicorn_thread(tmp_path / "off", backend=backend) as (url, _):
        messages, _, _ = await realtime_session(url, start)
    assert messages[0]["type"] == "error" and messages[0]["param"] == "lora", messages
    assert len(backend.params) == 1


def test_the_job_record_keeps_the_adapter():
    """The store's record holds the adapter as a JSON object and gives the dataclass back; a record without one
    (none given, or written before adapters existed) runs the base model."""
    params = VideoParams(prompt="x", width=64, height=48, num_frames=5, lora=LoraRequest("a", "/l/a", 0.25))
    record = json.loads(json.dumps(inputs_record(params, EncodeOptions())))
    assert record["params"]["lora"] == {"name": "a", "path": "/l/a", "scale": 0.25}
    again, _ = inputs_from_record(record, None)
    assert again.lora == LoraRequest("a", "/l/a", 0.25) and isinstance(again.lora, LoraRequest)
    assert again == params
    plain = json.loads(json.dumps(inputs_record(VideoParams(prompt="x"), EncodeOptions())))
    assert plain["params"]["lora"] is None and inputs_from_record(plain, None)[0].lora is None
    del plain["params"]["lora"]
    assert inputs_from_record(plain, None)[0].lora is None


async def test_an_interrupted_job_reruns_with_its_adapter_after_a_restart(tmp_path):
    """A job stopped mid-run by a shutdown is re-run at the next start from its record, with the same adapter
    (the next server has no LoRA flags: the job keeps what it was accepted with)."""
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.05), app_kw=ON) as http:
        own = {"name": "a", "path": "/l/a", "scale": 0.5}
        r = await http.post(
            "/v1/videos", json={"prompt": "x", **SMALL_FORM, "num_inference_steps": 200, "lora": own}
        )
        assert r.status_code == 200, r.text
        job = r.json()["id"]
        await asyncio.to_thread(wait_until, lambda: http.engine_client.get(job).progress > 0)
    backend = RecordingBackend()
    async with asgi_server(tmp_path, backend=backend) as http:
        assert (await poll_job(http, job))["status"] == "completed"
    assert [p.lora for p in backend.params] == [LoraRequest("a", "/l/a", 0.5)]


def test_a_relative_path_is_kept_absolute(tmp_path, monkeypatch):
    """A request's relative path names a file of the server's working folder: it is kept absolute, so a job
    re-run after a restart from another folder reads the same adapter."""
    from worldserve.api.lora_field import parse_lora

    monkeypatch.chdir(tmp_path)
    assert parse_lora('{"name": "a", "path": "loras/a"}').path == str(tmp_path / "loras" / "a")
