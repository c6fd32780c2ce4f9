"""The video routes: POST /v1/videos, POST /v1/videos/sync, GET /v1/videos, GET|DELETE /v1/videos/{id},
GET /v1/videos/{id}/content (serving-api.md §5, §6).

Create = validate (400s before any GPU work) -> persist a queued job -> hand it to the engine -> 200 with the
job object. Sync = the same job, awaited up to the sync timeout: 200 video/mp4 with the timing headers, or
504 "Video generation timed out after <N>s." while the job goes on (GET /v1/videos/<X-Video-Id> finds it);
a client that disconnects first never got the job id, so its job is deleted and its GPU work aborted
(serving-api.md §14; vLLM-Omni keeps running it).
DELETE removes the job and its files and aborts its GPU work at the next step boundary. A failed job's GET
answers with the failure's status code (vLLM-Omni quirk; 200 with --openai-failed-job-status, as OpenAI's).
Content supports HTTP Range (Starlette).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Receive, Scope, Send

from worldserve.api.auth import request_id_of
from worldserve.api.disconnect import unless_disconnected
from worldserve.api.errors import APIError
from worldserve.api.protocol import ErrorResponse, VideoCreateRequest, VideoDeleted, VideoList, VideoObject
from worldserve.api.state import AppState, State
from worldserve.api.video_inputs import VideoInputs, build_inputs, read_fields
from worldserve.engine.client import Job, JobStatus, QueueFullError, ShuttingDownError, StorageError

router = APIRouter(tags=["videos"])
NOT_FOUND = "Video not found"
POLL_AFTER_MS = "500"


def _request_body_schema() -> dict[str, Any]:
    schema = VideoCreateRequest.model_json_schema()
    form = json.loads(json.dumps(schema))
    form["properties"]["input_reference"] = {"type": "string", "format": "binary",
                                             "description": "Image for image-to-video."}  # fmt: skip
    return {"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": form},
        "application/x-www-form-urlencoded": {"schema": schema},
        "application/json": {"schema": schema},
    }}}  # fmt: skip


BODY = _request_body_schema()
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request", "model": ErrorResponse},
    401: {"description": "Missing or wrong API key"},
    404: {"description": "Unknown job", "model": ErrorResponse},
}


async def _submit(request: Request, st: AppState) -> tuple[Job, VideoInputs]:
    with st.counting_too_large():
        fields = await read_fields(request, st.settings.max_upload_bytes)
    # (the body is read: a client leaving during a reference's download or decode stops that work)
    inputs = await unless_disconnected(request, build_inputs(
        fields, served_model=st.served_model_name, model_aliases=st.settings.model_aliases, has_sound=st.client.has_sound,
        defaults=st.settings.video_defaults, fetcher=st.media, decode_pixels=st.settings.video_decode_pixels, lora=st.settings.lora,
    ))  # fmt: skip
    await asyncio.to_thread(st.client.validate, inputs.params)  # tokenises: off the event loop
    try:
        job = await st.client.create_job(inputs.params, inputs.spec, inputs.encode, inputs.reference)
    except (QueueFullError, ShuttingDownError) as exc:
        raise st.refusal(exc) from None
    except StorageError:  # (answered 503 / 507 by its handler)
        st.metrics.on_rejected("storage")
        raise
    if st.settings.request_log is not None:
        st.settings.request_log.video(
            job.id, inputs.params, inputs.reference, http_id=request_id_of(request.scope)
        )
    return job, inputs


def _job_response(job: Job, failed_ok: bool = False) -> JSONResponse:
    """The job object; a failed one with its failure's status code (vLLM-Omni's), or 200 with `failed_ok`
    (--openai-failed-job-status: OpenAI's)."""
    body = VideoObject.from_job(job).model_dump(mode="json")
    if job.status is JobStatus.FAILED and not failed_ok:
        code = job.error_code
        return JSONResponse(body, status_code=code if code is not None and 400 <= code < 600 else 500)
    headers = {} if job.status.terminal else {"openai-poll-after-ms": POLL_AFTER_MS}
    return JSONResponse(body, headers=headers)


@router.post(
    "/v1/videos", response_model=VideoObject, openapi_extra=BODY, responses={**ERRORS, 413: {}, 429: {}}
)
async def create_video(request: Request, st: State) -> JSONResponse:
    """Create an async video job (multipart, urlencoded or JSON body)."""
    job, _ = await _submit(request, st)
    if st.load is not None:  # /load counts the job until it ends (api/server_load.py)
        st.load.count_until(st.client.wait(job.id))
    return _job_response(job)


@router.post(
    "/v1/videos/sync",
    openapi_extra=BODY,
    response_class=Response,
    responses={
        200: {"content": {"video/mp4": {}}, "description": "The MP4"},
        **ERRORS,
        413: {},
        429: {},
        504: {},
    },
)
async def create_video_sync(request: Request, st: State) -> Response:
    """Generate and return the MP4 (blocking); the job also stays retrievable under /v1/videos."""
    request_id = request.state.request_id = f"video_sync-{uuid.uuid4().hex}"  # (on its refusals too)
    job, _ = await _submit(request, st)
    ids = {"X-Request-Id": request_id, "X-Video-Id": job.id}

    async def forget() -> None:  # the client left without the job id: nobody could fetch the video
        await st.client.delete_job(job.id)
        if st.settings.request_log is not None:
            st.settings.request_log.aborted(job.id, f"{request_id}: the client left before its video")

    try:
        done = await unless_disconnected(
            request, asyncio.wait_for(st.client.wait(job.id), st.settings.sync_timeout_s), forget
        )
    except TimeoutError:  # the job goes on: /load counts it until it ends, as an async job
        if st.load is not None:
            st.load.count_until(st.client.wait(job.id))
        raise APIError(
            504, f"Video generation timed out after {st.settings.sync_timeout_s:g}s.", headers=ids
        ) from None
    except ShuttingDownError as exc:  # the server is shutting down, or its engine has stopped
        raise APIError(503, f"Job {job.id} cannot finish now: {exc}; it is kept: it resumes after a "
                       f"restart unless it completes first (GET /v1/videos/{job.id}).",
                       headers=ids, engine_request_id=request_id) from None  # fmt: skip
    if done is None:
        raise APIError(404, f"{NOT_FOUND}: the job was deleted before it completed.", headers=ids)
    if done.status is JobStatus.FAILED:  # an engine failure: vLLM-Omni's error.request_id (errors.py)
        raise APIError(done.error_code or 500, done.error_message or "Video generation failed.",
                       param=done.error_param, headers=ids, engine_request_id=request_id)  # fmt: skip
    try:
        video = await asyncio.to_thread(st.client.video_path(job.id).read_bytes)
    except FileNotFoundError:
        raise APIError(404, "Generated video file not found on disk", headers=ids) from None
    headers = {
        **ids,
        "X-Model": st.served_model_name,
        "X-Inference-Time-S": f"{done.inference_time_s or 0.0:.3f}",
        "X-Stage-Durations": json.dumps(
            {k: round(v, 3) for k, v in done.stage_durations.items()}, separators=(",", ":")
        ),
        "X-Peak-Memory-MB": f"{done.peak_memory_mb or 0.0:.3f}",
    }
    return Response(video, media_type="video/mp4", headers=headers)


@router.get("/v1/videos", response_model=VideoList, responses=ERRORS)
async def list_videos(
    st: State,
    after: Annotated[str | None, Query(description="Job id cursor")] = None,
    limit: Annotated[int | None, Query(ge=0, le=100)] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> Response:
    """List jobs by creation time (newest first by default)."""

    def page() -> Response:  # in a thread: with no limit, 100k jobs took the event loop for 6 s
        jobs, has_more = st.client.list(after=after or None, limit=limit, order=order)  # after= means none
        data = [VideoObject.from_job(j) for j in jobs]
        # the items serialised one by one and joined: one model_dump_json of 100k items held the GIL for ~2 s,
        # stalling every other request (the event loop runs between items)
        items = ",".join([d.model_dump_json() for d in data])
        head = VideoList(data=[], first_id=data[0].id if data else None,
                         last_id=data[-1].id if data else None, has_more=has_more).model_dump_json()  # fmt: skip
        return Response(head.replace('"data":[]', f'"data":[{items}]', 1), media_type="application/json")

    return await asyncio.to_thread(page)


@router.get("/v1/videos/{video_id}", response_model=VideoObject, responses=ERRORS)
async def retrieve_video(video_id: str, st: State) -> JSONResponse:
    """Job status, progress (per denoising step) and metadata; a failed job answers with its error code
    (with --openai-failed-job-status: 200, as OpenAI's)."""
    job = st.client.get(video_id)
    if job is None:
        raise APIError(404, NOT_FOUND, param="video_id")
    return _job_response(job, st.settings.failed_jobs_ok)


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=ERRORS)
async def delete_video(video_id: str, st: State) -> VideoDeleted:
    """Cancel (at the next step boundary) if queued or running, and remove the job and its files."""
    if (job := await st.client.delete_job(video_id)) is None:
        raise APIError(404, NOT_FOUND, param="video_id")
    if st.settings.request_log is not None and not job.status.terminal:
        st.settings.request_log.aborted(video_id, f"deleted while {job.status.value}")
    return VideoDeleted(id=video_id)


@router.head(  # the size and type without the bytes (download managers ask first); one operation in the schema
    "/v1/videos/{video_id}/content", response_class=FileResponse, include_in_schema=False
)
@router.get(
    "/v1/videos/{video_id}/content",
    response_class=FileResponse,
    responses={
        200: {"content": {"video/mp4": {}}, "description": "The MP4 (Range supported)"},
        422: {},
        **ERRORS,
    },
)
async def download_video(video_id: str, request: Request, st: State) -> Response:
    """Download the MP4 (HTTP Range supported; HEAD answers the headers alone; a revalidation whose
    If-None-Match / If-Modified-Since still holds is a 304 without the body); OpenAI's `variant` other than
    video (thumbnail, spritesheet) is not offered: a 400 rather than the MP4 in their place."""
    job = st.client.get(video_id)
    if job is None:  # (before the variant: an unknown id is a 404 whatever is asked of it)
        raise APIError(404, NOT_FOUND, param="video_id")
    variant = request.query_params.get("variant", "video")
    if variant != "video":
        raise APIError(400, f"variant {variant!r} is not offered; only 'video' (the MP4)", param="variant")
    if job.status is JobStatus.FAILED:
        raise APIError(422, "Video generation failed. Check job status for error details.")
    if job.status is not JobStatus.COMPLETED:
        raise APIError(404, "Generation is still in-progress")
    try:  # opened here: a DELETE (or the TTL sweep) that unlinks it meanwhile cannot cut the download
        fd = os.open(st.client.video_path(video_id), os.O_RDONLY)
    except FileNotFoundError:
        raise APIError(404, "Generated video file not found on disk") from None
    try:
        size = os.fstat(fd).st_size
        served = _served_range(request.headers.get("range"), size)
        response = OpenFileResponse(
            fd, media_type="video/mp4", filename=f"{video_id}.mp4", range_header=served
        )
        if not_modified(request.headers, response.headers):
            os.close(fd)
            kept = {k: response.headers[k] for k in ("etag", "last-modified")}
            return Response(status_code=304, headers=kept)
        if_range = request.headers.get("if-range")  # (one that no longer matches: the whole file, no Range)
        if if_range is None or response._should_use_range(if_range):
            _check_range(served, size)
    except BaseException:
        os.close(fd)
        raise
    return response


def not_modified(asked: Mapping[str, str], served: Mapping[str, str]) -> bool:
    """Whether a GET's preconditions say the client's copy is current (RFC 9110 §13.1.2-3, §13.2.2):
    If-None-Match naming the file's ETag (a weak comparison; "*" any), else, without it, an If-Modified-Since
    at or after its Last-Modified (an unreadable date is ignored)."""
    if (match := asked.get("if-none-match")) is not None:
        tags = [t.strip().removeprefix("W/") for t in match.split(",")]
        return "*" in tags or served.get("etag", "").removeprefix("W/") in tags
    since, modified = asked.get("if-modified-since"), served.get("last-modified")
    if since is None or modified is None:
        return False
    try:
        return parsedate_to_datetime(modified) <= parsedate_to_datetime(since)
    except (TypeError, ValueError):  # (not an HTTP date)
        return False


def _served_range(header: str | None, size: int) -> str | None:
    """The `Range` to serve (RFC 9110 §14.2): none for a unit other than bytes (it must be ignored); without
    the byte ranges that start past the end when others do not (a 416 only when none can be served)."""
    if header is None or "=" not in header:
        return header
    unit, specs = header.split("=", 1)
    if unit.strip().lower() != "bytes":
        return None
    try:
        ranges = FileResponse._parse_ranges(specs, size)
    except MalformedRangeHeader:
        return header  # (refused as malformed by _check_range)
    inside = [(start, end) for start, end in ranges if 0 <= start < size]
    if not inside or len(inside) == len(ranges):
        return header
    return "bytes=" + ",".join(f"{start}-{end - 1}" for start, end in inside)


def _check_range(header: str | None, size: int) -> None:
    """A `Range` header FileResponse would refuse, refused first as an error envelope (Starlette answers
    plain text): a malformed one is a 400 naming it, one past the end a 416 with `Content-Range: bytes */size`.
    The parsing is FileResponse's own, so what passes here is what it serves."""
    if header is None:
        return
    try:
        FileResponse._parse_range_header(header, size)
    except MalformedRangeHeader as exc:
        raise APIError(400, f"Invalid Range header {header[:100]!r}: {exc.content or 'malformed'}",
                       param="Range") from None  # fmt: skip
    except RangeNotSatisfiable:
        raise APIError(416, f"Range {header[:100]!r} is past the end of the {size}-byte video", param="Range",
                       headers={"Content-Range": f"bytes */{size}"}) from None  # fmt: skip


class OpenFileResponse(FileResponse):
    """Starlette's FileResponse (HTTP Range included) over a file this process has open: it reads the file
    through its descriptor's /proc (or /dev) path, which stays valid after the file is unlinked, and closes
    the descriptor when the response is done (sent, failed or cancelled)."""

    def __init__(self, fd: int, *, range_header: str | None = None, **kwargs: Any):
        """`range_header`: the Range it serves, in place of the request's (_served_range)."""
        fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
        super().__init__(f"{fd_dir}/{fd}", stat_result=os.fstat(fd), **kwargs)
        self._fd, self._range = fd, range_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extensions = {k: v for k, v in scope.get("extensions", {}).items() if k != "http.response.pathsend"}
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"range"]
        if self._range is not None:
            headers.append((b"range", self._range.encode("latin-1")))
        try:  # no pathsend: a server would open the path after we closed the descriptor
            await super().__call__({**scope, "extensions": extensions, "headers": headers}, receive, send)
        finally:
            os.close(self._fd)


SORA_ONLY = {
    ("POST", "/v1/videos/{video_id}/remix"): "remix",
    ("POST", "/v1/videos/extensions"): "extend",
    ("POST", "/v1/videos/edits"): "edit",
    ("POST", "/v1/videos/characters"): "create_character",
    ("GET", "/v1/videos/characters/{character_id}"): "get_character",
}
"""OpenAI SDK video calls that are Sora's own (vLLM-Omni serves none): (method, route) -> the SDK's method."""


async def sora_only(request: Request) -> None:
    """A clear 404 for the SDK calls this server does not serve; the POSTs under /v1/videos/{id} had been a
    bare 405 (the job routes' path matched them)."""
    call = request.method, request.scope["route"].path
    raise APIError(404, f"{' '.join(call)} (the OpenAI SDK's videos.{SORA_ONLY[call]}) is Sora's and not served here, "
                   "as in vLLM-Omni: condition a new job on a video instead (POST /v1/videos with the video as "
                   "`input_reference`)")  # fmt: skip


for _method, _path in SORA_ONLY:
    router.add_api_route(_path, sora_only, methods=[_method], include_in_schema=False)
