"""Every error leaves the server in vLLM's envelope: {"error": {"message", "type", "param", "code"}}.

`type` is the HTTP reason phrase ("Bad Request", "Not Found", ...) and `code` the status (serving-api.md
§3.2); on vLLM's own routes (VLLM_ROUTES) an error its serving code raises carries vLLM's typed names
("BadRequestError", "NotFoundError", ...), while a request its validation refuses (pydantic's types and
ranges, its request models' validators: an APIError or ParamError whose `request_validation` is true) keeps the
reason phrase, as vLLM's RequestValidationError handler answers. Request validation answers 400, never
FastAPI's 422 `{"detail": ...}`: the message starts "N validation error(s):" followed by one dict per error
with loc ('body', field), as vLLM prints it, and `param` names the first offending field. Unknown routes and
methods get the envelope too (404 / 405).
The one exception is auth: 401 `{"error": "Unauthorized"}` (see auth.py).
An engine failure (a video or image request the engine failed, or could not finish: APIError's
`engine_request_id`) adds vLLM-Omni's `error.request_id` and `error.error_stage_id` (its
entrypoints/serve/utils/errors.py; worldserve's one diffusion stage is stage 0). Error log lines name the
request id, and an unhandled error's 500 (answered by Starlette outside every middleware) carries the
X-Request-Id header as every other answer does.
"""

from __future__ import annotations

import http
import logging
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from worldserve.api.auth import request_id_of
from worldserve.api.disconnect import CLIENT_CLOSED_REQUEST, ClientGone
from worldserve.engine.client import StorageError
from worldserve.params import ParamError

log = logging.getLogger(__name__)
MAX_INPUT_REPR = 200
ENGINE_STAGE_ID = 0
"""`error.error_stage_id` of an engine failure: worldserve runs one diffusion stage (vLLM-Omni's pure
diffusion mode numbers it 0)."""


class APIError(Exception):
    """Raised anywhere in a route to answer `status` with the envelope; `engine_request_id`: the request id of
    an engine failure (the body then carries vLLM-Omni's `error.request_id` and `error.error_stage_id`)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None,
        engine_request_id: str | None = None, request_validation: bool = False,
    ):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        self.engine_request_id = engine_request_id
        self.request_validation = request_validation
        """A request refused as FastAPI's validation refuses it (the body not a JSON object, a field's type or
        range): typed "Bad Request" on vLLM's routes too, as vLLM's RequestValidationError handler types it."""


VLLM_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/invocations",
)
"""Routes vLLM's own handlers serve: their errors are typed as vLLM types them."""
VLLM_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def is_vllm_route(request: Request) -> bool:
    """Whether one of vLLM's routes answered `request` (matched: an unknown path that merely starts like one,
    "/v1/completionsX", is not)."""
    route = request.scope.get("route")
    return route is not None and getattr(route, "path", "").startswith(VLLM_ROUTES)


def reason_phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _text(value: str | None) -> str | None:
    """`value` as UTF-8-encodable text (a lone surrogate echoed from a request becomes "\\udxxx")."""
    return None if value is None else value.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    status: int, message: str, param: str | None = None, *, vllm: bool = False,
    engine_request_id: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The envelope; `vllm`: an error of one of vLLM's own routes (its typed names); `engine_request_id`: an
    engine failure's request id (vLLM-Omni's request_id and error_stage_id added)."""
    kind = VLLM_TYPES.get(status) if vllm else None
    error: dict[str, Any] = {
        "message": _text(message),
        "type": kind or reason_phrase(status),
        "param": _text(param),
        "code": status,
    }
    if engine_request_id is not None:
        error |= {"request_id": engine_request_id, "error_stage_id": ENGINE_STAGE_ID}
    return {"error": error}


def error_response(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None,
    *, vllm: bool = False, engine_request_id: str | None = None,
) -> JSONResponse:  # fmt: skip
    body = error_body(status, message, param, vllm=vllm, engine_request_id=engine_request_id)
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def validation_error(
    errors: Sequence[Mapping[str, Any]], loc_prefix: tuple[str, ...] = ("body",)
) -> APIError:
    """pydantic errors -> a 400 APIError whose message reads like vLLM's and whose param is the first field."""
    items: list[dict[str, Any]] = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if loc_prefix and loc[: len(loc_prefix)] != loc_prefix:
            loc = (*loc_prefix, *loc)
        value = None if err.get("type") == "missing" else err.get("input")
        if isinstance(value, str) and len(value) > MAX_INPUT_REPR:
            value = value[:MAX_INPUT_REPR] + "..."
        elif isinstance(value, bytes) and len(value) > MAX_INPUT_REPR:  # (str + bytes raised a TypeError)
            value = value[:MAX_INPUT_REPR] + b"..."
        elif not isinstance(value, str | bytes | int | float | bool | type(None)):
            value = _shown(value)
        items.append({"type": err.get("type"), "loc": loc, "msg": err.get("msg"), "input": value})
    n = len(items)
    message = f"{n} validation error{'s' if n != 1 else ''}:\n" + "\n".join(f"  {item}" for item in items)
    first: tuple[Any, ...] = items[0]["loc"] if items else ()
    param = str(first[1]) if len(first) > 1 else None
    if param == "extra_params" and len(first) > 2 and isinstance(first[2], str):  # (its keys are named so)
        param = f"extra_params.{first[2]}"
    elif param in (
        "messages",
        "input",
    ):  # the part at fault, as the semantic checks name it: messages[i].content[j].x
        # (Responses' `input` items the same)
        param = max((_field_path(item["loc"][1:]) for item in items), key=lambda path: path.count("."))
    return APIError(400, message, param=param, request_validation=True)


SHALLOW_REPR = reprlib.Repr()
"""The repr of an input nested too deep for `repr`: its default depth (six levels, then "..."), containers'
items cut to a few."""


def shown_name(name: str) -> str:
    """A name a client sent (its `model`), as an error message quotes it: cut to MAX_INPUT_REPR characters
    (a 10 MB model name had come back whole in the 400's body)."""
    return name if len(name) <= MAX_INPUT_REPR else name[:MAX_INPUT_REPR] + "..."


def model_mismatch(model: str, served_model: str) -> APIError:
    """vLLM-Omni's 400 for a video or image request naming another model than the served one."""
    return APIError(400, f"Model mismatch: request specifies '{shown_name(model)}' but server is running "
                    f"'{served_model}'.", param="model")  # fmt: skip


def _shown(value: Any) -> str:
    """An offending input's repr, cut to MAX_INPUT_REPR characters. A value nested past Python's recursion
    limit (a form's bracketed fields build one from a name of 3,000 `[a]`s) made `repr` raise RecursionError,
    which turned the 400 into a 500: it is shown a few levels deep instead."""
    try:
        return repr(value)[:MAX_INPUT_REPR]
    except RecursionError:
        return SHALLOW_REPR.repr(value)[:MAX_INPUT_REPR]


def _field_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as a field path (`messages[0].content[1].image_url`), without the union
    members' type tags pydantic puts in it (`str`, `list[ContentPart]`, `MediaURL`)."""
    path = ""
    for key in loc:
        if isinstance(key, int):
            path += f"[{key}]"
        elif "[" in key or key[:1].isupper() or key in UNION_TAGS:
            continue
        else:
            path += f".{key}" if path else key
    return path


UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})
"""pydantic's tags of a union's plain members in an error's location (no request field has these names)."""


def _answer(
    request: Request,
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    engine_request_id: str | None = None,
    request_validation: bool = False,
) -> JSONResponse:
    """The envelope for an error of `request`: typed as vLLM types them on its own routes, except a
    `request_validation` error, which vLLM's validation handler types "Bad Request" as everywhere."""
    vllm = is_vllm_route(request) and not request_validation
    return error_response(status, message, param, headers, vllm=vllm, engine_request_id=engine_request_id)


def _named(request_id: str | None) -> str:
    """A log line's mention of the request id (none when request ids are off)."""
    return f" (request {request_id})" if request_id else ""


HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (a 405's `Allow`, RFC 9110 §15.5.6), asked of
    the routes as the router asks them (FastAPI wraps included routers' routes)."""
    routes = request.app.router.routes
    return [m for m in HTTP_METHODS
            if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)]  # fmt: skip


ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "integer"}}}},
}  # fmt: skip
"""The error envelope (serving-api.md §3.2), as /openapi.json documents a 400."""


def _openapi_400s(app: FastAPI) -> None:
    """/openapi.json documents a validation error as the 400 this server answers, not FastAPI's 422 (which it
    listed for every route with path or query parameters; a client generated from it expected 422s), and a
    POST's too (the routes that read their own body listed none)."""
    made = app.openapi

    def openapi() -> dict:
        fresh = app.openapi_schema is None
        schema = made()
        if fresh:
            for operations in schema.get("paths", {}).values():
                for method, operation in operations.items():
                    responses = operation.setdefault("responses", {})
                    if responses.pop("422", None) is not None or method == "post":
                        responses.setdefault("400", {
                            "description": "Bad Request: the error envelope, `param` naming the field",
                            "content": {"application/json": {"schema": ERROR_SCHEMA}},
                        })  # fmt: skip
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    _openapi_400s(app)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _answer(request, exc.status, exc.message, exc.param, exc.headers, exc.engine_request_id,
                       exc.request_validation)  # fmt: skip

    @app.exception_handler(ParamError)
    async def _param_error(request: Request, exc: ParamError) -> JSONResponse:
        return _answer(request, 400, exc.message, exc.param, request_validation=exc.request_validation)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors(), loc_prefix=())
        return _answer(request, 400, err.message, err.param, request_validation=True)

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
        err = validation_error(exc.errors())
        return _answer(request, 400, err.message, err.param, request_validation=True)

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = exc.headers
        # a 405: Starlette names the first route's methods; a path may have several routes
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
        return _answer(request, exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(StorageError)  # the disk refused a write (full: 507); what failed, no paths
    async def _storage_error(request: Request, exc: StorageError) -> JSONResponse:
        log.error("%s %s%s: %s", request.method, request.url.path, _named(request_id_of(request.scope)), exc)
        return _answer(request, exc.status_code, f"{str(exc)[0].upper()}{str(exc)[1:]}.")

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)  # gone while its body was being read: nothing failed here
    async def _client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette runs this handler outside every middleware (RequestIdMiddleware's too): the id comes from
        # the scope, where that middleware (or the route) left it
        request_id = request_id_of(request.scope)
        log.exception("unhandled error on %s %s%s", request.method, request.url.path, _named(request_id))
        # the exception's text stays in the log: it may quote internals (paths, a remote server's bytes)
        headers = {"X-Request-Id": request_id} if request_id else None
        return _answer(request, 500, f"Internal server error ({type(exc).__name__}); see the server log.",
                       headers=headers)  # fmt: skip
