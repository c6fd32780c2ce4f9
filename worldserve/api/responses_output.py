"""The Responses output of one chat's deltas (ResponseBuilder): output items, the stream's events, the response.

The chat's text goes through the same parsers as a chat answer's (api/chat_stream.py TextParsing: reasoning,
then tool calls) and becomes the Responses output items: a `reasoning` item (its thoughts as `reasoning_text`),
a `message` item (`output_text`, with logprobs when asked) and a `function_call` item per tool call. Streamed,
each item's opening, growth and closing are semantic events (SSE text with their `sequence_number`); at the
end, the response object with its status and usage. Apart from the route (api/responses.py), which checks the
request, runs the chat and stores the answer: this is the wire shape of the answer alone.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from worldserve.api.chat_stream import TextParsing, logprob_items
from worldserve.engine.client import ChatDelta


class ResponseBuilder:
    """One chat's deltas -> the Responses output items, and the stream's events (SSE text) as they open, grow
    and close. Text goes through the same parsers as a chat answer's: reasoning, then tool calls."""

    def __init__(
        self,
        skeleton: dict[str, Any],
        parsing: TextParsing,
        logprobs: bool,
        prompt_tokens: int,
        cached: int = 0,
    ):
        self.body, self.logprobs, self.prompt_tokens = skeleton, logprobs, prompt_tokens
        self.cached_tokens = cached  # prompt tokens found in the prefix cache
        self.answer, self.keep_thoughts, self.parsing = parsing.stream(), parsing.include_reasoning, parsing
        self.seq = 0
        self.item: dict[str, Any] | None = None  # the open output item
        self.completion_tokens, self.reasoning_tokens = 0, 0
        self.finish_reason: str | None = None
        self.pending: list = []  # logprob entries of tokens whose text is not out yet (a partial character)

    # ---------------------------------------------------------------- events
    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def head(self) -> list[str]:
        return [
            self._event("response.created", response=self.body),
            self._event("response.in_progress", response=self.body),
        ]

    def feed(self, delta: ChatDelta) -> list[str]:
        """The events of one delta (its text through the reasoning and tool parsers)."""
        finished = delta.finish_reason is not None
        self.completion_tokens, self.finish_reason = delta.completion_tokens, delta.finish_reason
        # the thought tokens come on the last delta (0 without --reasoning-parser, as vLLM reports them then)
        self.reasoning_tokens = self.parsing.reasoning_tokens(delta.reasoning_tokens) or 0
        self.pending += delta.logprobs
        out: list[str] = []
        for d in self.answer.feed(delta.text, finished):
            if "reasoning_content" in d:
                self.pending = []  # thought tokens: no output_text logprobs (kept or dropped)
                out += self._reasoning(d["reasoning_content"]) if self.keep_thoughts else []
            else:
                out += self._text(d["content"]) if "content" in d else self._call(d["tool_calls"][0])
        if finished and not self.body["output"]:  # an answer with no text still has its (empty) message
            out += self._text("", empty=True)
        if finished:
            if self.item is not None and self.item["type"] == "message" and self.logprobs and self.pending:
                out += self._textless()
            out += self._close(last=True)
        return out

    def _textless(self) -> list[str]:
        """The logprobs of the message's last tokens, which wrote no text (the token that ended the chat, those
        of a stop string cut from it): an output_text.delta with an empty delta carries them, as vLLM's last
        delta (its text "") carries the ending token's."""
        lp = [e.model_dump() for e in logprob_items(self.pending)]
        self.pending = []
        self._opened()["content"][0]["logprobs"] += lp
        return [
            self._event("response.output_text.delta", **self._where(), content_index=0, delta="", logprobs=lp)
        ]

    def _open(self, item: dict[str, Any], announced: dict[str, Any] | None = None) -> list[str]:
        """Open `item` (closing the open one); `announced`: fields shown otherwise in its added event (a
        message's parts come in their own content_part.added events)."""
        out = self._close()
        self.item = item
        self.body["output"].append(item)
        return out + [self._event("response.output_item.added", output_index=len(self.body["output"]) - 1,
                                  item={**item, **(announced or {})})]  # fmt: skip

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._opened()["id"], "output_index": len(self.body["output"]) - 1}

    def _opened(self) -> dict[str, Any]:
        """The open output item, which a delta adds to (each item is opened before its deltas)."""
        assert self.item is not None
        return self.item

    def _reasoning(self, text: str) -> list[str]:
        out = [] if self.item is not None and self.item["type"] == "reasoning" else self._open(
            {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
             "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})  # fmt: skip
        self._opened()["content"][0]["text"] += text
        return out + [
            self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        ]

    def _text(self, text: str, empty: bool = False) -> list[str]:
        """Output text: the message item (opened on the first), with the logprobs of the tokens that wrote it."""
        if not text and not empty:
            return []
        out: list[str] = []
        if self.item is None or self.item["type"] != "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._open({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                               "status": "in_progress", "content": [part]}, announced={"content": []})  # fmt: skip
            out.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                   part=dict(part)))  # fmt: skip
        lp = [e.model_dump() for e in logprob_items(self.pending)] if self.logprobs and text else []
        if text:
            self.pending = []
        part = self._opened()["content"][0]
        part["text"] += text
        part["logprobs"] += lp
        if not text:
            return out
        return out + [self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                  logprobs=lp)]  # fmt: skip

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A tool-call delta from ToolStream: a new call (id, name, arguments so far) or more arguments."""
        self.pending = []  # call tokens: no output_text logprobs
        out: list[str] = []
        if "id" in call:
            out += self._open({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                               "name": call["function"]["name"], "arguments": "", "status": "in_progress"})  # fmt: skip
        args = call["function"].get("arguments") or ""
        if args:
            self._opened()["arguments"] += args
            out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=args))
        return out

    def _close(self, last: bool = False) -> list[str]:
        """Close the open item: its done events. An item that another followed is complete; the `last` one is
        "incomplete" when max_output_tokens cut the answer (the same whether the deltas came one by one or in
        one piece: the status had followed the finish reason known when the item closed)."""
        item, self.item = self.item, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.body["output"].index(item)}
        item["status"] = "incomplete" if last and self.finish_reason == "length" else "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                logprobs=part["logprobs"]),
                    self._event("response.content_part.done", **where, content_index=0, part=part)]  # fmt: skip
        elif item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                   text=item["content"][0]["text"]))  # fmt: skip
        else:
            out.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=item["arguments"]))  # fmt: skip
        return out + [self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    # ---------------------------------------------------------------- the end
    def response(self) -> dict[str, Any]:
        """The finished response object."""
        self._close(last=True)
        cut = self.finish_reason == "length"
        self.body.update(
            status="incomplete" if cut else "completed",
            completed_at=None if cut else int(time.time()),  # (OpenAI's: only when completed)
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={"input_tokens": self.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
                   "output_tokens": self.completion_tokens,
                   "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                   "total_tokens": self.prompt_tokens + self.completion_tokens},
        )  # fmt: skip
        return self.body

    def done(self) -> str:
        return self._event("response.completed", response=self.response())

    def failed(self, status: int, message: str) -> str:
        self.body.update(status="failed", error={"code": "server_error" if status >= 500 else "invalid_prompt",
                                                 "message": message})  # fmt: skip
        return self._event("response.failed", response=self.body)
