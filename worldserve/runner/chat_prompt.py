"""Chat prompts of the Reasoner: the checkpoint's chat template, Qwen3-VL image / video placeholders, positions.

`ChatPromptBuilder.build(ChatParams) -> ChatPrompt` renders the messages with the checkpoint's chat template
(image parts as <|vision_start|><|image_pad|><|vision_end|>), expands each <|image_pad|> to the image's
merged-patch count (t*h*w / merge**2) as Qwen3-VL's processor does (images preprocessed here, encoded by the
ViT at prefill: models/cosmos3/vision.py), replaces each video part (frames sampled and resized at decode,
media/video_input.py) by one "<T seconds><|vision_start|><|video_pad|> x (h*w / merge**2)<|vision_end|>"
per temporal patch as Qwen3VLProcessor does, tokenizes, and computes the Qwen3-VL get_rope_index positions.
Host work only; a mismatch of placeholders and media (e.g. "<|image_pad|>" typed as text) is a ParamError.
Per-request options of ChatParams: `chat_template_kwargs` (extra template variables; a template failing on
them is a ParamError naming the field), `tools` (the template's tools variable) and messages' `tool_calls` /
`tool_call_id`, an assistant message's `reasoning` (under both `reasoning` and `reasoning_content`, as vLLM
passes it), `add_generation_prompt` / `continue_final_message` (chat_template_kwargs may set them, and win), and `image_min_pixels` /
`image_max_pixels` (the image processor's pixel budget; None: the server's). `truncated` applies vLLM's
truncate_prompt_tokens; `bad_word_ids` tokenizes vLLM's bad_words. A raw prompt (`ChatParams.prompt_ids`, /v1/completions) skips the template:
its ids are checked against the vocabulary (no vision placeholders: there is no media) and get text positions
(k, k, k). `encode` / `decode` / `check_ids` are the tokenizer as /tokenize, /detokenize and /v1/completions use it
(its base, runner/chat_tokens.py ChatTokenizer). Given `max_tokens` (the context), `build` and `encode` refuse a
text whose byte count alone is more than the room the completion budget leaves can hold (ChatTokenizer.check_size,
models/cosmos3/prompt.py's TextSizeBound), before tokenizing it (megabytes take tens of seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch
from jinja2 import TemplateError
from torch import Tensor

from worldserve.chat_params import ChatParams, ChatVideo
from worldserve.context_limits import no_room_refusal, output_budget_refusal, prompt_fit_refusal
from worldserve.media.processor_cache import ProcessorCache
from worldserve.models.cosmos3.vision import (
    VisionEncoder,
    VisionInputs,
    chat_positions,
    video_inputs,
    video_timestamps,
)
from worldserve.param_errors import ParamError
from worldserve.runner.chat_tokens import ChatTokenizer
from worldserve.runner.prefix_hashes import media_digests

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    input_ids: list[int]
    """Token ids with every image placeholder expanded."""
    vision: VisionInputs | None
    """Preprocessed images in prompt order, or None when the prompt has none."""
    video: VisionInputs | None
    """Preprocessed videos in prompt order (one grid row per video), or None."""
    positions: Tensor
    """[3, N] float32 Qwen3-VL mRoPE positions of input_ids (get_rope_index)."""
    next_position: int
    """Position of the first generated token."""
    media: tuple[tuple[int, bytes], ...] = ()
    """(first placeholder row, content digest) of each image and video: their part of the prefix-cache keys
    (runner/prefix_hashes.py)."""
    cache_salt: str | None = None
    """The request's prefix-cache salt (ChatParams.cache_salt): part of the first block's key."""


class ChatPromptBuilder(ChatTokenizer):
    """The tokenizer, the vision preprocessing and the placeholder token ids a prompt needs."""

    def __init__(
        self, tokenizer: Any, vision: VisionEncoder | None, preprocess: Any, *, image_token_id: int,
        video_token_id: int, media_cache: ProcessorCache | None = None, chat_template: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(tokenizer)
        self.vision, self.preprocess = vision, preprocess
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        self.media_cache = media_cache
        """Decoded chat media by content, for whoever loads a request's parts (api/chat_media.py); the
        preprocessor keeps its resized images in it too."""
        self.chat_template = chat_template
        """--chat-template's text (runner/chat_template.py), rendered instead of the tokenizer's own; None: the
        checkpoint's."""
        if chat_template is not None:
            self.check_template()

    def check_template(self) -> None:
        """ValueError naming --chat-template when the template fails on one plain user message (the start stops
        there, not at the first chat)."""
        try:
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True,
                chat_template=self.chat_template,
            )  # fmt: skip
        except Exception as exc:  # the template is code: anything it raises
            raise ValueError(
                f"--chat-template: the chat template fails on a plain user message: {type(exc).__name__}: {exc}"
            ) from exc

    def build(
        self, params: ChatParams, *, add_special_tokens: bool = False, max_tokens: int | None = None
    ) -> ChatPrompt:
        """Chat template + image / video placeholder expansion + tokenization, or a raw prompt's ids as they
        are; raises ParamError. `add_special_tokens`: the tokenizer's own (vLLM's /tokenize option).
        With `max_tokens`, a rendered text with more bytes than that many tokens can hold is refused before
        any media preprocessing or tokenizing (ParamError("messages")): the template renders megabytes in
        milliseconds (and may drop text, e.g. earlier turns' reasoning, so the raw messages would not do),
        placeholders only ever expand, and tokenizing megabytes takes seconds to tens of seconds."""
        prompt = self._build(params, add_special_tokens, max_tokens)
        return prompt if params.cache_salt is None else replace(prompt, cache_salt=params.cache_salt)

    def _build(self, params: ChatParams, add_special_tokens: bool, max_tokens: int | None) -> ChatPrompt:
        if params.prompt_ids is not None:
            return self._raw(list(params.prompt_ids))
        conversation, images, videos = _conversation(params)
        # the request's chat_template_kwargs over its own template arguments, as vLLM lays them
        options = ({"tools": list(params.tools)} if params.tools else {}) | dict(params.chat_template_kwargs)
        text = self._render(
            conversation, options, params.add_generation_prompt, params.continue_final_message
        )
        if max_tokens is not None:
            self.check_size(text, max_tokens, "messages", params.max_tokens)
        vision = video = None
        if (images or videos) and (self.vision is None or self.preprocess is None):
            raise ParamError(
                "messages", "this checkpoint has no vision_encoder/: image and video inputs are unsupported"
            )
        merge = self.vision.merge_size if self.vision is not None else 2
        if images:
            text, vision = self._expand_images(text, images, params, merge)
        if videos:
            text, video = self._expand_videos(text, videos)
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        positions, next_pos = self._positions(ids, vision, video, merge)
        media = media_digests(
            ids, vision, video, image_token_id=self.image_token_id, video_token_id=self.video_token_id,
            merge_size=merge,
        )  # fmt: skip
        return ChatPrompt(
            input_ids=ids,
            vision=vision,
            video=video,
            positions=positions,
            next_position=next_pos,
            media=media,
        )

    def _expand_images(
        self, text: str, images: list[tuple[np.ndarray, bytes | None]], params: ChatParams, merge: int
    ) -> tuple[str, VisionInputs]:
        """Preprocess the image parts and expand each image placeholder of `text` to its merged-patch count."""
        vision = self._preprocess(images, params)
        counts = vision.tokens_per_image(merge)
        pieces = text.split(IMAGE_PAD)
        if len(pieces) != len(counts) + 1:
            raise ParamError("messages", "the chat template did not render one image placeholder per image")
        text = pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts, pieces[1:], strict=True))
        return text, vision

    def _positions(
        self, ids: list[int], vision: VisionInputs | None, video: VisionInputs | None, merge: int
    ) -> tuple[Tensor, int]:
        """The Qwen3-VL mRoPE positions of `ids` and the next one; a placeholder run without its image / video
        is a ParamError."""
        grids = [] if vision is None else vision.grid_thw.tolist()
        try:
            return chat_positions(
                ids, self.image_token_id, grids, merge, video_token_id=self.video_token_id,
                video_grids=[] if video is None else video.grid_thw.tolist(),
            )  # fmt: skip
        except ValueError as exc:
            # e.g. "<|image_pad|>" typed into the text: more placeholder runs than images
            raise ParamError(
                "messages", f"the messages do not match their images / videos ({exc}); text must not contain "
                f"{IMAGE_PAD} or {VIDEO_PAD}",
            ) from exc  # fmt: skip

    @staticmethod
    def truncation_size(keep: int, max_model_len: int, max_tokens: int | None) -> int:
        """The prompt tokens truncate_prompt_tokens `keep` keeps: -1 is the room `max_tokens` leaves
        (vLLM's max_model_len - max_tokens)."""
        return max_model_len - (max_tokens or 0) if keep == -1 else keep

    def truncated(
        self, prompt: ChatPrompt, keep: int, max_model_len: int, max_tokens: int | None
    ) -> ChatPrompt:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as leave room for
        `max_tokens`, vLLM's max_model_len - max_tokens), as a text prompt; a prompt no longer than `keep` is
        left whole (media included). ParamError for a longer one with images or videos (their tokens cannot be
        cut), for 0, and for a size past the room `max_tokens` leaves."""
        if keep == 0:
            raise ParamError(
                "truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or at least 1, got 0"
            )
        room = max_model_len - (max_tokens or 0)
        if room < 1:  # (max_tokens alone fills the context: the context check says so)
            return prompt
        keep = self.truncation_size(keep, max_model_len, max_tokens)
        if keep > room:
            raise ParamError("truncate_prompt_tokens", f"truncate_prompt_tokens={keep} cannot be greater than "
                             f"max_model_len - max_tokens = {room}. Please request a smaller truncation size.")  # fmt: skip
        if len(prompt.input_ids) <= keep:
            return prompt
        if prompt.vision is not None or prompt.video is not None:
            raise ParamError("truncate_prompt_tokens", "a prompt with images or videos cannot be truncated")
        return replace(
            self._raw(list(prompt.input_ids[len(prompt.input_ids) - keep :])), cache_salt=prompt.cache_salt
        )

    def _raw(self, ids: list[int]) -> ChatPrompt:
        """A raw prompt: ids checked (in the vocabulary, no vision placeholder), text positions (k, k, k)."""
        self.check_ids(ids, "prompt")
        if self.image_token_id in ids or self.video_token_id in ids:
            raise ParamError(
                "prompt", f"the prompt holds {IMAGE_PAD} / {VIDEO_PAD} tokens: a raw prompt cannot carry images "
                "or videos (send them to /v1/chat/completions)",
            )  # fmt: skip
        positions, next_pos = chat_positions(ids, self.image_token_id, [], 2)  # text only: arange, x3
        return ChatPrompt(input_ids=ids, vision=None, video=None, positions=positions, next_position=next_pos)

    def _render(
        self, conversation: list, options: dict, add_generation_prompt: bool, continue_final_message: bool
    ) -> str:
        """The chat template's text of the conversation, with the request's extra template variables
        (`continue_final_message`: the last message left open, vLLM's /tokenize option; `options` may set
        both switches, and then win)."""
        args = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        args |= options
        continue_final_message = args["continue_final_message"]
        try:
            template = {} if self.chat_template is None else {"chat_template": self.chat_template}
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, **template, **args)
        except RecursionError:  # (bodies nest at most api.bodies.MAX_JSON_DEPTH levels: not expected)
            raise ParamError("messages", "the chat template cannot render input nested this deeply") from None
        except MemoryError:
            raise
        except Exception as exc:  # the template is code run on the request: ZeroDivisionError, range's cap...
            if continue_final_message:  # e.g. no final message content to continue
                where = "chat_template_kwargs." * ("continue_final_message" in options)
                raise ParamError(
                    f"{where}continue_final_message", f"cannot continue the final message: {exc}"
                ) from exc
            kwargs = {k: v for k, v in options.items() if k != "tools"}
            if kwargs:  # e.g. a template's raise_exception() or a type error on a variable's value
                raise ParamError(
                    "chat_template_kwargs",
                    f"the chat template failed with chat_template_kwargs {kwargs}: {exc}",
                ) from exc
            if "tools" in options:
                raise ParamError("tools", f"the chat template failed with these tools: {exc}") from exc
            if isinstance(exc, TemplateError):  # the template's raise_exception(): it refuses these messages
                raise ParamError("messages", f"the chat template refused the messages: {exc}") from exc
            raise ParamError(
                "messages", f"the chat template failed on the messages: {type(exc).__name__}: {exc}"
            ) from exc

    def _preprocess(self, parts: list[tuple[np.ndarray, bytes | None]], params: ChatParams) -> VisionInputs:
        """Qwen3-VL image preprocessing of the image parts ((image, media_key) each) with the request's pixel
        budget (by their content keys, from the preprocessor's cache where it has them); an image it cannot
        resize (the API refuses those up front: this guards other callers) is a ParamError, not a server error."""
        images = [image for image, _ in parts]
        try:
            return self.preprocess(
                images, keys=[key for _, key in parts], min_pixels=params.image_min_pixels,
                max_pixels=params.image_max_pixels,
            )  # fmt: skip
        except ValueError as exc:  # vision.smart_resize: "absolute aspect ratio must be at most 200"
            shapes = ", ".join(f"{i.shape[1]}x{i.shape[0]}" for i in images)
            raise ParamError("messages", f"an image cannot be preprocessed ({shapes}): {exc}") from exc

    def _expand_videos(self, text: str, videos: list) -> tuple[str, VisionInputs]:
        """Patchify each video and replace its placeholder by timestamped per-patch token runs."""
        assert self.vision is not None
        v = self.vision
        inputs = [video_inputs(x.frames, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                               merge_size=v.merge_size) for x in videos]  # fmt: skip
        pieces = text.split(VIDEO_PLACEHOLDER)
        if len(pieces) != len(videos) + 1:
            raise ParamError("messages", "the chat template did not render one video placeholder per video")
        out = [pieces[0]]
        digests: list[bytes] = []
        for x, inp, rest in zip(videos, inputs, pieces[1:], strict=True):
            assert inp.digests is not None  # (video_inputs hashes every clip's frames)
            digests += inp.digests
            per_patch = int(inp.grid_thw[0, 1:].prod()) // v.merge_size**2
            stamps = video_timestamps(x.indices, x.source_fps, v.temporal_patch_size)
            out += [f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD * per_patch}{VISION_END}" for t in stamps]
            out.append(rest)
        merged = VisionInputs(
            patches=torch.cat([i.patches for i in inputs]),
            grid_thw=torch.cat([i.grid_thw for i in inputs]),
            digests=tuple(digests),
        )
        return "".join(out), merged


def _conversation(
    params: ChatParams,
) -> tuple[list[dict], list[tuple[np.ndarray, bytes | None]], list[ChatVideo]]:
    """The messages as the chat template takes them (image / video parts as bare {"type": ...} parts), with
    the (pixels, media_key) of each image part and each video part, in prompt order."""
    conversation: list[dict] = []
    images: list[tuple[np.ndarray, bytes | None]] = []  # (pixels, media_key) of each image part
    videos: list[ChatVideo] = []
    for msg in params.messages:
        extra = {
            k: v for k, v in (("tool_calls", list(msg.tool_calls)), ("tool_call_id", msg.tool_call_id)) if v
        }
        if msg.reasoning is not None:  # vLLM's keys for earlier thoughts: the new name and the old one
            extra |= {"reasoning": msg.reasoning, "reasoning_content": msg.reasoning}
        if isinstance(msg.content, str):
            conversation.append({"role": msg.role, "content": msg.content, **extra})
            continue
        parts = []
        for part in msg.content:
            if part.type == "image":
                images.append((_decoded(part.image, "image"), part.media_key))
                parts.append({"type": "image"})
            elif part.type == "video":
                videos.append(_decoded(part.video, "video"))
                parts.append({"type": "video"})
            else:
                parts.append({"type": "text", "text": part.text})
        conversation.append({"role": msg.role, "content": parts, **extra})
    return conversation, images, videos


_Media = TypeVar("_Media")


def _decoded(media: _Media | None, kind: str) -> _Media:
    """An image / video part's decoded pixels; a part without them is a ParamError (the API always decodes
    them; an in-process caller may build such a ChatPart)."""
    if media is None:
        raise ParamError("messages", f"a message part of type {kind!r} carries no decoded {kind}")
    return media


def completion_budget(params: ChatParams, n: int, max_model_len: int) -> int:
    """The completion tokens a chat may produce after its `n`-token prompt (its max_tokens, else the room the
    context leaves; at most its max_tokens_bound); ParamError, in vLLM's words (worldserve/context_limits.py),
    when max_tokens is past the whole context, the prompt and max_tokens do not fit together, the prompt
    leaves no room for a budget that was not sent, or min_tokens is past the budget."""
    refusal = output_budget_refusal(params.max_tokens, "max_tokens", max_model_len) or prompt_fit_refusal(
        n, params.max_tokens, max_model_len
    )
    room = max_model_len - n
    if refusal is None and room < 1:
        refusal = no_room_refusal()
    if refusal is not None:
        raise ParamError(refusal.param, refusal.message)
    budget = params.max_tokens if params.max_tokens is not None else room
    bound = params.max_tokens_bound
    bounded = bound is not None and bound < budget
    if bound is not None and bounded:
        budget = bound
    if params.min_tokens > budget:  # (vLLM checks it against the max_tokens it defaulted to the room)
        why = ("the server's --generation-config bound" if bounded
               else f"the room the {n}-token prompt leaves in the context")  # fmt: skip
        raise ParamError("min_tokens", f"min_tokens must be at most max_tokens ({budget}, {why}), got "
                         f"{params.min_tokens}")  # fmt: skip
    return budget
