"""The OpenAI Responses API request (`POST /v1/responses`, as vLLM serves it) and its translation into the chat
completion request the Reasoner already answers (api/chat.py), so both routes share every check, media path,
grammar and sampler.

`input` is a string (one user message) or a list of items (api/responses_input.py makes them chat messages as
vLLM does): messages (`role` + `content`, a string or parts: `input_text` / `output_text` / `refusal` text,
`input_image` with an `image_url` (a data: or http(s) URL, as a chat image_url), `input_video` with a
`video_url` (vLLM's)), `function_call` items (an assistant's calls), `function_call_output` items (a tool turn)
and `reasoning` items (an assistant turn's earlier thoughts, for the chat template), an assistant's reasoning,
answer and calls merged into one turn. `instructions` is a system message first. Function `tools` (flat:
name, description, parameters) and `tool_choice` ("auto", "none", "required", {"type": "function", "name"})
become the chat's; `text.format` (json_schema / json_object / text) its response_format; `max_output_tokens`
its max_tokens; `include: ["message.output_text.logprobs"]` with `top_logprobs` its logprobs;
`previous_response_id`'s stored conversation (api/responses_store.py) comes before the input, after the
instructions. `background` and a `prompt` template are 400s; `service_tier` is checked and echoed. `ChatPaths`
(api/responses_input.py) turns an error naming a chat field back into the Responses field the client sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worldserve.api.chat_protocol import ChatCompletionRequest, SamplingRequest
from worldserve.api.errors import APIError, validation_error
from worldserve.api.responses_input import ChatPaths, InputItem, continues_final, input_messages
from worldserve.param_errors import InvalidRequest

LOGPROBS = "message.output_text.logprobs"
INCLUDES = (LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url")
"""`include` values accepted (only the logprobs change the answer)."""


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
    prompt: Any = None
    """OpenAI's prompt template reference: refused, in vLLM's words."""
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    """Echoed in the response object, as vLLM does (one tier here)."""
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


def to_chat(
    req: ResponsesRequest, history: Sequence[dict[str, Any]] = ()
) -> tuple[ChatCompletionRequest, ChatPaths, list[dict[str, Any]]]:
    """The chat completion request that answers `req` after `history` (the stored conversation of its
    previous_response_id, as chat messages), where its messages came from, and the conversation it
    continues (history + input, without the instructions: what a stored response keeps); APIError naming
    the Responses field for what this server does not take."""
    if req.background:
        raise APIError(400, "background responses are not supported", param="background")
    if req.prompt is not None:  # (vLLM's request validator)
        raise InvalidRequest("prompt", "prompt template is not supported")
    if req.response_format is not None:  # (it was dropped unsaid: a client porting a chat got free text)
        raise APIError(400, "response_format is the chat completions field: the Responses API takes text.format",
                       param="response_format")  # fmt: skip
    for value in req.include or ():
        if value not in INCLUDES:
            raise APIError(400, f"include value {value!r} is not supported (supported: {', '.join(INCLUDES)})",
                           param="include")  # fmt: skip
    paths = ChatPaths()
    messages: list[dict[str, Any]] = []
    if req.instructions:  # (an empty one is none, as vLLM's construct_input_messages reads it)
        messages.append({"role": "system", "content": req.instructions})
        paths.messages.append("instructions")
    messages += history
    paths.messages += ["previous_response_id"] * len(history)
    if not req.input:
        raise APIError(400, "input must not be empty", param="input")
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    wheres = ["input"] if isinstance(req.input, str) else [f"input[{i}]" for i in range(len(items))]
    messages += input_messages(items, wheres, paths)
    if not any(m["role"] != "system" for m in messages):  # system / developer messages only
        raise APIError(400, "input has no message, function call, function call output or reasoning item to "
                       "answer", param="input")  # fmt: skip
    continued = continues_final(items)  # a partial last message or reasoning item: the answer goes on with it
    chat = req.model_dump(exclude={"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
                                   "include", "top_logprobs", "store", "background", "previous_response_id",
                                   "prompt", "service_tier", "reasoning", "metadata", "user", "truncation", "n",
                                   "stream_options", "response_format"})  # fmt: skip
    chat.update(messages=messages, max_tokens=req.max_output_tokens, logprobs=req.logprobs,
                top_logprobs=req.top_logprobs if req.logprobs else None, tools=_tools(req.tools),
                tool_choice=_tool_choice(req.tool_choice), response_format=_format(req.text),
                add_generation_prompt=not continued, continue_final_message=continued)  # fmt: skip
    conversation = messages[1:] if req.instructions else list(messages)
    try:
        return ChatCompletionRequest.model_validate(chat), paths, conversation
    except ValidationError as exc:
        raise paths.rename(validation_error(exc.errors(), loc_prefix=())) from None


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools (other tool types are a 400)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, "only function tools ({\"type\": \"function\", \"name\": ...}) are supported",
                           param=f"tools[{i}]")  # fmt: skip
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, "a function tool's name is a non-empty string", param=f"tools[{i}].name")
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise APIError(400, "a function tool's description is a string", param=f"tools[{i}].description")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise APIError(
                400, "a tool's parameters are a JSON schema object", param=f"tools[{i}].parameters"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    """Responses' {"type": "function", "name": N} as the chat's {"type": "function", "function": {"name": N}}."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or "function" in choice:
        raise APIError(400, 'a named tool_choice is {"type": "function", "name": ...}', param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


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
