"""Wire shapes of a chat request's messages (pydantic v2): roles, string or part content, an assistant turn's
tool calls and earlier thoughts, a tool turn's call id. Content parts are text, image_url and video_url
(`{"url": U}` or the bare string); vLLM's other spellings of them are read as these (`ContentPart`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from worldserve.api.tool_calls import ToolCallIn

ImageDetail = Literal["auto", "low", "high", "original"]
"""OpenAI's image detail values (the openai SDK's), for the chat's image_url and the Responses' input_image."""


class MediaURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: ImageDetail | None = None
    """OpenAI's image detail, checked as OpenAI and vLLM check it (a 400 for another value); the image's pixel
    budget is `mm_processor_kwargs`' here, as in vLLM."""

    @model_validator(mode="before")
    @classmethod
    def _stripped(cls, data: Any) -> Any:
        """The URL without surrounding whitespace, as urlparse reads it (and vLLM downloads it)."""
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            return {**data, "url": data["url"].strip()}
        return data


TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}  # fmt: skip
"""Part types vLLM reads as text, and the field that holds it (Responses-style and assistant-history parts)."""


class ContentPart(BaseModel):
    """One part of a message's content. vLLM's other spellings are read as these (`_vllm_spellings`): a bare
    string is a text part; `input_text` / `output_text` / `refusal` / `thinking` parts are text; an
    `input_image` part (the Responses API's, `image_url` a string) is an image_url part; a part without a
    `type` but with an `image_url` or `video_url` is that part."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "image_url", "video_url", "input_audio", "audio_url", "file"]
    text: str | None = None
    image_url: MediaURL | str | None = None
    video_url: MediaURL | str | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_spellings(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"type": "text", "text": data}
        if not isinstance(data, dict):
            return data
        kind = data.get("type")
        if not isinstance(kind, str | None):  # (a list or an object: pydantic's 400 naming `type`, not a
            return data  # TypeError from the lookups below, a 500)
        if kind is None:
            kind = next((k for k in ("image_url", "video_url") if data.get(k) is not None), None)
        elif kind in TEXT_PART_FIELDS:
            return {"type": "text", "text": data.get(TEXT_PART_FIELDS[kind])}
        elif kind == "input_image":
            kind = "image_url"
        if kind in ("image_url", "video_url") and isinstance(data.get(kind), str):
            return {**data, "type": kind, kind: data[kind].strip()}
        return data if kind is None else {**data, "type": kind}


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    """system, developer (rendered as system), user, assistant, tool, or any other role, as vLLM takes custom
    roles (OpenAI's legacy `function` among them) and leaves them to the chat template."""
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    """An assistant turn's calls (the chat template renders them)."""
    tool_call_id: str | None = None
    """A tool turn's answer to this call."""
    reasoning: str | None = None
    """An assistant turn's earlier thoughts, for templates that render them (vLLM's interleaved thinking:
    read from `reasoning` only; a `reasoning_content` sent on input is ignored, as vLLM ignores it)."""
