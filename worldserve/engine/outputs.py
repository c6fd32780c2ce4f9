"""Messages between the engine (CPU-side request lifecycle) and the video backend (the GPU side).

The engine never touches tensors: it asks a `VideoBackend` to `prepare` a request (prompt encoding, und
prefill of both CFG branches, initial noise, I2V encode), to advance a list of prepared requests by one
denoising step (`denoise`, batched when their `batch_key`s match), and to `decode` a finished one into a
`VideoResult` (uint8 frames + float audio on the host; for a job, a stream of frame chunks that the MP4
mux in a CPU pool reads while the decode still runs).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from worldserve.chat_params import ChatParams
from worldserve.media.frame_stream import FrameStream
from worldserve.media.processor_cache import ProcessorCache
from worldserve.param_errors import ParamError
from worldserve.params import VideoParams
from worldserve.sampling.chat_defaults import ChatDefaults


@dataclass(slots=True, kw_only=True)
class VideoResult:
    frames: np.ndarray | FrameStream
    """uint8 (F, H, W, 3); F == 1 for an image. A FrameStream only from `decode(stream=True)`."""
    fps: float
    """Frame rate of the frames."""
    audio: np.ndarray | None = None
    """float32 (channels, samples) in [-1, 1], trimmed to the video duration; None without sound."""
    sample_rate: int = 48000
    """Audio sample rate in Hz."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per stage (prefill, diffuse, vae.decode, audio.decode, ...)."""
    peak_memory_mb: float = 0.0
    """Peak accelerator memory during the request (0 on CPU)."""
    prompt_tokens: int = 0
    """Token ids of the cond prompt the transformer's und tower prefilled (chat template, system message and
    resolution / duration templates included: what the tokenizer made of it); usage's input tokens."""
    gen_tokens: int = 0
    """Gen tokens the transformer denoised for the output: its noisy latent patches (clean I2V / V2V
    condition frames left out) plus its sound tokens; usage's output tokens."""


class DenoiseState(Protocol):
    """Per-request state the backend owns; the engine only reads these fields."""

    request_id: str
    step_index: int
    num_steps: int

    @property
    def batch_key(self) -> Hashable:
        """Requests with equal keys may denoise in one batched forward."""
        ...


class BackendLost(RuntimeError):
    """The backend can run nothing more in this process (a peer rank of a multi-GPU pipeline died, or was
    stopped after a failure in the middle of an exchange with it): the engine stops as on a crash (health
    503) and its running jobs are queued again for the next start, instead of failing them one by one.
    Its message (the log's, generate's) names the cause; `public`, what HTTP clients are told, does not (a
    cause can name internal addresses, paths and pids)."""

    def __init__(self, message: str, public: str | None = None):
        super().__init__(message)
        self.public = message if public is None else public


def crash_reason(exc: BaseException) -> str:
    """An engine crash as HTTP clients hear of it (/health, the waiting sync requests): an OSError by its
    errno's words alone (its str() names the file: a storage path is no client's business)."""
    if isinstance(exc, BackendLost):
        return exc.public
    return error_words(exc) if isinstance(exc, OSError) else str(exc)


def error_words(exc: BaseException) -> str:
    """`Type: message` of an error clients hear of; an OSError by its errno's words alone (its str() names
    the file: a storage path is no client's business)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


class VideoBackend(Protocol):
    has_sound: bool
    """Whether the checkpoint ships a sound tokenizer (audio on by default)."""

    def problem(self) -> str | None:
        """Why it cannot serve now (a multi-rank backend's peer is gone: /health's reason), or None."""
        ...

    def validate(self, params: VideoParams) -> VideoParams:
        """Model-aware validation (prompt length, sound availability); raises ParamError."""
        ...

    def prepare(self, request_id: str, params: VideoParams) -> DenoiseState: ...

    def denoise(self, states: Sequence[DenoiseState]) -> None:
        """Advance every state by exactly one step, each state's update whole, its `step_index` last: when the
        call raises, a state whose step_index did not move is as it was, to be stepped again (engine/batch.py;
        a backend may also have `free_cached_memory()`, called before such retries)."""
        ...

    def decode(self, state: DenoiseState, *, stream: bool = False) -> VideoResult:
        """The finished state's frames and audio. `stream`: the frames may be a FrameStream that makes its
        chunks as it is read (read at once, on the calling thread, before `release`)."""
        ...

    def release(self, state: DenoiseState) -> None:
        """Free the state's device memory (called on cancel and after decode)."""
        ...


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled token's log-probability under the model (raw logits, before temperature / penalties)."""

    token: str
    """The token's text (decoded alone)."""
    logprob: float | None
    """None only for a prompt's first token (prompt logprobs): nothing comes before it."""
    top: tuple[tuple[str, float], ...] = ()
    """The `top_logprobs` most likely tokens at this position, most likely first."""
    token_id: int | None = None
    """The token's id and the ids of `top` (vLLM's prompt_logprobs are keyed by id; return_tokens_as_token_ids
    shows them); prompt logprobs also carry the token's rank at this position (1: the most likely)."""
    rank: int | None = None
    top_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """One Reasoner decode step's outcome (runner -> chat worker -> API)."""

    text: str
    """New completion text (may be empty: held back for an incomplete character or stop prefix)."""
    finish_reason: str | None
    """None while generating, then "stop" or "length"."""
    completion_tokens: int
    """Completion tokens so far (the token that ended the chat included, as vLLM counts it)."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """With `logprobs` requested: the token sampled this step (the one that ended the chat too)."""
    stop_reason: str | int | None = None
    """With finish_reason "stop": the `stop` string that matched, the id of a request's `stop_token_ids` that
    ended it, or None for an end-of-sequence token."""
    reasoning_tokens: int = 0
    """On the last delta: the tokens of the answer's thoughts, as --reasoning-parser qwen3 splits them (between
    an opening <think> and its </think>, the tags not counted; runner/reasoner_session.py thought_tokens)."""
    token_ids: tuple[int, ...] = ()
    """The tokens sampled this step (the one that ended the chat too: vLLM's output token ids, as many as
    `completion_tokens` counts)."""

    @staticmethod
    def joined(deltas: Sequence[ChatDelta]) -> ChatDelta:
        """Consecutive deltas as one: their texts, log-probabilities and token ids joined once (folding them
        a pair at a time copied the growing text a token), the counts and the ending the last one's."""
        last = deltas[-1]
        return ChatDelta(
            text="".join(d.text for d in deltas), finish_reason=last.finish_reason,
            completion_tokens=last.completion_tokens, logprobs=tuple(e for d in deltas for e in d.logprobs),
            stop_reason=last.stop_reason, reasoning_tokens=last.reasoning_tokens,
            token_ids=tuple(t for d in deltas for t in d.token_ids),
        )  # fmt: skip


class ChatSession(Protocol):
    """A prefilled chat completion; each step() samples one token (and runs one decode forward)."""

    prompt_tokens: int
    prompt_token_ids: Sequence[int]
    """The rendered prompt's token ids (vLLM's return_token_ids)."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None
    """Each prompt token's log-probability when the request asked for prompt_logprobs, else None."""
    cached_tokens: int
    """Prompt tokens found in the prefix cache rather than computed (usage's cached_tokens)."""
    preempted: bool
    """Whether its K/V cache blocks went to other chats: it idles (no token) until it is recomputed."""
    failure: ParamError | None
    """Why it ended with finish_reason "error" (its rules left no next token), read by the chat worker."""

    def step(self) -> ChatDelta: ...

    def close(self) -> None:
        """Give its resources (K/V cache blocks) back now: the chat was cancelled or failed. Idempotent."""
        ...


class ChatBackpressure(RuntimeError):
    """ChatBackend.start cannot take this chat now (its K/V cache is full): keep it queued and try again
    after the next step, when running chats may have finished."""


class ChatBackend(Protocol):
    max_model_len: int | None
    """Its context in tokens (prompt + completion); None: unbounded."""
    sampling_defaults: ChatDefaults
    """What requests' omitted sampling fields take (--generation-config; vLLM's neutral values by default)."""
    prompts: Any
    """Its prompt builder (runner/chat_prompt.py ChatPromptBuilder: chat template, tokens, media), used off
    the chat worker's thread; None for a backend that builds its prompts in `start`."""
    grammars: Any
    """Its structured-output GrammarCompiler (sampling/token_grammar.py); None: structured outputs are
    refused."""
    media_cache: ProcessorCache | None
    """Its decoded / preprocessed chat media, by content (metrics report its hits); None: none kept."""

    @property
    def concurrent_with_video(self) -> bool:
        """Whether start_many / step_all may run without the model lock, beside video steps."""
        ...

    @property
    def prefix_cache_counts(self) -> tuple[int, int] | None:
        """Prompt tokens looked up in its prefix cache so far and of them the tokens found; None: no cache."""
        ...

    def start(self, params: ChatParams) -> ChatSession:
        """Validate, tokenize, encode images, prefill; raises ParamError for a bad request."""
        ...

    def start_many(self, batch: Sequence[ChatParams]) -> list[ChatSession | Exception]:
        """start() of several chats at once (one prefill pass): per chat its session or its exception
        (ParamError, ChatBackpressure for no room now: then every later one is refused too, in order)."""
        ...

    def step_all(self, sessions: Sequence[ChatSession]) -> list[ChatDelta]:
        """One step of each unfinished session, their decode forwards batched into one."""
        ...

    def kv_cache_usage(self) -> float:
        """Fraction of the K/V cache's blocks held by chats (0..1)."""
        ...

    @property
    def preemptions(self) -> int:
        """Chats preempted so far (their K/V freed and recomputed later)."""
        ...
