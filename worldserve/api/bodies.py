"""Request-body readers shared by the routes: a size-bounded stream (413 past `--max-upload-mb`; a gzip or
deflate `Content-Encoding` undone as it streams in, api/content_encoding.py), the JSON
object of the JSON-only routes (chat completions, image generations; vLLM's `validate_json_request`) and its
validation as the route's model (`read_model`: parsed and validated off the event loop when large; the
top-level fields the model ignores are named in one warning, vLLM's), and
the strict form parsers of the video routes (`FormParts`: a multipart body must close with its final
boundary, and form text must be UTF-8; Starlette's parsers drop an unfinished last part and turn bad bytes
into other characters, so a cut body ran a job with the defaults of the fields it lost). `openapi_body`:
the OpenAPI requestBody of a route that reads its JSON itself (its models' schemas, refs inlined)."""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import re
import sys
import zlib
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar
from urllib.parse import unquote_to_bytes

from pydantic import BaseModel
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartParser
from starlette.requests import Request

from worldserve.api.content_encoding import BodyDecoder, UnsupportedEncoding, body_decoder
from worldserve.api.errors import APIError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

MAX_FORM_FIELDS = 1000
"""Form fields (and files) a video request may carry: Starlette's default, which vLLM-Omni's forms take (200
had refused clients that vLLM-Omni serves)."""


def upload_limit(max_bytes: int) -> str:
    """ "the 100 MiB limit (--max-upload-mb)", for the 413s of bodies and realtime session.starts."""
    mib = max_bytes / 2**20  # (a fraction of a MiB shown as given: 0.01, not its whole bytes' 0.00999928)
    shown = f"{mib:.3g}" if mib < 1 else f"{mib:g}"
    return f"the {shown} MiB limit (--max-upload-mb)"


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"Request body exceeds {upload_limit(max_bytes)}.")


DECODED_BODY = "worldserve.body_decoded"
"""The request scope's mark of a body kept decoded (`read_json_object_again`): read again, it is not inflated
a second time."""


async def bounded_stream(request: Request, max_bytes: int) -> AsyncGenerator[bytes, None]:
    """The body's chunks, its `Content-Encoding` (gzip, deflate) undone; a 413 as soon as they, sent or
    inflated, pass `max_bytes` (a declared Content-Length fails first), a 415 for another encoding, a 400 for
    a body that does not inflate. (vLLM reads a gzipped body as JSON and answers "Invalid JSON"; curl's
    --compressed-request, httpx / requests with a gzipped body and proxies that compress uploads send it so.)"""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large(max_bytes)
    decoder = None if request.scope.get(DECODED_BODY) else _body_decoder(request)
    sent = total = 0
    async for chunk in request.stream():
        sent += len(chunk)
        if sent > max_bytes:
            raise too_large(max_bytes)
        if decoder is not None:
            chunk = _inflated(decoder, request, chunk, max_bytes - total + 1)
        total += len(chunk)
        if total > max_bytes:
            raise too_large(max_bytes)
        if chunk:
            yield chunk
    if decoder is not None and (rest := _inflated(decoder, request, None, max_bytes - total + 1)):
        if total + len(rest) > max_bytes:
            raise too_large(max_bytes)
        yield rest


def _body_decoder(request: Request) -> BodyDecoder | None:
    """The decoder of the request's `Content-Encoding` (None: identity); a 415 naming another one."""
    encoding = request.headers.get("content-encoding")
    try:
        return body_decoder(encoding)
    except UnsupportedEncoding:
        raise APIError(415, f"Content-Encoding {encoding!r} is not decoded here: send the body as it is, or "
                       "gzip / deflate it", param="Content-Encoding",
                       headers={"Accept-Encoding": "gzip, deflate"}) from None  # fmt: skip


def _inflated(decoder: BodyDecoder, request: Request, chunk: bytes | None, limit: int) -> bytes:
    """`chunk` inflated (None: what is left once the body has ended), at most `limit` bytes; a 400 when the body
    is not the compressed data its Content-Encoding says."""
    try:
        return decoder.take(chunk, limit)
    except zlib.error:
        encoding = request.headers.get("content-encoding", "")
        raise APIError(400, f"Invalid request body: it is not the {encoding.strip().lower()} data its "
                       "Content-Encoding says", param="Content-Encoding") from None  # fmt: skip


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: the only way one reaches a parsed body (raw bytes fail to decode)."""


def check_unicode(value: Any, raw: str | bytes | None = None) -> None:
    """A 400 naming the field when a string in `value` (a parsed body, or `raw` JSON text's parse) is not
    encodable text: JSON may escape a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or UTF-8
    response can carry. Given `raw`, nothing is walked unless it holds a surrogate escape (fast on big
    bodies); the walk is iterative (deep nesting cannot overflow the stack)."""
    if raw is not None and not SURROGATE_ESCAPE.search(
        raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    ):
        return
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = _path_text(path) or "body"
                raise APIError(400, f"{where}: not valid Unicode text (a lone surrogate at character "
                               f"{exc.start})", param=where) from None  # fmt: skip
        elif isinstance(item, dict):
            stack.extend((k, path) for k in item)
            stack.extend((v, (*path, k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(item))


MAX_JSON_DEPTH = 128
"""Deepest nesting of objects / lists a request may send. What reads a value recursively (the chat template,
pydantic, a grammar compiler) must never meet a depth near Python's recursion limit (1000 frames; the
template's helpers spend ~2 a level): a 400 here instead of a RecursionError (500) there."""


def too_deep(param: str) -> str:
    """The 400's message for JSON nested deeper than MAX_JSON_DEPTH, whether check_depth found it or the parser
    ran out of stack first (which happens first depends on the caller's own stack depth)."""
    return f"{param}: JSON nested deeper than {MAX_JSON_DEPTH} levels"


def check_depth(value: Any, where: str = "body") -> None:
    """A 400 naming the field when `value` (parsed JSON) nests deeper than MAX_JSON_DEPTH; iterative, and
    visiting containers only (a 90 MB body of numbers costs what its lists do, not a step per number)."""
    stack = [(value, 0)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            path = _path_to_depth(value, MAX_JSON_DEPTH)
            inside = _path_text(path[:4])
            param = where if where != "body" or not isinstance(path[0], str) else path[0]
            raise APIError(400, f"{too_deep(param)} (at {inside or where}...)", param=param)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((v, depth + 1) for v in children if isinstance(v, dict | list))


def _path_to_depth(value: Any, depth: int) -> tuple:
    """The keys / indexes down to the first container `depth` levels deep (for check_depth's message)."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if len(path) >= depth:
            return path
        children = item.items() if isinstance(item, dict) else enumerate(item)
        stack.extend((v, (*path, k)) for k, v in children if isinstance(v, dict | list))
    return ()


def _path_text(path: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Constant(float):
    """A NaN / Infinity / -Infinity literal as Python's json parses it, marked so that it can be found."""


def _constant_path(data: Any) -> str | None:
    """Where the first _Constant in `data` is, as a field path ("tools[0].parameters.maximum"; None: the root),
    cut to 200 characters."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _Constant):
            return path[:200] or None
        if isinstance(value, dict):
            stack += [(v, f"{path}.{k}" if path else str(k)) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value)))]
    return None


def parse_json(body: str | bytes, what: str = "JSON body") -> Any:
    """json.loads with every failure a 400 ("Invalid <what>: ..."): bad JSON, bad UTF-8, a number too long to
    convert, nesting deeper than MAX_JSON_DEPTH (or the parser's stack), a lone surrogate, and the NaN /
    Infinity literals Python's json takes and JSON does not (named by their field: echoed into an answer,
    they made it unserialisable, a 500 on the request and on every read of a stored Responses answer)."""
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)
        return _Constant(name)

    try:
        data = json.loads(body, parse_constant=constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"Invalid {what}: {exc}", request_validation=True) from None
    except ValueError:  # Python's int-from-text limit (sys.get_int_max_str_digits)
        raise APIError(400, f"Invalid {what}: a number longer than {sys.get_int_max_str_digits()} digits",
                       request_validation=True) from None  # fmt: skip
    except RecursionError:
        raise APIError(400, f"Invalid {what}: nested too deeply", request_validation=True) from None
    if isinstance(body, str):
        brackets = body.count("{") + body.count("[")
    else:
        brackets = body.count(b"{") + body.count(b"[")
    if brackets >= MAX_JSON_DEPTH:  # (fewer cannot nest that deep)
        check_depth(data)
    check_unicode(data, body)
    if constants:
        where = _constant_path(data)
        raise APIError(400, f"Invalid {what}: {constants[0]} is not a JSON number"
                       + (f" (in {where})" if where else ""), param=where, request_validation=True)  # fmt: skip
    return data


INLINE_JSON_BYTES = 1 << 20
"""JSON bodies up to this size are parsed on the event loop; larger ones (a chat of base64 images, up to
--max-upload-bytes) on a thread, so one client's 100 MB body does not hold every other request meanwhile."""


async def parse_json_body(body: bytes) -> Any:
    """`parse_json` of a request body, off the event loop when it is large (INLINE_JSON_BYTES)."""
    if len(body) <= INLINE_JSON_BYTES:
        return parse_json(body)
    return await asyncio.to_thread(parse_json, body)


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; a 400 for another content type, bad JSON or a non-object, a 413 past
    `max_bytes`."""
    return (await _json_object(request, max_bytes))[0]


async def read_json_object_again(request: Request, max_bytes: int) -> dict[str, Any]:
    """`read_json_object`, the body then kept where Starlette's `request.stream()` gives it again (its
    `request.body()` cache): a dispatching route (/invocations) reads it, then hands the request on."""
    data, _ = await _json_object(request, max_bytes, keep=True)
    return data


async def read_model(
    request: Request, model: type[M], max_bytes: int, precheck: Callable[[dict[str, Any]], None] | None = None
) -> M:
    """The JSON object body validated as `model`, as `read_json_object` reads it (a ValidationError is the
    route's 400); `precheck` sees the object first. A large body is validated off the event loop too: 2.3 M
    chat messages in 67 MB took pydantic 7 s, every other request waiting."""
    data, size = await _json_object(request, max_bytes)
    if precheck is not None:
        precheck(data)
    if size <= INLINE_JSON_BYTES:
        parsed = model.model_validate(data)
    else:
        parsed = await asyncio.to_thread(model.model_validate, data)
    log_ignored_fields(model, data)
    return parsed


IGNORED_NAMES_SHOWN = 20
"""The most ignored field names one warning lists (each cut at 64 characters: a body may send thousands)."""


def log_ignored_fields(model: type[BaseModel], data: dict[str, Any]) -> None:
    """vLLM's warning for a request's top-level fields that `model` ignores (extra="ignore": a field of a
    newer API or a misspelled one is not an error, but it is said once, in vLLM's words)."""
    if model.model_config.get("extra") != "ignore":
        return
    known = set(model.model_fields)
    known |= {f.alias for f in model.model_fields.values() if f.alias}
    known |= {f.validation_alias for f in model.model_fields.values() if isinstance(f.validation_alias, str)}
    ignored = sorted(k for k in data if k not in known)
    if ignored:
        shown = [k[:64] for k in ignored[:IGNORED_NAMES_SHOWN]]
        more = (
            f" (and {len(ignored) - IGNORED_NAMES_SHOWN} more)" if len(ignored) > IGNORED_NAMES_SHOWN else ""
        )
        log.warning("The following fields were present in the request but ignored: %s%s", set(shown), more)


def fits_context(field: str, max_model_len: int | None) -> Callable[[dict[str, Any]], None]:
    """A `read_model` precheck: a 400 naming `field` when its list has more items (chat messages, Responses
    input items, each at least one token) than the context holds tokens, before pydantic builds an object
    of each (a 67 MB body of 2.3 M messages took 2.6 GB)."""

    def check(data: dict[str, Any]) -> None:
        items = data.get(field)
        if max_model_len is not None and isinstance(items, list) and len(items) > max_model_len:
            raise APIError(400, f"{field} has {len(items):,} items: more than the {max_model_len:,} tokens of "
                           "this model's context (each takes at least one)", param=field)  # fmt: skip

    return check


async def _json_object(request: Request, max_bytes: int, keep: bool = False) -> tuple[dict[str, Any], int]:
    """(the body's JSON object, its size in bytes); `keep`: the body kept to be read again."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        # (no header at all is said so: it read "Unsupported content type 'none'", a type no client sent)
        given = f"Unsupported content type {ctype!r}" if ctype else "No Content-Type header"
        raise APIError(400, f"{given}: send application/json", request_validation=True)
    body = b"".join([chunk async for chunk in bounded_stream(request, max_bytes)])
    if keep:
        request._body = body  # (Starlette's own cache, which request.stream() and .body() read first)
        request.scope[DECODED_BODY] = True
    data = await parse_json_body(body)
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object", request_validation=True)
    return data, len(body)


class FormParts(MultiPartParser):
    """Starlette's multipart parser, strict: a text part that is not UTF-8 (or the Content-Type's `charset`) is
    a 400 naming it, and `parse()` is a 400 when the body ends before its closing `--boundary--` (a cut upload
    or a cut field would otherwise be dropped in silence). Parts named in `uploads` are left to their route,
    which says they must be file uploads when they come as text."""

    closed = False
    uploads = frozenset(("input_reference",))

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None and part.field_name not in self.uploads:
            _form_text(bytes(part.data), part.field_name, self._charset)
        super().on_part_end()

    def on_end(self) -> None:
        self.closed = True
        super().on_end()

    async def parse(self) -> FormData:
        # (Starlette reads an unknown charset as latin-1, which decodes any bytes: a UTF-8 prompt came out
        # garbled, with no error)
        _, params = parse_options_header(self.headers.get("Content-Type", ""))
        charset = params.get(b"charset", b"utf-8").decode("latin-1")
        try:
            codecs.lookup(charset)
        except LookupError:
            raise APIError(
                400, f"Invalid form body: unknown charset {charset!r} in its Content-Type."
            ) from None
        form = await super().parse()
        if not self.closed:
            await form.close()
            raise APIError(
                400, "Invalid form body: it ends before the closing boundary (a truncated upload?)."
            )
        return form


def parse_urlencoded(body: bytes) -> FormData:
    """An application/x-www-form-urlencoded body's fields, as Starlette's form holds them (every value of a
    repeated name); a value that is not UTF-8 once unquoted is a 400 naming its field."""
    pairs = [pair for pair in body.split(b"&") if pair]
    if len(pairs) > MAX_FORM_FIELDS:
        raise APIError(400, f"Too many fields. Maximum number of fields is {MAX_FORM_FIELDS}.")
    fields: list[tuple[str, str | UploadFile]] = []
    for pair in pairs:
        raw_name, _, raw_value = pair.partition(b"=")
        name = _form_text(unquote_to_bytes(raw_name.replace(b"+", b" ")), "")
        fields.append((name, _form_text(unquote_to_bytes(raw_value.replace(b"+", b" ")), name)))
    return FormData(fields)


def _form_text(data: bytes, field: str, charset: str = "utf-8") -> str:
    try:
        return data.decode(charset)
    except (UnicodeDecodeError, LookupError):
        raise APIError(400, f"{field or 'a field name'}: the form value is not valid {charset} text.",
                       param=field or None) from None  # fmt: skip


def openapi_body(*models: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that reads its JSON itself: the fields of `models` (several: the
    route's forms, told apart by their fields) in one object schema."""
    schemas = [
        inline_refs(schema, schema.get("$defs", {})) for schema in (m.model_json_schema() for m in models)
    ]
    schema = schemas[0]
    if len(schemas) > 1:
        properties = {k: v for s in reversed(schemas) for k, v in s["properties"].items()}
        forms = " or ".join(" + ".join(s.get("required", [])) for s in schemas)
        schema = {"type": "object", "description": f"Forms: {forms}.", "properties": properties}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """A JSON schema with every local `$ref` replaced by its definition (OpenAPI gets no dangling refs)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [inline_refs(v, defs) for v in node]
    return node
