"""`--enable-log-requests` (vLLM's flag): one INFO line a generating request once it is accepted (chat, text
completion and Responses requests, video jobs, image generations, realtime video sessions), on the
`worldserve.requests` logger: its id (the one its answer carries), its prompt (the first `--max-log-len`
characters, as vLLM cuts it; a chat's messages as `role: text`, media as <image> / <video>) and its
parameters (a chat's sampling fields that differ from their defaults, a video's every field; a video job's
line also names the request's own id, X-Request-Id or a sync request's, beside the job's). A request stopped
before its end (its client left, a DELETE of a job in flight, a shutdown) gets an "Aborted request" line, as
vLLM logs its aborts (`aborted`; chats through `AbortLogged`, the meter their events pass). Off by default:
prompts are the users' data."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worldserve.chat_params import ChatParams
from worldserve.params import VideoParams

log = logging.getLogger("worldserve.requests")

_NOT_SAMPLING = {"messages", "prompt_ids", "prebuilt", "bad_word_ids", "chat_template_kwargs", "tools",
                 "structured", "image_min_pixels", "image_max_pixels", "think_first", "stops_after_thoughts",
                 "cache_salt"}  # fmt: skip
"""ChatParams fields that are the prompt or its rendering (or the client's cache salt), not how it is sampled."""
_CHAT_DEFAULTS = ChatParams(messages=())
MEDIA = {"image_url": "<image>", "video_url": "<video>"}
"""How a chat's media parts show in its logged prompt."""


PROMPT_TEXTS = ("negative_prompt", "system_prompt")
"""VideoParams' texts besides the prompt that --max-log-len cuts as it cuts the prompt."""


@dataclass(frozen=True, slots=True)
class RequestLog:
    """Where accepted requests are logged (`max_len`: --max-log-len, None: whole prompts)."""

    max_len: int | None = None

    def received(self, request_id: str, prompt: str, params: Mapping[str, Any], /, **more: Any) -> None:
        """The line of one request: its prompt cut to `max_len`, then its params and `more` (e.g. counts)."""
        if self.max_len is not None:
            prompt = prompt[: self.max_len]
        extra = "".join(f", {k}: {v}" for k, v in more.items())
        log.info("Received request %s: prompt: %r, params: %s%s.", request_id, prompt, _shown(params), extra)

    def chat(
        self, request_id: str, messages: Sequence[Any], params: ChatParams, n: int, prompt_tokens: int
    ) -> None:
        """A chat (or Responses) request: `messages` as the API read them (chat_messages.ChatMessageIn)."""
        self.received(request_id, chat_text(messages), {**sampling(params), **({"n": n} if n > 1 else {})},
                      prompt_tokens=prompt_tokens)  # fmt: skip

    def aborted(self, request_id: str, why: str) -> None:
        """A request stopped before its end (vLLM's "Aborted request" line), and why."""
        log.info("Aborted request %s (%s).", request_id, why)

    def video(
        self,
        request_id: str,
        params: VideoParams,
        reference: bytes | None = None,
        *,
        http_id: str | None = None,
    ) -> None:
        """A video job, an image generation or a realtime session: its prompt and every other field (a
        `reference` upload, decoded later by the engine, as its size; `http_id`: the HTTP request's own id,
        when it is not `request_id`)."""
        fields = {
            f.name: _brief(getattr(params, f.name))
            for f in dataclasses.fields(params)
            if f.name
            not in ("prompt", "field_names")  # (where the request's values came in: not one of them)
        }
        for text in PROMPT_TEXTS:  # (the request's own texts: cut as the prompt is, --max-log-len)
            if isinstance(fields.get(text), str) and self.max_len is not None:
                fields[text] = fields[text][: self.max_len]
        if reference is not None:
            fields["reference"] = f"<{len(reference)} bytes>"
        more = {"request_id": http_id} if http_id is not None and http_id != request_id else {}
        self.received(request_id, params.prompt, fields, **more)


class AbortLogged:
    """A chat meter (engine/chat_metering.py) that passes the counts on to `meter` and logs the request's abort
    once: a choice that ends without a finish reason (its client left, a failure, a shutdown)."""

    def __init__(self, meter: Any, request_log: RequestLog, request_id: str) -> None:
        self.meter, self.request_log, self.request_id = meter, request_log, request_id
        self.logged = False

    def on_chat_started(self, prompt_tokens: int) -> None:
        self.meter.on_chat_started(prompt_tokens)

    def on_chat_ended(self, finish_reason: str | None) -> None:
        self.meter.on_chat_ended(finish_reason)
        if finish_reason is None and not self.logged:
            self.logged = True
            self.request_log.aborted(
                self.request_id, "ended before its answer: client gone, failed or shut down"
            )


def sampling(params: ChatParams) -> dict[str, Any]:
    """The sampling fields of `params` that differ from ChatParams' defaults (max_tokens always: None is up to
    the context)."""
    out: dict[str, Any] = {"max_tokens": params.max_tokens}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if (
            f.name not in _NOT_SAMPLING
            and f.name != "max_tokens"
            and value != getattr(_CHAT_DEFAULTS, f.name)
        ):
            out[f.name] = value
    if params.structured is not None:
        out["structured"] = params.structured.kind
    if params.tools:
        out["tools"] = len(params.tools)
    return out


def chat_text(messages: Sequence[Any]) -> str:
    """A chat's messages as one text: `role: content` lines, media parts as <image> / <video>."""
    lines = []
    for msg in messages:
        content = msg.content
        if isinstance(content, list):
            content = "".join(
                p.text or "" if p.type == "text" else MEDIA.get(p.type, f"<{p.type}>") for p in content
            )
        lines.append(f"{msg.role}: {content or ''}")
    return "\n".join(lines)


def _brief(value: Any) -> Any:
    """A reference image's or video's frames as their shape, not their pixels."""
    shape = getattr(value, "shape", None)
    return f"<{'x'.join(map(str, shape))} array>" if shape is not None else value


def _shown(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items())
