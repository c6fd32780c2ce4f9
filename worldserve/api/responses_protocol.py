"""The OpenAI Responses API request (`POST /v1/responses`, as vLLM serves it) and its translation into the chat
completion request the Reasoner already answers (api/chat.py), so both routes share every check, media path,
grammar and sampler.

`input` is a string (one user message) or a list of items: messages (`role` + `content`, a string or parts:
`input_text` / `output_text` / `refusal` text, `input_image` with an `image_url` (a data: or http(s) URL, as a
chat image_url), `input_video` with a `video_url` (vLLM's)), `function_call` items (an assistant's call,
consecutive ones one assistant turn), `function_call_output` items (a tool turn) and `reasoning` items (dropped,
as Qwen's template drops earlier thoughts). `instructions` is a system message first. Function `tools` (flat:
name, description, parameters) and `tool_choice` ("auto", "none", "required", {"type": "function", "name"})
become the chat's; `text.format` (json_schema / json_object / text) its response_format; `max_output_tokens`
its max_tokens; `include: ["message.output_text.logprobs"]` with `top_logprobs` its logprobs;
`previous_response_id`'s stored conversation (api/responses_store.py) comes before the input, after the
instructions. `background` is a 400. `ChatPaths` turns an error naming a chat field back into the Responses
field the client sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worldserve.api.chat_protocol import ChatCompletionRequest, SamplingRequest
from worldserve.api.errors import APIError, validation_error

LOGPROBS = "message.output_text.logprobs"
INCLUDES = (LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url")
"""`include` values accepted (only the logprobs change the answer)."""


class InputPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "refusal", "input_image", "input_video", "input_file", "input_audio",
                  "reasoning_text", "summary_text"]  # fmt: skip
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    video_url: str | None = None
    file_id: str | None = None


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


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    """`reasoning`: accepted and echoed (the Reasoner thinks when asked to in the prompt, whatever the effort)."""

    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(SamplingRequest):
    """The Responses API fields (and vLLM's sampling extensions, shared with chat completions)."""

    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())


@dataclass
class ChatPaths:
    """Where each chat message came from in the Responses request, to name the field an error is about."""

    messages: list[str] = field(default_factory=list)
    """messages[i] -> "instructions", "input" or "input[j]"."""
    truncation: bool = False
    """truncate_prompt_tokens came from `truncation: auto` (else the client sent it: its own name stays)."""
    calls: dict[int, list[str]] = field(default_factory=dict)
    """messages[i] made of consecutive function_call items: the item each of its tool_calls came from."""

    def field(self, param: str | None) -> str | None:
        if param is None:
            return None
        if (m := re.match(r"messages\[(\d+)\]\.tool_calls\[(\d+)\]", param)) and int(m.group(2)) < len(
            items := self.calls.get(int(m.group(1)), ())
        ):  # a function_call item's own field: input[j].arguments, not ...tool_calls[k].function.arguments
            return items[int(m.group(2))] + param[m.end() :].replace(".function.", ".", 1)
        if (m := re.match(r"messages\[(\d+)\]", param)) and int(m.group(1)) < len(self.messages):
            return self.messages[int(m.group(1))] + param[m.end() :]
        renamed = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                   "response_format": "text.format", "logprobs": "include"}  # fmt: skip
        if self.truncation:
            renamed["truncate_prompt_tokens"] = "truncation"
        param = param.replace("response_format.json_schema", "response_format")
        head, _, rest = param.partition(".")
        return renamed.get(head, head) + ("." + rest if rest else "")

    def rename(self, exc: Exception) -> Exception:
        """`exc` (APIError or ParamError) naming the Responses field, its message too."""
        old = getattr(exc, "param", None)
        new = self.field(old)
        if old and new != old:
            exc.param = new
            if isinstance(getattr(exc, "message", None), str):
                exc.message = exc.message.replace(old, new).replace("in the messages", "in the input")
                if isinstance(exc, APIError):
                    exc.args = (exc.message,)
        return exc


def to_chat(
    req: ResponsesRequest, history: list[dict[str, Any]] = ()
) -> tuple[ChatCompletionRequest, ChatPaths, list[dict[str, Any]]]:
    """The chat completion request that answers `req` after `history` (the stored conversation of its
    previous_response_id, as chat messages), where its messages came from, and the conversation it
    continues (history + input, without the instructions: what a stored response keeps); APIError naming
    the Responses field for what this server does not take."""
    if req.background:
        raise APIError(400, "background responses are not supported", param="background")
    for value in req.include or ():
        if value not in INCLUDES:
            raise APIError(400, f"include value {value!r} is not supported (supported: {', '.join(INCLUDES)})",
                           param="include")  # fmt: skip
    paths = ChatPaths()
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
        paths.messages.append("instructions")
    messages += history
    paths.messages += ["previous_response_id"] * len(history)
    if not req.input:
        raise APIError(400, "input must not be empty", param="input")
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    calls: list | None = None  # the tool_calls of the assistant turn consecutive function_call items make
    for i, item in enumerate(items):
        where = "input" if isinstance(req.input, str) else f"input[{i}]"
        if item.type == "reasoning":
            continue
        if item.type == "function_call":
            if item.call_id is None or item.name is None:
                raise APIError(400, "a function_call item needs call_id and name", param=where)
            call = chat_tool_call(item.call_id, item.name, item.arguments or "{}")
            if calls is None:
                calls = []
                messages.append({"role": "assistant", "content": None, "tool_calls": calls})
                paths.messages.append(where)
                paths.calls[len(messages) - 1] = []
            calls.append(call)
            paths.calls[len(messages) - 1].append(where)
            continue
        calls = None
        if item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise APIError(400, "a function_call_output item needs call_id and output", param=where)
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output, where)}
            )
        else:
            if item.role is None:
                raise APIError(400, "a message item needs a role", param=where)
            messages.append({"role": item.role, "content": _content(item.content, where)})
        paths.messages.append(where)
    if not any(m["role"] != "system" for m in messages):  # e.g. reasoning items only: nothing to answer
        raise APIError(400, "input has no message, function call or function call output to answer (reasoning "
                       "items are dropped)", param="input")  # fmt: skip
    chat = req.model_dump(exclude={"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
                                   "include", "top_logprobs", "store", "background", "previous_response_id",
                                   "reasoning", "metadata", "user", "truncation", "n", "stream_options",
                                   "response_format"})  # fmt: skip
    chat.update(messages=messages, max_tokens=req.max_output_tokens, logprobs=req.logprobs,
                top_logprobs=req.top_logprobs if req.logprobs else None, tools=_tools(req.tools),
                tool_choice=_tool_choice(req.tool_choice), response_format=_format(req.text))  # fmt: skip
    conversation = messages[1:] if req.instructions is not None else list(messages)
    try:
        return ChatCompletionRequest.model_validate(chat), paths, conversation
    except ValidationError as exc:
        raise paths.rename(validation_error(exc.errors(), loc_prefix=())) from None


def chat_tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A function call (a function_call item, or one the answer made) as a chat assistant turn's tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _content(content: str | list[InputPart] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content (parts in the same order: content[j] names the same part)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, p in enumerate(content):
        if p.type in ("input_text", "output_text", "refusal"):
            parts.append({"type": "text", "text": (p.refusal if p.type == "refusal" else p.text) or ""})
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
                else "a part without its URL"
            )
            raise APIError(400, f"{what} are not supported: send images as image_url (a data: or http(s) URL)",
                           param=f"{where}.content[{j}]")  # fmt: skip
    return parts


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools (other tool types are a 400)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise APIError(400, "only function tools ({\"type\": \"function\", \"name\": ...}) are supported",
                           param=f"tools[{i}]")  # fmt: skip
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise APIError(
                400, "a tool's parameters are a JSON schema object", param=f"tools[{i}].parameters"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    """Responses' {"type": "function", "name": N} as the chat's {"type": "function", "function": {"name": N}}."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as the chat's response_format."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    for name, value in (("name", fmt.name), ("schema", fmt.schema_)):
        if value is None:
            raise APIError(400, f"a json_schema format needs its {name}", param=f"text.format.{name}")
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
    }
