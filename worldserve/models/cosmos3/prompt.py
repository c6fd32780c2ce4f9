"""Prompt formatting and tokenization for Cosmos3 generation, exactly as the reference (cosmos-framework) does.

Runs in the API process before a request is queued. Input: a `VideoParams` (prompt, negative prompt, size,
frames, fps). Output: the conditional and unconditional token-id lists the und tower prefills, each
`chat_template(user: text, add_generation_prompt) + [<|im_end|>] + [<|vision_start|>]` (cosmos3-model.md §2.1).

Formatting (cosmos-framework inference/inference.py `_get_prompt_sample_data`; cosmos3-model.md §5.2, §12):
- JSON-object prompt: parsed; `duration` ("<int(frames/fps)>s") and `fps` (float) are set for video (removed
  for images), `resolution` {"H","W"} and `aspect_ratio` always; re-serialised with default `json.dumps`.
- plain text: stripped, then "<text>. The video is {d:.1f} seconds long and is of {fps:.0f} FPS." (video only)
  and ". This video|image is of {h}x{w} resolution.", each joined by `rstrip('.') + '. '`.
- negative: the SAME sentences appended to the negative text (never JSON-injected), then `lstrip('.')`, so an
  empty negative yields the sentences alone (per request: their INVERSE, "is not ...", as diffusers and
  vLLM-Omni append them, with diffusers' assembly on both branches: plain texts as given, not stripped; or
  none). None means the shipped default: for video the reference's
  `neg_prompts.json` "bad video" description (assets/negative_prompt.json, serialised with `json.dumps`;
  content as mirrored verbatim in NVIDIA/TensorRT-LLM's cosmos3/negative_prompt.py, Apache-2.0); for an image
  (num_frames == 1) "" as in the reference's text2image defaults.
- aspect_ratio: the reference injects its CLI choice (default "16,9"), from which it derives the size; we take
  the size as given and label it with the nearest of its five ratios (1,1 4,3 3,4 16,9 9,16) in log space.
- no system prompt by default (reference `use_system_prompt: false`); `use_system_prompt=True` prepends the
  diffusers/reference system prompt (typo "give" included).
- per request (VideoParams; vLLM-Omni's `extra_params` keys): `add_duration_template` / `add_resolution_template`
  False leave out the duration / resolution sentence (JSON prompts: those keys are not injected) on both
  branches; `use_system_prompt` / `system_prompt` add a system message (the encoder's default otherwise).
`TextSizeBound` refuses a text by its byte count alone when no tokenization of it can fit N tokens (used here
for max_sequence_length, and by the Reasoner's prompts for the context: runner/chat_prompt.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from worldserve.params import ParamError, VideoParams

DURATION_TEMPLATE = "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
VIDEO_RESOLUTION_TEMPLATE = "This video is of {height}x{width} resolution."
IMAGE_RESOLUTION_TEMPLATE = "This image is of {height}x{width} resolution."
INVERSE_DURATION_TEMPLATE = "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."
INVERSE_VIDEO_RESOLUTION_TEMPLATE = "This video is not of {height}x{width} resolution."
INVERSE_IMAGE_RESOLUTION_TEMPLATE = "This image is not of {height}x{width} resolution."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."
SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
EOS_TOKEN = "<|im_end|>"
START_OF_GENERATION_TOKEN = "<|vision_start|>"
ASPECT_RATIOS: dict[str, float] = {"1,1": 1.0, "4,3": 4 / 3, "3,4": 3 / 4, "16,9": 16 / 9, "9,16": 9 / 16}
"""The reference's aspect-ratio labels (width,height) and their values."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoShape:
    """What prompt metadata describes: output size, frame count and rate."""

    height: int
    """Output height in pixels."""
    width: int
    """Output width in pixels."""
    num_frames: int
    """1 for an image, else the video frame count."""
    fps: float
    """Frame rate (ignored for an image)."""
    duration: bool = True
    """State the duration / fps (video only)."""
    resolution: bool = True
    """State the resolution and aspect ratio."""
    negative_metadata: str = "same"
    """The sentences on the negative: "same", "inverse" or "none" (VideoParams.negative_metadata)."""

    @property
    def is_image(self) -> bool:
        return self.num_frames == 1

    @classmethod
    def of(cls, params: VideoParams) -> VideoShape:
        return cls(
            height=params.height, width=params.width, num_frames=params.num_frames, fps=params.fps,
            duration=params.add_duration_template, resolution=params.add_resolution_template,
            negative_metadata=params.negative_metadata,
        )  # fmt: skip


def aspect_ratio_label(width: int, height: int) -> str:
    """The reference label nearest to width/height in log space, e.g. 1280x720 -> "16,9", 960x960 -> "1,1"."""
    target = math.log(width / height)
    return min(ASPECT_RATIOS, key=lambda k: abs(math.log(ASPECT_RATIOS[k]) - target))


def _join(base: str, sentence: str) -> str:
    # The reference's join rule: drop trailing dots, then ". " and the sentence.
    return base.rstrip(".") + ". " + sentence


def _sentences(shape: VideoShape, inverse: bool = False) -> list[str]:
    """The duration sentence (video only) and the resolution sentence, each unless the shape turns it off;
    `inverse`: diffusers' negations ("is not")."""
    sentences = []
    if shape.duration and not shape.is_image:
        duration = INVERSE_DURATION_TEMPLATE if inverse else DURATION_TEMPLATE
        sentences.append(duration.format(duration=shape.num_frames / shape.fps, fps=shape.fps))
    if shape.resolution:
        if shape.is_image:
            template = INVERSE_IMAGE_RESOLUTION_TEMPLATE if inverse else IMAGE_RESOLUTION_TEMPLATE
        else:
            template = INVERSE_VIDEO_RESOLUTION_TEMPLATE if inverse else VIDEO_RESOLUTION_TEMPLATE
        sentences.append(template.format(height=shape.height, width=shape.width))
    return sentences


def _metadata_sentences(text: str, shape: VideoShape) -> str:
    """Reference `_format_prompt_with_template`: the text stripped, then its sentences joined."""
    text = text.strip()
    for sentence in _sentences(shape):
        text = _join(text, sentence)
    return text


def _diffusers_sentences(text: str, shape: VideoShape, inverse: bool = False) -> str:
    """diffusers' `tokenize_prompt` assembly (the "inverse" mode's, vLLM-Omni's): the text as given, not
    stripped (a prompt "a fox " becomes "a fox . The video is ..."), each sentence joined as the reference
    joins them, or alone after an empty text."""
    for sentence in _sentences(shape, inverse):
        text = _join(text, sentence) if text.rstrip(".") else sentence
    return text


def _parse_json_object(prompt: str) -> dict[str, Any] | None:
    """The parsed prompt iff it is a JSON object; arrays, strings, numbers stay plain text (as the reference)."""
    try:
        obj = json.loads(prompt)
    except (json.JSONDecodeError, TypeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def format_prompt(prompt: str, shape: VideoShape) -> str:
    """The conditional text: JSON metadata injection or plain-text metadata sentences (the reference's); in the
    "inverse" mode diffusers' / vLLM-Omni's assembly throughout: sentences after any text, a JSON object's
    too (they inject no fields, cosmos3-model.md §13)."""
    if shape.negative_metadata == "inverse":
        return _diffusers_sentences(prompt, shape)
    obj = _parse_json_object(prompt)
    if obj is not None:
        metadata: dict[str, Any] = {}
        if shape.is_image:
            obj.pop("duration", None)
            obj.pop("fps", None)
        elif shape.duration:
            metadata["duration"] = f"{int(shape.num_frames / shape.fps)}s"
            metadata["fps"] = float(shape.fps)
        if shape.resolution:
            metadata["resolution"] = {"H": int(shape.height), "W": int(shape.width)}
            metadata["aspect_ratio"] = aspect_ratio_label(shape.width, shape.height)
        obj.update(metadata)  # existing keys keep their place, new ones go last (reference dict.update)
        return json.dumps(obj)
    if not prompt.strip():
        # The reference would emit a leading ". "; an empty base yields the sentences alone (§12 join rule).
        return _metadata_sentences("", shape).lstrip(".").strip()
    return _metadata_sentences(prompt, shape)


@lru_cache(maxsize=1)
def default_negative_prompt() -> str:
    """The shipped video negative prompt as the reference feeds it: `json.dumps(json.load(file))`."""
    text = resources.files("worldserve").joinpath("assets/negative_prompt.json").read_text(encoding="utf-8")
    return json.dumps(json.loads(text))


def format_negative_prompt(negative_prompt: str | None, shape: VideoShape) -> str:
    """The unconditional text (None: the default negative for video, "" for images) with the shape's metadata
    sentences: the prompt's (SAME, the reference), their negations (INVERSE, diffusers / vLLM-Omni) or none."""
    if negative_prompt is None:
        negative_prompt = "" if shape.is_image else default_negative_prompt()
    if shape.negative_metadata == "none":
        return negative_prompt.strip()
    if shape.negative_metadata == "inverse":
        return _diffusers_sentences(negative_prompt, shape, inverse=True)
    return _metadata_sentences(negative_prompt, shape).lstrip(".").strip()


class TextSizeBound:
    """Refuses, without tokenizing, a text that cannot fit in N tokens: no token stands for more input bytes
    than `bytes_per_token` (the UTF-8 length of the tokenizer's longest vocabulary entry, which over-counts
    byte-level and SentencePiece pieces, x4 for normalisers that shorten text: NFC / NFKC compose at most
    ~3x, e.g. decomposed Hangul, 9 bytes -> 3), so a text longer than (N + 64) of them (a margin for a
    template) cannot fit, and tokenizing megabytes to find out takes seconds. The argument needs a tokenizer
    that keeps every input byte in some token: `text_dropper` finds the parts that may not (then
    `bytes_per_token` is None and nothing is refused: slow, never wrong)."""

    def __init__(self, tokenizer: Any) -> None:
        longest = max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1)
        self.bytes_per_token = None if text_dropper(tokenizer) else 4 * longest

    def size_over(self, text: str, max_tokens: int) -> int | None:
        """The text's UTF-8 size when it cannot fit in `max_tokens` tokens, else None."""
        if self.bytes_per_token is None:
            return None
        size = len(text.encode("utf-8", "surrogatepass"))
        return size if size > (max_tokens + 64) * self.bytes_per_token else None


SAFE_NORMALIZERS = frozenset(("NFC", "NFD", "NFKC", "NFKD", "Prepend", "Sequence"))
"""Normalisers that shrink a text at most ~3x (a Replace may be safe too: checked on its own)."""
SAFE_PRE_TOKENIZERS = frozenset(
    ("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Sequence")
)
"""Pre-tokenisers that split without dropping characters (a Split too, unless its behaviour removes them)."""


def text_dropper(tokenizer: Any) -> str | None:
    """What in `tokenizer` may turn unboundedly many input bytes into one token (or none), else None: an
    added token that strips the whitespace around it, a normaliser or pre-tokeniser that removes or shrinks
    text past the x4 margin, unknown text fused into one unk token; a tokenizer without a `tokenizers`
    backend cannot be inspected."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "no tokenizers backend"
    spec = json.loads(backend.to_str())
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return "an added token strips whitespace"
    for node in _nodes(spec.get("normalizer"), "normalizers"):
        pattern = (node.get("pattern") or {}).get("String")
        # a literal Replace that makes no text shorter
        widens = (
            node["type"] == "Replace"
            and pattern is not None
            and len(node["content"].encode()) >= len(pattern.encode())
        )
        if node["type"] not in SAFE_NORMALIZERS and not widens:
            return f"the {node['type']} normalizer"
    for node in _nodes(spec.get("pre_tokenizer"), "pretokenizers"):
        if node.get("behavior") == "Removed":  # (Split, Punctuation...: the matched text is dropped)
            return f"the {node['type']} pre-tokenizer removes text"
        if node["type"] not in SAFE_PRE_TOKENIZERS and node["type"] != "Split":
            return f"the {node['type']} pre-tokenizer"
    model = spec.get("model") or {}
    kind, fallback = model.get("type"), model.get("byte_fallback")
    fused = (kind == "BPE" and model.get("unk_token") and model.get("fuse_unk")) or (
        kind == "Unigram" and model.get("unk_id") is not None  # Unigram fuses unknown runs
    )
    if kind not in ("BPE", "Unigram") or (fused and not fallback):
        return f"the {kind} model's unknown-text handling (a run of unknown text may be one token)"
    return None


def _nodes(node: dict | None, children: str) -> list[dict]:
    """A normaliser / pre-tokeniser spec and every one inside its Sequences."""
    if not node:
        return []
    return [node, *(n for child in node.get(children) or () for n in _nodes(child, children))]


def reference_system_prompt(is_image: bool) -> str:
    """The diffusers / reference system message (typo included) for an image or a video."""
    return SYSTEM_PROMPT_IMAGE if is_image else SYSTEM_PROMPT_VIDEO


@dataclass(frozen=True, slots=True)
class PromptTexts:
    """The two formatted strings of one request, before tokenization."""

    cond: str
    """Conditional (prompt) branch text."""
    uncond: str
    """Unconditional (negative prompt) branch text."""


def format_prompts(params: VideoParams) -> PromptTexts:
    shape = VideoShape.of(params)
    return PromptTexts(
        cond=format_prompt(params.prompt, shape), uncond=format_negative_prompt(params.negative_prompt, shape)
    )


class PromptEncoder:
    """Formatted text -> und token ids through the checkpoint's own tokenizer and chat template."""

    def __init__(self, tokenizer: Any, *, use_system_prompt: bool = False):
        eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        start = tokenizer.convert_tokens_to_ids(START_OF_GENERATION_TOKEN)
        if eos is None or start is None or eos == tokenizer.unk_token_id or start == tokenizer.unk_token_id:
            raise ValueError(f"the text tokenizer lacks {EOS_TOKEN} or {START_OF_GENERATION_TOKEN}")
        if tokenizer.eos_token_id != eos:
            raise ValueError(
                f"the text tokenizer's eos_token must be {EOS_TOKEN}, got {tokenizer.eos_token!r}"
            )
        self.tokenizer = tokenizer
        self.use_system_prompt = use_system_prompt
        self.suffix_ids = (eos, start)
        """Appended after the chat template: eos (<|im_end|>) then start-of-generation (<|vision_start|>)."""
        # Most requests share the ~15k-character default negative and a few shapes: tokenize those once.
        self._encode_cached = lru_cache(maxsize=32)(self.encode)
        self.text_bound = TextSizeBound(tokenizer)  # texts past max_sequence_length refused untokenized

    @classmethod
    def from_pretrained(cls, path: str | Path, *, use_system_prompt: bool = False) -> PromptEncoder:
        """Load from a checkpoint folder (its `text_tokenizer/`) or from a tokenizer folder itself."""
        from transformers import AutoTokenizer

        from worldserve.weights.checkpoint import CheckpointError

        folder = Path(path)
        if (folder / "text_tokenizer").is_dir():
            folder = folder / "text_tokenizer"
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        if (
            not tokenizer.chat_template
        ):  # (every prompt goes through it: transformers' error came per request)
            raise CheckpointError(f"{folder}: the tokenizer has no chat template (chat_template.jinja, or "
                                  "tokenizer_config.json's chat_template); re-download it")  # fmt: skip
        return cls(tokenizer, use_system_prompt=use_system_prompt)

    def system_message(self, params: VideoParams) -> str | None:  # "" (no system message) is not None
        """The request's system message: its own `system_prompt` (which wins over `use_system_prompt`; ""
        means none), the reference's when asked for (or by default with `use_system_prompt=True` here), else
        none."""
        if params.system_prompt is not None:
            return params.system_prompt
        if params.use_system_prompt or self.use_system_prompt:
            return reference_system_prompt(params.num_frames == 1)
        return None

    def encode(self, text: str, *, is_image: bool = False, system: str | None = None) -> list[int]:
        """chat_template([system?, user: text], add_generation_prompt=True) + [eos, <|vision_start|>].

        `system`: the system message (system_message(params)); None falls back to the encoder's default,
        "" means none."""
        conversation = []
        if system is None and self.use_system_prompt:
            system = reference_system_prompt(is_image)
        if system:
            conversation.append({"role": "system", "content": system})
        conversation.append({"role": "user", "content": text})
        encoded = self.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=True, add_vision_id=False, return_dict=True
        )
        return [*encoded["input_ids"], *self.suffix_ids]

    def _check_bytes(self, text: str, limit: int, name: str, param: str) -> None:
        """ParamError(param) when `text` has more bytes than `limit` tokens can cover (with a margin for the
        template): it cannot fit, and tokenizing megabytes to find out would take seconds."""
        if (size := self.text_bound.size_over(text, limit)) is not None:
            raise ParamError(param, f"{name} is {size} bytes, more than max_sequence_length={limit} tokens "
                             "can hold; shorten it or raise max_sequence_length")  # fmt: skip

    def encode_params(
        self, params: VideoParams, *, with_uncond: bool = True
    ) -> tuple[list[int], list[int] | None]:
        """(cond_ids, uncond_ids) for a request; uncond is None when `with_uncond` is False (no CFG).

        Raises ParamError when a text the request sent is longer than `params.max_sequence_length` tokens:
        param "prompt" for the prompt, "negative_prompt" for its negative prompt. The default negative prompt
        (~3k tokens with Qwen's tokenizer), or --default-sampling-params's, is the server's own text and not
        capped: a request that lowers max_sequence_length for its prompt (NVIDIA's README suggests 512) is not
        refused for a text it never sent (vLLM-Omni's default negative is "", and NVIDIA's reference caps
        nothing).
        """
        texts = format_prompts(params)
        is_image = params.num_frames == 1
        limit = params.max_sequence_length
        system = self.system_message(params)
        with_system = " (system message included)" if system else ""
        self._check_bytes(system or "", limit, "the system message", "system_prompt")
        self._check_bytes(texts.cond, limit, "prompt", "prompt")
        cond = self.encode(texts.cond, is_image=is_image, system=system)
        if len(cond) > limit:
            raise ParamError(
                "prompt",
                f"prompt is {len(cond)} tokens after templating{with_system}, above max_sequence_length={limit}; "
                "shorten the prompt or raise max_sequence_length",
            )
        if not with_uncond:
            return cond, None
        sent = (
            params.negative_prompt is not None and not params.server_negative_prompt
        )  # the server's: no cap
        if sent:
            self._check_bytes(texts.uncond, limit, "negative_prompt", "negative_prompt")
        uncond = list(self._encode_cached(texts.uncond, is_image=is_image, system=system))
        if sent and len(uncond) > limit:
            raise ParamError(
                "negative_prompt",
                f"negative_prompt is {len(uncond)} tokens after templating{with_system}, above "
                f"max_sequence_length={limit}; pass a shorter negative_prompt or raise max_sequence_length",
            )
        return cond, uncond
