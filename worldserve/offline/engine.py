"""`worldserve.Engine`: the model `worldserve serve` serves, in this process, with no HTTP: vLLM's `LLM` for
Cosmos3 (videos and Reasoner chats from one load).

`Engine(model=None | folder | repo id, **options)` (options: serve's flags without dashes, offline/options.py)
or `Engine.from_config(EngineConfig)` loads what the server loads (commands/serve_backend.py `load_backend`:
the video pipeline, the startup warm-up shapes, the Reasoner sharing the transformer's und tower; within
`init_timeout`, offline/loading.py) and runs the server's engine around it: the video engine thread
(engine/engine.py: scheduler, batching of same-shape requests, the MP4 encode pool) and the chat worker
(continuous batching), driven through an `EngineClient` on a private event loop thread
(offline/loop_thread.py). Every call blocks its own thread only: calls from several threads run concurrently
in the engine, each getting its own result.

- `generate_video(prompt | VideoParams, **fields) -> VideoOutput` (a list of them: a list, run together:
  offline/video_requests.py);
- `generate_image(prompt, n=1, **fields) -> list[ImageOutput]`: text-to-image as POST /v1/images/generations
  makes it (its defaults and seeds, the n images batched: offline/image_requests.py);
- `chat(messages, params=None, **sampling) -> ChatOutput` (a list of conversations: a list of them; `n`
  samples each: `ChatOutput.outputs`) and `stream_chat(...)` yielding one sample's text as it is sampled
  (offline/chat_requests.py: the HTTP route's own parsing and checks);
- `get_metrics()`: what `worldserve serve` exports at /metrics, for this Engine's requests, as vLLM's
  `LLM.get_metrics()` returns its own (offline/metrics.py: the server's Metrics wired the server's way);
- `close()`: stops the engine, the chat worker and a multi-GPU pipeline's peer processes; idempotent, also
  `with Engine(...) as engine:`. An engine never closed is stopped when it is collected or at the
  interpreter's exit, without waiting for its requests: Python's exit waits for the non-daemon threads first,
  whose requests are made in full (offline/engine_parts.py, lasting_pool.py); a daemon thread's call still
  running at the stop ends silently.
Bad input is a ParamError (a ValueError whose `.param` names the field) before any model work.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import typing
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from worldserve.chat_params import ChatParams
from worldserve.closeable import Closeable
from worldserve.config import EngineConfig
from worldserve.engine.client import ChatDelta, ChatStarted, EncodeOptions, EngineClient
from worldserve.offline.chat_requests import (
    REFUSED_FIELDS,
    STREAMED_SAMPLES,
    chat_answer,
    chat_answers,
    conversation_error,
    is_conversation_batch,
    next_event,
    request_body,
    start_chats,
)
from worldserve.offline.engine_parts import EngineParts
from worldserve.offline.image_requests import image_params, run_images
from worldserve.offline.loading import load_within
from worldserve.offline.loop_thread import LoopThread
from worldserve.offline.metrics import Metric, metrics_snapshot, served_state
from worldserve.offline.options import engine_config
from worldserve.offline.outputs import ChatOutput, ImageOutput, VideoOutput
from worldserve.offline.video_requests import (
    check_timeout,
    is_request_list,
    run_video,
    run_videos,
    video_params,
    video_params_list,
)
from worldserve.param_errors import ParamError
from worldserve.params import VideoParams

MAX_BATCH_CHATS = 64
"""The most conversations of a batched chat() started at once (more wait their turn)."""
BATCHES_IN_FLIGHT = 2
"""A generate_video list keeps at most this many max_batch_size batches of its requests in the engine (queued
or running): the next batch waits queued while one runs, the rest of the queue is left to other threads."""
UNBOUNDED_QUEUE = sys.maxsize
"""The EngineClient's `max_queued_requests` here: none. vLLM's `LLM` refuses no request for a full queue; the
`max_queued_requests` option (serve's --max-queued-requests, HTTP 429 past it) is accepted for parity and
unused: a Python caller's requests, from any number of threads, wait their turn."""


class Engine(Closeable):
    """One loaded model serving video generation and Reasoner chats to the threads of this process."""

    def __init__(self, model: str | os.PathLike[str] | None = None, **options: Any):
        """Load `model` (a checkpoint folder or a Hugging Face repo id; None: the embedded tiny random
        checkpoint, whose output is noise) with `worldserve serve`'s options by their field names
        (`device="cpu"`, `dtype="float32"`, `max_batch_size=2`, `max_model_len=4096`,
        `warmup_shapes="none"`, `default_sampling_params={"0": {"num_inference_steps": 20}}`, ...)."""
        self._start(engine_config(None if model is None else os.fspath(model), options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """An Engine of a whole EngineConfig (its `server` section, the HTTP server's, is not used)."""
        if not isinstance(config, EngineConfig):
            raise TypeError(f"from_config takes an EngineConfig, got {type(config).__name__}")
        engine = cls.__new__(cls)
        engine._start(config)
        return engine

    def _start(self, config: EngineConfig) -> None:
        from worldserve.engine.engine import Engine as VideoEngine
        from worldserve.engine.jobs import JobStore

        # (the configuration it runs with: environment defaults resolved)
        self.config = config = config.resolve()
        # (as serve's load: bounded by init_timeout, a TimeoutError past it)
        backend, gpu_memory, *chat = load_within(config)
        served = config.model.served_model_name
        assert served is not None, "resolve() names the model"
        # the client keeps a job store; no job is made here: a folder of its own, removed at close
        storage = tempfile.mkdtemp(prefix="worldserve-offline-")
        try:
            store = JobStore(storage)
            engine = VideoEngine(backend, store, config.scheduler)
            # (no admission bound: a caller's requests wait their turn, never refused for a full queue)
            client = EngineClient(engine, store, model_name=served, max_queued_requests=UNBOUNDED_QUEUE,
                                  chat_backend=chat[0] if chat else None, max_num_seqs=config.scheduler.max_num_seqs)  # fmt: skip
        except BaseException:
            shutil.rmtree(storage, ignore_errors=True)
            if hasattr(backend, "close"):  # (a multi-GPU pipeline's peer processes)
                backend.close()
            raise
        loop = LoopThread()
        self._parts = EngineParts(client=client, loop=loop, backend=backend, storage=storage)
        # collected or left open at the interpreter's exit: stopped without waiting (no thread started then)
        self._finalizer = weakref.finalize(self, self._parts.stop_at_once)
        try:
            loop.run(client.start())
            # what serve's routes read, its metrics observing the engine (a bad media option fails the start
            # here, as serve's does)
            self._state = served_state(client, config, gpu_memory)
        except BaseException:
            self.close()
            raise

    # -- video ----------------------------------------------------------------------------------------------
    @typing.overload
    def generate_video(
        self, prompt: str | VideoParams, *, timeout: float | None = None, **fields: Any
    ) -> VideoOutput: ...
    @typing.overload
    def generate_video(
        self, prompt: Sequence[str | VideoParams], *, timeout: float | None = None, **fields: Any
    ) -> list[VideoOutput]: ...
    def generate_video(
        self, prompt: Any, *, timeout: float | None = None, **fields: Any
    ) -> VideoOutput | list[VideoOutput]:
        """One video (or image: num_frames=1) from `prompt` (text or Cosmos3's JSON prompt) or a VideoParams,
        with VideoParams fields by name (`width=1280, height=720, num_frames=189, num_inference_steps=35,
        guidance_scale=6.0, seed=42, fps=24, negative_prompt=..., generate_sound=...`; `image=` an array, PIL
        image, bytes or path for image-to-video; `video=` a uint8 (F, H, W, 3) clip for video-to-video);
        fields left out take the engine's `default_sampling_params`, then Cosmos3's defaults (the size too: an
        image's or clip's aspect ratio sets it only over HTTP, where no size is 720p at that ratio). Blocks until its
        MP4 is made; other threads' requests run meanwhile (same-shape ones batched up to max_batch_size).
        `timeout` (seconds): TimeoutError after aborting it. ParamError naming a bad field.

        A list (of prompts and / or VideoParams) is a batch, as vLLM's `LLM.generate(prompts)` takes: the
        fields apply to every item (a seed too: each item gets it, or the default 42, as a call of its own
        does); all are checked first (ParamError naming `prompt[i]` or `prompt[i].<field>`, a keyword field
        by its name), then queued together, same shapes next to each other so that they batch; the outputs
        come as a list in their order, each byte for byte its own call's unless it shared a batched forward
        (whose rounding can move a pixel by a level). The first to fail, `timeout` passing (it bounds the
        whole list) or an interrupt aborts the others."""
        check_timeout(timeout)
        config = self.config
        static_lora, per_request_lora = config.lora.static_lora, config.lora.enable_lora
        defaults = config.video.video_defaults
        if is_request_list(prompt):
            params_list = video_params_list(prompt, fields, defaults=defaults, static_lora=static_lora,
                                            per_request_lora=per_request_lora)  # fmt: skip
            parts = self._open()
            if not params_list:
                return []
            at_once = BATCHES_IN_FLIGHT * config.scheduler.max_batch_size
            batch = run_videos(parts.client, params_list, EncodeOptions(), at_once=at_once, keywords=fields)
            return parts.run(batch, timeout)
        params = video_params(prompt, fields, defaults=defaults, static_lora=static_lora,
                              per_request_lora=per_request_lora)  # fmt: skip
        parts = self._open()
        return parts.run(run_video(parts.client, params, EncodeOptions()), timeout)

    def generate_image(
        self, prompt: str, *, n: int = 1, timeout: float | None = None, **fields: Any
    ) -> list[ImageOutput]:
        """`n` (1 to 10) images of the text `prompt`, as POST /v1/images/generations makes them: its defaults
        (1024x1024, 50 steps, guidance 7.0, flow shift 3.0 or the `flow_shift` option, a random seed; not
        `default_sampling_params`), image i seeded seed + i, the n batched together. VideoParams fields by name
        (`width`, `height`, `seed`, `num_inference_steps`, ...; video-only ones, num_frames other than 1 and
        generate_sound are refused). `timeout` as generate_video's. ParamError naming a bad field."""
        check_timeout(timeout)
        lora = self.config.lora
        params_list = image_params(prompt, n, fields, default_flow_shift=self.config.video.flow_shift,
                                   static_lora=lora.static_lora, per_request_lora=lora.enable_lora)  # fmt: skip
        parts = self._open()
        return parts.run(run_images(parts.client, params_list), timeout)

    # -- chat -----------------------------------------------------------------------------------------------
    @typing.overload
    def chat(
        self, messages: str | Sequence[Mapping[str, Any]], params: ChatParams | None = None, **sampling: Any
    ) -> ChatOutput: ...
    @typing.overload
    def chat(
        self,
        messages: Sequence[Sequence[Mapping[str, Any]]],
        params: ChatParams | None = None,
        **sampling: Any,
    ) -> list[ChatOutput]: ...
    def chat(
        self, messages: Any, params: ChatParams | None = None, **sampling: Any
    ) -> ChatOutput | list[ChatOutput]:
        """The Reasoner's answer to `messages` (OpenAI chat messages; a string: one user turn), sampled with
        the chat completion fields in `sampling` (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`,
        `response_format`, ...; left out: the checkpoint's generation config, as the server's) or a whole
        ChatParams (not both: a TypeError; `n` goes with either). Images and videos as the HTTP route takes
        them: `image_url` / `video_url` parts with a base64 `data:` URL, a `file://` path under
        `allowed_local_media_path`, or an http(s) URL; and vLLM's `{"type": "image_pil", "image_pil": PIL.Image}`.

        `n=k` (1 to 16; not with greedy sampling) samples the answer k times, as the route's `n` choices (one
        prefill, decoded batched; sample i seeded seed + i): `ChatOutput.outputs` holds them in order, its
        `text` & co. are the first's, its usage counts the prompt once and every sample's tokens.

        A list of conversations (each a list of messages) is a batch, as vLLM's `LLM.chat` takes: all are
        checked first (ParamError naming `messages[i]...`; a bad sampling field by its name: every
        conversation's), then run together on the engine's loop (batched by the chat worker), answered as a list in their order; the first to fail, or an interrupt, cancels
        the others."""
        parts, state = self._chat_parts(params, sampling)
        if is_conversation_batch(messages):
            return self._chat_batch(parts, state, messages, params, sampling)
        return parts.run(chat_answer(state, request_body(messages, sampling), params))

    def stream_chat(
        self, messages: str | Sequence[Mapping[str, Any]], params: ChatParams | None = None, **sampling: Any
    ) -> Iterator[str]:
        """`chat`, its text yielded piece by piece as it is sampled (one sample: n > 1 is a ParamError naming
        `n`). Closing the iterator early (a `break`) cancels the chat at its next step. The request is checked
        when iteration starts."""
        for event in self._events(messages, params, sampling):
            if isinstance(event, ChatDelta) and event.text:
                yield event.text

    @staticmethod
    def _chat_batch(parts: EngineParts, state: Any, conversations: Sequence[Any], params: ChatParams | None,
                    sampling: Mapping[str, Any]) -> list[ChatOutput]:  # fmt: skip
        """chat() of each conversation, together on the loop (the chat worker batches them), after all are read
        (a bad one fails the call before any runs)."""
        bodies = []
        for i, conversation in enumerate(conversations):
            try:
                bodies.append(request_body(conversation, sampling))
            except ParamError as exc:
                raise conversation_error(i, exc) from None
        return parts.run(chat_answers(state, bodies, params, MAX_BATCH_CHATS))

    def _chat_parts(self, params: ChatParams | None, sampling: Mapping[str, Any]) -> tuple[EngineParts, Any]:
        """The open engine's parts and its chat route state, or the error of a call that cannot chat."""
        if params is not None and not isinstance(params, ChatParams):
            raise TypeError(f"params must be a ChatParams, got {type(params).__name__}")
        # (n is the request's, not a sampling field: the ChatParams' samples are made with it)
        dropped = [name for name in sampling if name != "n"]
        if params is not None and dropped:
            # (the ChatParams' sampling is used as it is: the fields would have been dropped in silence)
            raise TypeError(
                f"pass sampling fields or a ChatParams, not both (got params and {', '.join(dropped)})"
            )
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):  # (what the ChatOutput cannot carry)
            if params is not None and getattr(params, name) not in (None, False, 0):
                raise ParamError(name, f"{name} is not taken here: {REFUSED_FIELDS[name]}")
        parts = self._open()
        if parts.client.chat_worker is None:
            raise RuntimeError("this Engine runs no Reasoner (tensor_parallel_size > 1, or the fake backend)")
        return parts, self._state

    def _events(self, messages: Any, params: ChatParams | None,
                sampling: Mapping[str, Any]) -> Iterator[ChatStarted | ChatDelta]:  # fmt: skip
        """The chat's events (ChatStarted, then one ChatDelta a token to the last), read from this thread; the
        chat cancelled when the reader stops early."""
        parts, state = self._chat_parts(params, sampling)
        if is_conversation_batch(messages):
            raise ParamError("messages", "stream_chat takes one conversation: chat() takes a list of them")
        body = request_body(messages, sampling)
        if body.n > 1:
            raise ParamError("n", f"n={body.n}: {STREAMED_SAMPLES}")
        (events,) = parts.run(start_chats(state, body, params, coalesce=False))
        try:
            while (event := parts.run(next_event(events))) is not None:
                yield event
                if isinstance(event, ChatDelta) and event.finish_reason is not None:
                    return
        finally:
            # (a finished chat's too: its end is counted as its stream closes, chat_requests.start_chats)
            if parts.loop.running:
                parts.run(events.aclose())

    # -- metrics --------------------------------------------------------------------------------------------
    def get_metrics(self) -> list[Metric]:
        """A snapshot of what `worldserve serve` would export at /metrics for this Engine's requests so far
        (videos, chats, the Reasoner's prompt upsampling): its `worldserve:` and `vllm:` families as vLLM's
        `LLM.get_metrics()` returns its own, a `Counter`, `Gauge` or `Histogram` (worldserve.offline) a series,
        named as its family (`worldserve:request_success`, /metrics' `worldserve:request_success_total`). Each
        Engine counts its own; read after close() too."""
        return metrics_snapshot(self._state.metrics.registry)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _open(self) -> EngineParts:
        parts = self._parts
        parts.check_open()
        return parts

    def close(self) -> None:
        """Stop the engine: running requests get `shutdown_timeout` seconds (the option; 30 by default) to
        finish, later ones fail; the chat worker, the engine thread and a multi-GPU pipeline's peer processes
        stop. Idempotent."""
        parts = getattr(self, "_parts", None)
        if parts is not None:
            parts.close(self.config.scheduler.shutdown_timeout)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()

    def __repr__(self) -> str:
        parts = getattr(self, "_parts", None)
        state = "closed" if parts is None or parts.closed else "open"
        model = self.config.model
        return f"Engine(model={model.model!r}, device={model.device!r}, dtype={model.dtype!r}, {state})"

    def __reduce__(self) -> Any:
        raise TypeError(
            "an Engine cannot be pickled (it holds a loaded model and threads): build one in each process"
        )

    @property
    def has_sound(self) -> bool:
        """Whether the checkpoint makes audio with its videos (a sound tokenizer)."""
        return self._parts.client.has_sound

    @property
    def num_unfinished_requests(self) -> int:
        """Video requests queued or running and chats waiting or running (vLLM's LLM.get_num_unfinished...)."""
        client = self._parts.client
        worker = client.chat_worker
        chats = 0 if worker is None else worker.num_waiting + worker.num_running
        return client.num_waiting + client.num_running + chats
