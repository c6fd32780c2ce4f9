"""The Reasoner's per-request parameters: ChatParams (a chat completion, or a raw-prompt completion) with its
messages and their parts, how a chat video is sampled (VideoSampling, ChatVideo), and a structured output's
constraint (StructuredOutput: sampling/grammar.py and token_grammar.py apply it). Validated at the API
boundary; a bad value raises ParamError naming the request field (params.py).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from worldserve.param_errors import InvalidRequest, ParamError, shown
from worldserve.param_types import check_bool, check_int, check_items, check_real, is_int, type_name
from worldserve.params import choice_seed

THINK_START, THINK_END = "<think>", "</think>"
"""The tags of a Qwen3 answer's thoughts (as --reasoning-parser qwen3 reads them: api/reasoning.py; the
Reasoner's stop strings and grammars start after them)."""

MAX_VIDEO_FPS = 1000.0
"""Largest chat-video sampling rate kept: above any camera's recording rate, and a rate at or above the clip's
own takes every frame (up to VideoSampling.max_frames) anyway, so a request's larger fps is taken as this
(as vLLM samples it: every frame); the bound keeps every frame count finite."""


GREEDY_BELOW = 1e-5
"""Temperatures under this are greedy, as in vLLM (dividing logits by a denormal gives inf and NaN)."""

MIN_REPETITION_PENALTY = 1e-38
"""float32's smallest normal: below it the sampler's float32 penalty is 0 or subnormal (a masked token's
-inf times 0 is NaN, which argmax would pick past a grammar)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoSampling:
    """Which frames of a chat video the Reasoner sees (Qwen3-VL's video processor defaults; per request:
    `media_io_kwargs.video.fps` / `.num_frames`; both: the fewer frames of the two, as vLLM's video loader)."""

    fps: float | None = 2.0
    """Frames sampled per second of video (None when num_frames alone is given)."""
    num_frames: int | None = None
    """Exactly this many frames, evenly spread (a shorter clip repeats frames, as transformers does)."""
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 4096
    """Lower bound of sampled frames x height x width after resizing: `size.shortest_edge` of the Qwen3-VL
    checkpoints' video_preprocessor_config.json, which AutoProcessor and vLLM load (not the processor class's
    own default, 128 x 32 x 32, which had made 8 frames of 720p 224x416 where vLLM sees 704x1280)."""
    max_pixels: int = 25165824
    """Upper bound of the same product (the config's `size.longest_edge`, 24576 x 32 x 32): more frames,
    smaller frames."""
    factor: int = 32
    """Frame sides become multiples of patch 16 x merge 2."""
    temporal_patch: int = 2
    """Frames per ViT temporal patch (the frame count is padded to a multiple of it)."""

    def validate(self) -> VideoSampling:
        if self.fps is not None and not 0 < self.fps <= MAX_VIDEO_FPS:  # NaN fails too
            raise ParamError(
                "media_io_kwargs",
                f"video fps must be > 0 and at most {MAX_VIDEO_FPS:g}, got {shown(self.fps)}",
            )
        if self.num_frames is not None and not 1 <= self.num_frames <= self.max_frames:
            raise ParamError(
                "media_io_kwargs",
                f"video num_frames must be in [1, {self.max_frames}], got {shown(self.num_frames)}",
            )
        return self

    def indices(self, total_frames: int, source_fps: float) -> list[int]:
        """Qwen3-VL `sample_frames`: n = total / source_fps * fps, clamped to [min_frames, max_frames] and the
        clip length (or exactly num_frames, repeating frames of a shorter clip; both: the fewer), at
        round(linspace(0, total - 1, n))."""
        if self.fps is None and self.num_frames is not None:
            n = self.num_frames
        else:
            wanted = total_frames / source_fps * (self.fps or 2.0)
            n = int(wanted) if wanted < self.max_frames else self.max_frames  # inf / NaN: int() would raise
            n = min(max(n, self.min_frames), self.max_frames, total_frames)
            if self.num_frames is not None:  # (vLLM's loader samples the minimum of the two)
                n = min(n, self.num_frames)
        return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()

    def frame_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Qwen3-VL video `smart_resize`: (height, width) as multiples of `factor`, near the aspect ratio,
        with round(num_frames / 2) * 2 * height * width within [min_pixels, max_pixels]. A one-frame video is
        sized as the two frames its patches hold (patchify repeats the frame; transformers refuses it)."""
        f, tf = self.factor, self.temporal_patch
        num_frames = max(num_frames, tf)
        given = f"{width}x{height}"
        if height < f or width < f:
            scale = max(f / height, f / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ParamError(
                "messages",
                f"the video is {given} pixels: its aspect ratio (longer side / "
                f"shorter side) must be at most 200, got {max(height, width) / min(height, width):g}",
            )
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        t_bar = round(num_frames / tf) * tf
        if t_bar * h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(num_frames * height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif t_bar * h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (num_frames * height * width))
            h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h_bar, w_bar


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatVideo:
    """A decoded chat video: the sampled frames and where they sit in the clip."""

    frames: np.ndarray
    """uint8 RGB (N, H, W, 3): the sampled frames in order, already resized to the ViT's input size."""
    indices: tuple[int, ...]
    """Their frame numbers in the source clip (timestamps = index / source_fps)."""
    source_fps: float
    """The clip's average frame rate."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatPart:
    """One content part of a chat message: text, a decoded image or a decoded video."""

    type: str
    """"text", "image" or "video"."""
    text: str = ""
    """The text of a text part."""
    image: np.ndarray | None = None
    """uint8 RGB (H, W, 3) of an image part (never written: a processor cache may share it)."""
    media_key: bytes | None = None
    """An image part's content key (media/processor_cache.py content_key of its file's bytes), with which the
    preprocessing reuses an earlier request's resized patches; None: preprocessed afresh."""
    video: ChatVideo | None = None
    """The sampled frames of a video part."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    role: str
    """"system", "user", "assistant" or "tool"."""
    content: str | tuple[ChatPart, ...]
    """A plain string or a sequence of parts."""
    tool_calls: tuple[dict, ...] = ()
    """An assistant turn's tool calls, as the chat template takes them ({"id", "type", "function": {"name",
    "arguments"}})."""
    tool_call_id: str | None = None
    """A tool turn's: the call it answers."""
    reasoning: str | None = None
    """An assistant turn's earlier thoughts (the request's `reasoning` field), which the chat template gets as
    both `reasoning` and `reasoning_content` (vLLM's interleaved thinking); None: the turn has none."""


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutput:
    """A constraint on the completion's text (vLLM's structured outputs; sampling/grammar.py compiles it)."""

    kind: str
    """One of STRUCTURED_KINDS: a JSON schema, any JSON object, a regex, one of a list of strings, a Lark /
    GBNF grammar, or vLLM's structural tags."""
    spec: str = ""
    """The schema / choice list / structural tag as JSON text, the regex or the grammar ("" for json_object)."""
    field: str = "structured_outputs"
    """The request field it came from (what an error names)."""
    any_whitespace: bool = True
    """JSON may hold any whitespace between tokens (vLLM's disable_any_whitespace turns it off)."""
    additional_properties: bool = True
    """False: objects without `additionalProperties` take none (vLLM's disable_additional_properties)."""
    whitespace_pattern: str | None = None
    """A regex for the whitespace JSON may hold (vLLM's whitespace_pattern)."""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatParams:
    """One Reasoner chat completion (OpenAI /v1/chat/completions, n = 1), or a raw text completion
    (/v1/completions: `prompt_ids`, no messages, no chat template), validated at the boundary."""

    messages: tuple[ChatMessage, ...] = ()
    """The conversation; the reply is the next assistant turn. Empty with `prompt_ids`."""
    prompt_ids: tuple[int, ...] | None = None
    """A raw prompt's token ids, continued as they are (positions (k, k, k)); None: render `messages`."""
    max_tokens: int | None = None
    """Completion token budget; None: up to the context length."""
    max_tokens_bound: int | None = None
    """The server's bound on the budget (--generation-config's max_new_tokens: sampling/chat_defaults.py); the
    room the context leaves bounds it further, without an error (an explicit max_tokens past it is a 400)."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """0 or -1: no top-k."""
    seed: int | None = None
    """Sampling seed (None: random)."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion (not included in the output)."""
    presence_penalty: float = 0.0
    """OpenAI presence penalty in [-2, 2] over the output tokens."""
    frequency_penalty: float = 0.0
    """OpenAI frequency penalty in [-2, 2] over the output tokens."""
    repetition_penalty: float = 1.0
    """vLLM repetition penalty (> 0; 1 = off) over the prompt and output tokens."""
    logprobs: bool = False
    """Return each output token's log-probability."""
    top_logprobs: int = 0
    """With logprobs: also the this-many most likely tokens at each position (0-20)."""
    prompt_logprobs: int | None = None
    """The prompt tokens' log-probabilities too (each under the tokens before it; the first has none), with
    this many most likely alternatives (0-20); None: not computed (the legacy completions' echo + logprobs)."""
    return_token_ids: bool = False
    """vLLM's: the prompt's token ids come with ChatStarted (every delta carries its sampled ids anyway)."""
    ignore_eos: bool = False
    """vLLM's: keep generating past the end-of-sequence tokens (up to max_tokens)."""
    min_tokens: int = 0
    """vLLM's: no end of sequence (and no stop string or stop token id) before this many tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """vLLM's: more token ids that end the completion (its stop_reason is then the id)."""
    include_stop_str_in_output: bool = False
    """vLLM's: a matched stop string stays at the end of the text."""
    min_p: float = 0.0
    """vLLM's: drop tokens less likely than min_p times the most likely one (0: off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's: (token id, bias added to its logit) pairs."""
    allowed_token_ids: tuple[int, ...] | None = None
    """vLLM's: only these tokens may be sampled (None: any)."""
    bad_words: tuple[str, ...] = ()
    """vLLM's: words never generated (their last token is banned wherever the tokens before it were just
    generated)."""
    bad_word_ids: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False, repr=False)
    """`bad_words` as token sequences (ChatPrompts.bad_word_ids), when the API tokenized them in its own worker
    thread; None: the Reasoner does, on the chat worker's thread (60,000 words held every chat up 7 s)."""
    skip_special_tokens: bool = True
    """Special tokens are left out of the text (vLLM's default)."""
    add_generation_prompt: bool = True
    """The chat template opens the assistant's turn after the messages."""
    continue_final_message: bool = False
    """vLLM's: the last message (an assistant's prefix) is left open and continued."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: only the prompt's last this-many tokens are kept (-1: max_model_len; text prompts only)."""
    prebuilt: Any = field(default=None, compare=False, repr=False)
    """The prompt built from these params (runner/chat_prompt.py's ChatPrompt: template, tokens, media),
    when the API built it in its own worker thread; None: the Reasoner builds it (on the chat worker's
    thread, where a megabytes-long prompt would hold up every running chat while it tokenizes)."""
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra chat template variables (`chat_template_kwargs`, e.g. enable_thinking)."""
    image_min_pixels: int | None = None
    """Qwen3-VL image processor `size.shortest_edge` (pixel budget floor) for this request (None: the server's)."""
    image_max_pixels: int | None = None
    """`size.longest_edge` (pixel budget ceiling; None: the server's)."""
    structured: StructuredOutput | None = None
    """Constrain the completion to a grammar (structured outputs); None: free text."""
    think_first: bool = False
    """The answer may think (<think> ... </think>, as --reasoning-parser reads it) before `structured`'s
    grammar starts."""
    stops_after_thoughts: bool = False
    """Stop strings end the answer, not its thoughts (vLLM with a reasoning parser): in an answer that opens
    with <think>, they match only after </think>."""
    tools: tuple[dict, ...] = ()
    """Function tools the chat template shows the model ({"type": "function", "function": {...}})."""
    cache_salt: str | None = None
    """vLLM's prefix-cache salt: a chat reuses cached prompt blocks only of chats with the same salt (it seeds
    the first block's key, runner/prefix_hashes.py), so clients can keep their prompts' K/V to themselves."""

    @property
    def prompt_key(self) -> int:
        """What the choices of one request share, and no other live request does: the identity of their
        messages, or of their raw prompt ids (the empty messages tuple of a raw prompt is one shared object).
        The Reasoner prefills chats with one key once; the chat worker counts that prompt once."""
        return id(self.messages if self.prompt_ids is None else self.prompt_ids)

    def choices(self, n: int) -> list[ChatParams]:
        """These params as the n choices of one request: choice i samples with seed + i (`choice_seed`:
        different samples, the same ones on every run)."""
        return [self] + [
            replace(self, seed=None if self.seed is None else choice_seed(self.seed, i)) for i in range(1, n)
        ]

    def request_choices(self, n: int) -> list[ChatParams]:
        """`choices(n)` for a request's `n`: more than one greedy choice is a ParamError naming `n`, as vLLM
        refuses it (they would all be the same)."""
        if n > 1 and self.temperature < GREEDY_BELOW:
            raise ParamError("n", f"n must be 1 when using greedy sampling, got {n}.")
        return self.choices(n)

    def __post_init__(self) -> None:
        # vLLM's SamplingParams takes a string `stop` as one stop string (iterated, "END" was "E", "N", "D")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        # and None for its list fields as none (its dataclass defaults them to None, then to [])
        for name in ("stop", "stop_token_ids", "bad_words"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        # a numpy integer seed as the int it is: torch's manual_seed and choice_seed's int64 wrap take no other
        seed: Any = self.seed
        if is_int(seed) and not isinstance(seed, int):
            object.__setattr__(self, "seed", operator.index(seed))

    def validate(self) -> ChatParams:
        self._validate_types()
        if self.prompt_ids is not None:
            if not self.prompt_ids:
                raise ParamError("prompt", "the prompt must contain at least one token")
            if self.messages:
                raise ParamError("messages", "a raw prompt (prompt_ids) takes no messages")
        elif not self.messages:
            raise ParamError("messages", "messages must contain at least one message")
        if self.max_tokens_bound is not None and self.max_tokens_bound < 1:
            raise ValueError(f"max_tokens_bound must be at least 1, got {self.max_tokens_bound}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ParamError("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ParamError("stop", "stop strings must be non-empty")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ParamError("cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ParamError(name, f"{name} must be in [-2, 2], got {value}")
        if not 0 <= self.top_logprobs <= 20:
            raise ParamError("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs", "top_logprobs needs logprobs: true")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ParamError(
                "prompt_logprobs", f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"
            )
        if not 0 <= self.min_p <= 1:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ParamError("allowed_token_ids", "allowed_token_ids must not be empty")
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequest("continue_final_message",
                                 "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")  # fmt: skip
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty >= MIN_REPETITION_PENALTY):
            raise ParamError("repetition_penalty", "repetition_penalty must be a finite number greater than zero "
                             f"(at least {MIN_REPETITION_PENALTY:g}), got {self.repetition_penalty}")  # fmt: skip
        return self

    def _validate_types(self) -> None:
        """Each field's type before any comparison (param_types.py), named as the request names it: a wrong
        one had been a raw TypeError, or accepted (`max_tokens=2.5`, `seed=1.5`) to fail in the sampler."""
        check_items("prompt", "prompt", self.prompt_ids, "int", optional=True)
        if not isinstance(self.messages, (list, tuple)):
            raise ParamError("messages", f"messages must be a list, got {type_name(self.messages)}")
        for i, msg in enumerate(self.messages):
            if not isinstance(msg, ChatMessage):
                raise ParamError("messages", f"messages[{i}] must be a ChatMessage, got {type_name(msg)}")
            if not isinstance(msg.role, str):
                raise ParamError(
                    "messages", f"messages[{i}].role must be a string, got {type_name(msg.role)}"
                )
            parts = msg.content
            if not (isinstance(parts, str) or (
                isinstance(parts, (list, tuple)) and all(isinstance(p, ChatPart) for p in parts)
            )):  # fmt: skip
                raise ParamError("messages", f"messages[{i}].content must be a string or a list of ChatParts, "
                                 f"got {type_name(parts)}")  # fmt: skip
        for name in ("max_tokens", "seed", "prompt_logprobs", "truncate_prompt_tokens"):
            check_int(name, name, getattr(self, name), optional=True)
        for name in ("top_k", "top_logprobs", "min_tokens"):
            check_int(name, name, getattr(self, name))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_p"):  # fmt: skip
            check_real(name, name, getattr(self, name))
        for name in ("stop", "bad_words"):
            check_items(name, name, getattr(self, name), "str")
        check_items("stop_token_ids", "stop_token_ids", self.stop_token_ids, "int")
        check_items("allowed_token_ids", "allowed_token_ids", self.allowed_token_ids, "int", optional=True)
        for name in ("logprobs", "return_token_ids", "ignore_eos", "include_stop_str_in_output",
                     "skip_special_tokens", "add_generation_prompt", "continue_final_message"):  # fmt: skip
            check_bool(name, name, getattr(self, name))
