"""The Responses API's `input` items (api/responses_protocol.py's request) as the chat messages the Reasoner's
chat route answers, made as vLLM makes them (`construct_chat_messages_with_tool_call` in
vllm/entrypoints/openai/responses/utils.py, since vllm-project/vllm#42189): each item is a chat message, and
an assistant-side item merges into the assistant message just before it when that message came from this
input (never into the instructions or a previous response's conversation):

- a `function_call` item is one of that message's `tool_calls` (appended), else a new assistant turn;
- a `reasoning` item is that message's `reasoning` when it has none yet, else a new assistant turn with only
  its `reasoning` (the text of its first `content` part, else of its first `summary` part, else ""; an
  `encrypted_content` is a 400, as vLLM's "Encrypted content is not supported."). The chat template gets it as
  the turn's earlier thoughts (runner/chat_prompt.py passes it as `reasoning` and `reasoning_content`);
- an assistant `message` item is that message's `content` when it has none yet (a reasoning or tool call turn),
  else a new assistant turn;
- `function_call_output` items are tool turns, other messages (user, system, developer) their own turns.

So [reasoning, message] is one assistant turn with its thoughts and answer, [reasoning, function_call, ...] one
turn with its thoughts and calls. When the last item is a message or reasoning item whose `status` is
"in_progress" or "incomplete", the chat continues it (`continue_final_message`, no generation prompt), as
vLLM's `should_continue_final_message`. `ChatPaths` remembers which item each message, content and tool call
came from, to turn an error naming a chat field back into the Responses field the client sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from worldserve.api.chat_messages import ImageDetail
from worldserve.api.errors import APIError
from worldserve.params import ParamError

_Named = TypeVar("_Named", bound=APIError | ParamError)
"""An error naming a request field (ChatPaths.rename)."""

PARTIAL = ("in_progress", "incomplete")
"""Statuses of a last message or reasoning item that the answer continues."""


class InputPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "refusal", "input_image", "input_video", "input_file", "input_audio",
                  "reasoning_text", "summary_text"]  # fmt: skip
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    video_url: str | None = None
    file_id: str | None = None
    detail: ImageDetail | None = None
    """An input_image's detail, checked as the chat route checks it (OpenAI's values)."""


class InputItem(BaseModel):
    """A message, function_call, function_call_output, reasoning or item_reference item (their fields
    together; a reference is replaced by the stored item it names before `to_chat`)."""

    model_config = ConfigDict(extra="ignore")
    type: (
        Literal["message", "function_call", "function_call_output", "reasoning", "item_reference"] | None
    ) = "message"  # (None: the SDK's ItemReference may leave it out or null it)
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[InputPart] | None = None
    """A reasoning item's summary parts (its thoughts when it has no content)."""
    encrypted_content: str | None = None
    status: str | None = None
    """A message or reasoning item's: "in_progress" / "incomplete" on the last item continue it."""


@dataclass
class ChatPaths:
    """Where each chat message came from in the Responses request, to name the field an error is about."""

    messages: list[str] = field(default_factory=list)
    """messages[i] -> "instructions", "input", "input[j]" or "previous_response_id" (its first item)."""
    calls: dict[int, list[str]] = field(default_factory=dict)
    """messages[i]'s tool_calls: the function_call item each came from."""
    contents: dict[int, str] = field(default_factory=dict)
    """messages[i]'s content, where it came from an item merged into a turn that began with another."""

    def field(self, param: str | None) -> str | None:
        if param is None:
            return None
        if (m := re.match(r"messages\[(\d+)\]\.tool_calls\[(\d+)\]", param)) and int(m.group(2)) < len(
            items := self.calls.get(int(m.group(1)), ())
        ):  # a function_call item's own field: input[j].arguments, not ...tool_calls[k].function.arguments
            return items[int(m.group(2))] + param[m.end() :].replace(".function.", ".", 1)
        if (m := re.match(r"messages\[(\d+)\](?=\.content)", param)) and int(m.group(1)) in self.contents:
            return self.contents[int(m.group(1))] + param[m.end() :]
        if (m := re.match(r"messages\[(\d+)\]", param)) and int(m.group(1)) < len(self.messages):
            return self.messages[int(m.group(1))] + param[m.end() :]
        renamed = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                   "response_format": "text.format", "logprobs": "include",
                   "continue_final_message": "input"}  # fmt: skip
        param = param.replace("response_format.json_schema", "response_format")
        head, _, rest = param.partition(".")
        return renamed.get(head, head) + ("." + rest if rest else "")

    def rename(self, exc: _Named) -> _Named:
        """`exc` (APIError or ParamError) naming the Responses field, its message too (the chat's
        response_format, named beside another field, as text.format)."""
        old = exc.param
        new = self.field(old)
        message = exc.message.replace("response_format", "text.format")
        if old and new is not None and new != old:  # (a field is named again: never None)
            exc.param = new
            whole = " the instructions and input" if "instructions" in self.messages else " the input"
            message = message.replace(" the messages", whole).replace(old, new)
        if message != exc.message:
            exc.message = message
            if isinstance(exc, APIError):
                exc.args = (message,)
        return exc


def input_messages(items: list[InputItem], wheres: list[str], paths: ChatPaths) -> list[dict[str, Any]]:
    """The chat messages of `items` (`wheres`: each item's Responses field), merged as vLLM merges them (the
    module docstring); `paths` (which holds the messages before them) learns where each came from; APIError
    naming the item's field for an item this server cannot take."""
    messages: list[dict[str, Any]] = []
    first = len(paths.messages)  # the chat index of this input's first message
    for item, where in zip(items, wheres, strict=True):
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        at = first + len(messages) - 1  # `last`'s chat index
        if item.type == "function_call":
            if item.call_id is None or item.name is None:
                raise APIError(400, "a function_call item needs call_id and name", param=where)
            call = chat_tool_call(item.call_id, item.name, item.arguments or "{}")
            if last is None:
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
                paths.messages.append(where)
                last, at = messages[-1], at + 1
            last.setdefault("tool_calls", []).append(call)
            paths.calls.setdefault(at, []).append(where)
        elif item.type == "reasoning":
            thoughts = _thoughts(item, where)
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = thoughts
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": thoughts})
                paths.messages.append(where)
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise APIError(400, "a function_call_output item needs call_id and output", param=where)
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output, where)}
            )
            paths.messages.append(where)
        elif item.role is None:
            raise APIError(400, "a message item needs a role", param=where)
        elif item.role == "assistant" and last is not None and last["content"] is None:
            last["content"] = _content(item.content, where)
            paths.contents[at] = where
        else:
            messages.append({"role": item.role, "content": _content(item.content, where)})
            paths.messages.append(where)
    return messages


def continues_final(items: list[InputItem]) -> bool:
    """Whether the answer continues the last item (a message or reasoning item left partial), as vLLM's
    should_continue_final_message decides."""
    last = items[-1] if items else None
    return last is not None and last.type in (None, "message", "reasoning") and last.status in PARTIAL


def chat_tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A function call (a function_call item, or one the answer made) as a chat assistant turn's tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _thoughts(item: InputItem, where: str) -> str:
    """A reasoning item's text: its first content part's, else its first summary part's, else "" (vLLM's)."""
    if item.encrypted_content:
        raise APIError(400, "Encrypted content is not supported.", param=f"{where}.encrypted_content")
    if isinstance(item.content, str):
        raise APIError(
            400, "a reasoning item's content is a list of reasoning_text parts", param=f"{where}.content"
        )
    parts = item.content or item.summary
    return (parts[0].text or "") if parts else ""


def _content(content: str | list[InputPart] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content (parts in the same order: content[j] names the same part)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, p in enumerate(content):
        if p.type in ("input_text", "output_text", "refusal"):
            field = "refusal" if p.type == "refusal" else "text"
            if getattr(p, field) is None:  # (OpenAI's: required; it read as an empty text)
                raise APIError(
                    400, f"{p.type} parts need their {field}", param=f"{where}.content[{j}].{field}"
                )
            parts.append({"type": "text", "text": getattr(p, field)})
        elif p.type == "input_image" and p.image_url is not None:
            parts.append({"type": "image_url", "image_url": {"url": p.image_url}})
        elif p.type == "input_video" and p.video_url is not None:
            parts.append({"type": "video_url", "video_url": {"url": p.video_url}})
        else:
            what = (
                "file ids"
                if p.file_id is not None
                else f"{p.type} parts"
                if p.type in ("input_file", "input_audio")
                else "parts without their URL"
            )
            raise APIError(400, f"{what} are not supported: send images as image_url (a data: or http(s) URL)",
                           param=f"{where}.content[{j}]")  # fmt: skip
    return parts
