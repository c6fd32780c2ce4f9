"""Prompt upsampling: the checkpoint's own Reasoner rewrites a video request's prompt into Cosmos3's structured
JSON prompt (serving-api.md §8.1) before the video is queued (`extra_params.upsample_prompt`).

Cosmos3 is trained on dense JSON captions, so a short prompt gives a poor video (serving-api.md §13.13);
NVIDIA's framework has the Reasoner upsample it (cosmos3-model.md §5.2: temperature 0.7, top_p 0.8, top_k 20),
its serving recipe an external LLM. Here it is one more chat on the same weights, in the same process:
`upsampling_chat` asks for the JSON (the frame the video starts from attached through the ViT: the I2V image
cropped as the pipeline crops it, or a V2V conditioning clip's first frame), constrained by
`UpsamplerConfig.schema()` (structured outputs: the answer always parses; every string and list is bounded, so
the document closes within ~10k characters even on a model that writes noise; a real answer is ~1k tokens)
and seeded from the request (the same request gives the same prompt); its budget is the context's room, at
least `min_room` tokens (EngineClient checks it when the request comes in). `prompt_from_answer` turns the
answer into the prompt text: the object serialised compactly, as the reference sends its JSON prompts;
`checked` holds it to the request's own limits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart, StructuredOutput
from worldserve.engine.chat_events import ChatEvents, ChatFailed
from worldserve.engine.chat_metering import ChatEventSource, ChatMeter, metered
from worldserve.engine.outputs import ChatBackend, ChatDelta
from worldserve.engine.refusals import SHUTDOWN_REASON, ShuttingDownError
from worldserve.params import ParamError, VideoParams


@dataclass(frozen=True, slots=True)
class UpsamplerConfig:
    """How an upsampling chat samples and how long its JSON may grow."""

    max_chars: int = 240
    """Longest text of one field (characters)."""
    max_subjects: int = 3
    """Most subjects described."""
    max_actions: int = 4
    """Most timed actions."""
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    """NVIDIA's upsampler sampling (cosmos3-model.md §5.2)."""
    min_room: int = 4096
    """Context tokens the answer must have left after the upsampling chat's prompt (a request whose prompt
    leaves less is refused: the JSON could be cut short). A real answer is ~1k tokens; noise at every
    bound ~10k characters."""

    def schema(self) -> dict:
        """Cosmos3's prompt keys (serving-api.md §8.1), each text bounded."""
        text = {"type": "string", "maxLength": self.max_chars}

        def obj(*required: str, optional: tuple[str, ...] = ()) -> dict:
            props = {k: text for k in (*required, *optional)}
            return {
                "type": "object",
                "properties": props,
                "required": list(required),
                "additionalProperties": False,
            }

        subject = obj("description", "appearance_details", "action", "location",
                      optional=("relative_size", "orientation"))  # fmt: skip
        action = obj("time", "description")
        props = {
            "subjects": {"type": "array", "items": subject, "minItems": 1, "maxItems": self.max_subjects},
            "background_setting": text,
            "lighting": obj("conditions", "direction", "shadows"),
            "aesthetics": obj("composition", "color_scheme", "mood_atmosphere"),
            "cinematography": obj("camera_motion", "framing", "camera_angle", "depth_of_field"),
            "style_medium": text,
            "actions": {"type": "array", "items": action, "maxItems": self.max_actions},
            "temporal_caption": text,
            "audio_description": text,
        }
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


INSTRUCTION = (
    "You write prompts for a model that generates {what}s. Expand the request below into a detailed "
    "description of the {what}, as one JSON object. Describe only what a camera would see and a microphone "
    "would hear: the subjects (what each looks like, where it is in the frame, what it does), the background, "
    "the lighting, the composition and colours, the camera (motion, framing, angle, depth of field), the "
    "visual style, {timing}. Keep every detail the request gives and invent only what fits it. Do not mention "
    "the request, the model or the prompt.{image_note}\n\nRequest: {prompt}"
)
VIDEO_TIMING = (
    "the actions in time order with their time ranges within {seconds} seconds, one paragraph that tells the "
    "whole video from start to end, and its sound"
)
IMAGE_TIMING = "what is happening, one paragraph that sums up the image, and the sound of the scene"
IMAGE_NOTE = " The video starts from the attached image: describe its content faithfully and how it moves on."
CLIP_NOTE = " The video continues a clip whose first frame is attached: describe its content faithfully."


def upsampling_chat(params: VideoParams, config: UpsamplerConfig = UpsamplerConfig()) -> ChatParams:
    """The chat that upsamples `params.prompt` (with its I2V image, or its V2V clip's first frame)."""
    video = params.num_frames > 1
    timing = VIDEO_TIMING.format(seconds=f"{params.num_frames / params.fps:.1f}") if video else IMAGE_TIMING
    image, note = _shown_frame(params)
    text = INSTRUCTION.format(what="video" if video else "image", timing=timing, prompt=params.prompt,
                              image_note=note)  # fmt: skip
    parts = (ChatPart(type="image", image=image),) if image is not None else ()
    return ChatParams(
        messages=(ChatMessage(role="user", content=(*parts, ChatPart(type="text", text=text))),),
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        seed=params.seed,
        structured=StructuredOutput(
            kind="json", spec=json.dumps(config.schema()), field="extra_params.upsample_prompt"
        ),
    ).validate()


def _shown_frame(params: VideoParams) -> tuple[np.ndarray | None, str]:
    """The frame the video starts from, as the pipeline gives it to the VAE (the I2V image cover-resized and
    centre-cropped to the video's size; a V2V conditioning clip's first frame resized), and its note: what
    the Reasoner is shown (any aspect ratio the video route accepts is one the ViT takes)."""
    from worldserve.media.image import resize_center_crop
    from worldserve.media.video_input import condition_budget, resize_video

    if params.image is not None:
        return resize_center_crop(params.image, params.width, params.height), IMAGE_NOTE
    if params.video is not None:
        n = condition_budget(params.condition_frame_indexes)
        first = params.video[0] if params.condition_video_keep == "first" else params.video[-n:][0]
        return resize_video(first[None], params.width, params.height)[0], CLIP_NOTE
    return None, ""


def prompt_from_answer(answer: str) -> str:
    """The upsampling chat's answer as the video's prompt: its JSON object, compactly serialised (ValueError
    when the answer is not one, e.g. cut short)."""
    try:
        doc = json.loads(answer)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"the prompt upsampler's answer is not complete JSON ({exc.msg} at {exc.pos})"
        ) from None
    if not isinstance(doc, dict):
        raise ValueError("the prompt upsampler's answer is not a JSON object")
    return json.dumps(doc)


class DirectSession(Protocol):
    """A chat run on the caller's thread (runner/reasoner_session.py ReasonerSession)."""

    @property
    def finish_reason(self) -> str | None: ...

    def step(self) -> ChatDelta: ...

    def close(self) -> None: ...


class DirectReasoner(Protocol):
    """A Reasoner used without a chat worker (runner/reasoner.py Reasoner: the generate CLI's)."""

    def start(self, params: ChatParams) -> DirectSession: ...


def upsample_with(
    reasoner: DirectReasoner, params: VideoParams, config: UpsamplerConfig = UpsamplerConfig()
) -> str:
    """The new prompt from a Reasoner in this thread (the generate CLI: no server, no chat worker)."""
    session = reasoner.start(upsampling_chat(params, config))
    pieces = []
    try:
        while session.finish_reason is None:
            pieces.append(session.step().text)
    finally:
        session.close()
    return prompt_from_answer("".join(pieces))


class PromptContext(Protocol):
    """What check_upsampling reads of a Reasoner (the chat worker's backend, or generate's own)."""

    @property
    def prompts(self) -> Any: ...

    @property
    def max_model_len(self) -> int | None: ...


def check_upsampling(reasoner: PromptContext | None, params: VideoParams, config: UpsamplerConfig) -> None:
    """ParamError unless `reasoner` (the chat worker's Reasoner; None: this server runs none) can upsample
    `params`' prompt: the chat's prompt must leave `config.min_room` tokens of context for the answer
    (blocking: builds that prompt, the image through the ViT's preprocessing; a backend without its own
    prompt builder is not checked: it builds the prompt when the chat starts)."""
    if reasoner is None:
        raise ParamError("upsample_prompt", "prompt upsampling needs the Reasoner, which this server "
                         "does not run (the fake backend, or --tensor-parallel-size > 1)")  # fmt: skip
    if reasoner.prompts is None:
        return
    tokens = len(reasoner.prompts.build(upsampling_chat(params, config)).input_ids)
    # (a backend with a prompt builder is the Reasoner: a bounded context)
    assert reasoner.max_model_len is not None
    if tokens + config.min_room > reasoner.max_model_len:
        raise ParamError("prompt", f"the prompt is too long to upsample: its upsampling chat is {tokens} tokens, "
                         f"and the answer needs {config.min_room} more within the Reasoner's "
                         f"{reasoner.max_model_len}-token context")  # fmt: skip


def model_checked(validate: Callable[[VideoParams], VideoParams], params: VideoParams) -> VideoParams:
    """`validate(params)` (the backend's model checks), except that a prompt to be upsampled is not held to
    max_sequence_length: it is the Reasoner's input (check_upsampling bounds it by the Reasoner's context),
    not the text the gen tower reads; the prompt written for it is held to that limit (`checked`)."""
    if not params.upsample_prompt:
        return validate(params)
    # (a one-word stand-in: every other field, the negative prompt's length among them, checked as given)
    return dataclasses.replace(validate(dataclasses.replace(params, prompt="video")), prompt=params.prompt)


class UpsamplingFailed(Exception):
    """The upsampling chat failed (`status`: the chat's own, e.g. 503 when the chat worker stopped, 400 for a
    prompt past the context), its answer is not a complete JSON object (500), or the prompt it wrote does not
    fit the request (400, `param` the field)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def checked(validate: Callable[[VideoParams], VideoParams], params: VideoParams) -> VideoParams:
    """`params` with the written prompt, checked as a client's (`validate`: the backend's); a prompt past the
    request's max_sequence_length is UpsamplingFailed(400) naming that field (blocking: tokenizes)."""
    try:
        return validate(params)
    except ParamError as exc:
        reason = exc.message.split("; ")[0]  # (not the client's hint: a shorter prompt would not help)
        field = params.field_name("max_sequence_length" if exc.param == "prompt" else exc.param)
        raise UpsamplingFailed(400, f"the prompt the Reasoner wrote does not fit this request: {reason}; raise "
                               f"{field}, or leave upsample_prompt off", field) from None  # fmt: skip


async def unless_stopping(upsampling: Coroutine[Any, Any, str], stopping: asyncio.Future[None] | None) -> str:
    """`upsampling`'s prompt; once `stopping` is settled (the server's shutdown began: EngineClient) it is
    cancelled (its chat stops at the next step) and ShuttingDownError is raised, the refusal a request
    arriving then gets. A request being upsampled is a queued one, which no longer starts: it must not hold
    the shutdown as a running chat does."""
    task = asyncio.ensure_future(upsampling)
    if stopping is None:  # (a client not started: nothing stops it)
        return await task
    waiting: set[asyncio.Future[Any]] = {task, stopping}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:  # (also when the caller is cancelled: a DELETE, a client gone)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if stopping.done() and task.cancelled():  # stopped by the shutdown, not by its caller
        raise ShuttingDownError(SHUTDOWN_REASON)
    return task.result()


async def built_upsampling_chat(
    backend: ChatBackend | None, params: VideoParams, config: UpsamplerConfig
) -> ChatParams:
    """`upsampling_chat` with its prompt built here, in a worker thread (the frame through the ViT's
    preprocessing, the template, the tokens), not on the chat worker's thread, which every running chat
    shares (`backend`: the chat worker's Reasoner; one without `prompts` builds its own); UpsamplingFailed(400)
    when it cannot be."""
    chat = upsampling_chat(params, config)
    prompts = backend.prompts if backend is not None else None
    if prompts is None:
        return chat
    try:
        return dataclasses.replace(chat, prebuilt=await asyncio.to_thread(prompts.build, chat))
    except ParamError as exc:
        raise UpsamplingFailed(400, f"the Reasoner failed: {exc.message}") from None


async def upsample(
    chat_many: Callable[..., list[ChatEvents]], chat: ChatParams, meter: ChatMeter | None = None
) -> str:
    """Run the upsampling chat (`upsampling_chat`) through `chat_many` (EngineClient.chat_many; counted into
    `meter`, the chat metrics) and return the new prompt; UpsamplingFailed otherwise (ShuttingDownError from
    chat_many passes through)."""
    (chat_events,) = chat_many([chat], coalesce=True)
    events: ChatEventSource = chat_events if meter is None else metered(chat_events, meter)
    pieces: list[str] = []
    try:
        async for event in events:
            if isinstance(event, ChatFailed):
                raise UpsamplingFailed(event.status, f"the Reasoner failed: {event.message}")
            if isinstance(event, ChatDelta):
                pieces.append(event.text)
    finally:
        await events.aclose()  # cancels the chat when this task is cancelled (the job deleted)
    try:
        return prompt_from_answer("".join(pieces))
    except ValueError as exc:
        raise UpsamplingFailed(500, str(exc)) from None
