"""Reasoner: Qwen3-VL chat completions on the und tower of the loaded Cosmos3 transformer (no second copy).

start(ChatParams) -> ReasonerSession:
  prompt:  the checkpoint's chat template (image parts render as <|vision_start|><|image_pad|><|vision_end|>);
           each <|image_pad|> is expanded to the image's merged-patch count (t*h*w / merge**2), as Qwen3-VL's
           processor does; images go through Qwen3-VL preprocessing and the ViT (models/cosmos3/vision.py).
           A video part (frames sampled and resized at decode, media/video_input.py) renders as
           <|vision_start|><|video_pad|><|vision_end|>, replaced as Qwen3VLProcessor does by one
           "<T seconds><|vision_start|><|video_pad|> x (h*w / merge**2)<|vision_end|>" per temporal patch.
  prefill: one und_step over the whole prompt with embed_tokens rows replaced by the ViT embeddings at the
           image-pad and video-pad rows, Qwen3-VL get_rope_index positions, and deepstack features (image and
           video rows in sequence order) added after the first len(deepstack) und layers; the K/V go into the
           session's sequence of the shared paged K/V pool (models/layers/paged_kv.py).
session.step() -> ChatDelta: sample the next token (sampling/tokens.py) from the pending logits, detokenize
  incrementally (a trailing incomplete UTF-8 character and a possible stop-string prefix are held back), and,
  unless finished, run one und decode step at the next mRoPE position (max prompt position + 1 + k).
step_all(sessions) -> [ChatDelta]: the same for several sessions with ONE batched decode step
  (runner/und_decoder.py: paged attention, CUDA-graphed on a GPU): continuous batching of concurrent chats.
K/V memory: the pool holds `kv_cache_tokens` tokens in 64-token blocks, at least max_model_len. A chat that
  finds too few free blocks for its prompt is not started (ChatBackpressure: the chat worker keeps it queued).
  When a running chat needs a block and none is free, the most recently started chat is preempted: its blocks
  are freed and it waits, then resumes by prefilling its prompt plus the tokens it already produced (vLLM's
  recompute preemption); its stream sees no gap in the text, only a pause. No new chat starts while one waits.
Finish: "stop" on <|im_end|> / <|endoftext|> / the config eos or a `stop` string, "length" at max_tokens or
the context limit. Callers serialize model access (the chat worker holds the model lock around start/step).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from worldserve.engine.outputs import ChatBackpressure, ChatDelta, TokenLogprob
from worldserve.models.cosmos3.batch import UndBatch
from worldserve.models.cosmos3.vision import (
    QWEN3VL_MAX_PIXELS,
    QWEN3VL_MIN_PIXELS,
    VisionEncoder,
    VisionInputs,
    chat_positions,
    video_inputs,
    video_timestamps,
)
from worldserve.models.layers.paged_kv import DEFAULT_BLOCK_SIZE, PagedSequence, PoolExhausted
from worldserve.params import ChatParams, ParamError
from worldserve.runner.und_decoder import UndDecoder
from worldserve.sampling.tokens import TokenSampler, sample_tokens

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_MAX_NUM_SEQS = 32


def default_kv_cache_tokens(max_model_len: int, *, layerwise_offload: bool = False) -> int:
    """Two full-length chats (one under layerwise offload, whose GPUs are small): 9.7 / 4.8 GB on Nano at the
    default max_model_len 32768 (144 KiB a token)."""
    return max_model_len if layerwise_offload else 2 * max_model_len


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    input_ids: list[int]
    """Token ids with every image placeholder expanded."""
    vision: VisionInputs | None
    """Preprocessed images in prompt order, or None when the prompt has none."""
    video: VisionInputs | None = None
    """Preprocessed videos in prompt order (one grid row per video), or None."""


class Reasoner:
    """The Qwen3-VL view of a loaded Cosmos3Transformer + the ViT + the checkpoint tokenizer."""

    def __init__(
        self,
        transformer: Any,
        tokenizer: Any,
        vision: VisionEncoder | None,
        *,
        image_token_id: int,
        video_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        min_pixels: int = QWEN3VL_MIN_PIXELS,
        max_pixels: int = QWEN3VL_MAX_PIXELS,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        kv_cache_tokens: int | None = None,
        kv_block_size: int = DEFAULT_BLOCK_SIZE,
        enforce_eager: bool = False,
    ) -> None:
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.vision = vision
        self.image_token_id = image_token_id
        self.video_token_id = (
            video_token_id if video_token_id is not None else tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        )
        stops = {tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS} | set(eos_token_ids)
        self.stop_token_ids = frozenset(i for i in stops if i is not None and i != tokenizer.unk_token_id)
        self.max_model_len = max_model_len
        self.preprocess = (
            vision.preprocessor(min_pixels=min_pixels, max_pixels=max_pixels) if vision else None
        )
        if kv_cache_tokens is None:
            kv_cache_tokens = default_kv_cache_tokens(
                max_model_len, layerwise_offload=transformer.und_blocks is not None
            )
        if kv_cache_tokens < max_model_len:
            raise ValueError(
                f"the Reasoner's K/V cache holds {kv_cache_tokens} tokens, fewer than --max-model-len "
                f"{max_model_len}: raise --kv-cache-memory-bytes or lower --max-model-len"
            )
        self.pool = transformer.new_paged_pool(kv_cache_tokens, block_size=kv_block_size)
        self.decoder = UndDecoder(
            transformer, self.pool, max_batch=max_num_seqs, max_model_len=max_model_len,
            enforce_eager=enforce_eager,
        )  # fmt: skip
        self._waiting: list[ReasonerSession] = []  # preempted sessions, oldest first
        self._started = 0  # sessions started so far (their start order decides who is preempted)
        self.preemptions = 0  # sessions preempted so far (their K/V recomputed later)

    @classmethod
    def from_pretrained(cls, root: str | Path, transformer: Any, tokenizer: Any, **options: Any) -> Reasoner:
        """Share `transformer` (already loaded); load the ViT from `<root>/vision_encoder` when present.
        `options`: the constructor's keyword options (max_model_len, max_num_seqs, kv_cache_tokens, ...)."""
        root = Path(root)
        cfg = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
        vision = None
        if (root / "vision_encoder").is_dir():
            vision = VisionEncoder.from_pretrained(
                root / "vision_encoder", dtype=transformer.dtype, device=transformer.device,
                vision_config=cfg.get("vision_config"),
            )  # fmt: skip
        eos = cfg.get("eos_token_id", [])
        return cls(
            transformer, tokenizer, vision,
            image_token_id=cfg.get("image_token_id", tokenizer.convert_tokens_to_ids(IMAGE_PAD)),
            video_token_id=cfg.get("video_token_id"),
            eos_token_ids=eos if isinstance(eos, list) else [eos], **options,
        )  # fmt: skip

    # ------------------------------------------------------------------ prompt (CPU)
    def build_prompt(self, params: ChatParams) -> ChatPrompt:
        """Chat template + image / video placeholder expansion + tokenization; raises ParamError."""
        conversation, images, videos = [], [], []
        for msg in params.messages:
            if isinstance(msg.content, str):
                conversation.append({"role": msg.role, "content": msg.content})
                continue
            parts = []
            for part in msg.content:
                if part.type == "image":
                    images.append(part.image)
                    parts.append({"type": "image"})
                elif part.type == "video":
                    videos.append(part.video)
                    parts.append({"type": "video"})
                else:
                    parts.append({"type": "text", "text": part.text})
            conversation.append({"role": msg.role, "content": parts})
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        vision = video = None
        if (images or videos) and (self.vision is None or self.preprocess is None):
            raise ParamError(
                "messages", "this checkpoint has no vision_encoder/: image and video inputs are unsupported"
            )
        if images:
            vision = self.preprocess(images)
            counts = vision.tokens_per_image(self.vision.merge_size)
            pieces = text.split(IMAGE_PAD)
            if len(pieces) != len(counts) + 1:
                raise ParamError(
                    "messages", "the chat template did not render one image placeholder per image"
                )
            text = pieces[0] + "".join(
                IMAGE_PAD * n + rest for n, rest in zip(counts, pieces[1:], strict=True)
            )
        if videos:
            text, video = self._expand_videos(text, videos)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ChatPrompt(input_ids=list(ids), vision=vision, video=video)

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
        for x, inp, rest in zip(videos, inputs, pieces[1:], strict=True):
            per_patch = int(inp.grid_thw[0, 1:].prod()) // v.merge_size**2
            stamps = video_timestamps(x.indices, x.source_fps, v.temporal_patch_size)
            out += [f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD * per_patch}{VISION_END}" for t in stamps]
            out.append(rest)
        merged = VisionInputs(
            pixel_values=torch.cat([i.pixel_values for i in inputs]),
            grid_thw=torch.cat([i.grid_thw for i in inputs]),
        )
        return "".join(out), merged

    # ------------------------------------------------------------------ model
    @torch.inference_mode()
    def prefill(self, prompt: ChatPrompt) -> tuple[Tensor, PagedSequence, int]:
        """-> (final-normed hidden [N, d] of every prompt token, its filled paged sequence, next position).

        PoolExhausted (nothing kept) when the pool cannot hold the prompt and its first generated token."""
        model = self.transformer
        ids = torch.tensor(prompt.input_ids, dtype=torch.long, device=model.device)
        grids = [] if prompt.vision is None else prompt.vision.grid_thw.tolist()
        video_grids = [] if prompt.video is None else prompt.video.grid_thw.tolist()
        merge = self.vision.merge_size if self.vision is not None else 2
        positions, next_pos = chat_positions(
            prompt.input_ids, self.image_token_id, grids, merge,
            video_token_id=self.video_token_id, video_grids=video_grids,
        )  # fmt: skip
        embeds, deepstack, rows = None, (), None
        if prompt.vision is not None or prompt.video is not None:
            embeds, deepstack, rows = self._visual_embeddings(ids, prompt)
        batch = UndBatch(
            input_ids=ids, positions=positions.to(model.device), seq_lens=(ids.numel(),),
            inputs_embeds=embeds, deepstack=tuple(deepstack), visual_rows=rows,
        )  # fmt: skip
        seq = self.pool.sequence()
        seq.reserve(ids.numel() + 1)
        try:
            hidden = model.und_step(batch, [seq])
        except BaseException:
            seq.release()
            raise
        return hidden, seq, next_pos

    def _visual_embeddings(
        self, ids: Tensor, prompt: ChatPrompt
    ) -> tuple[Tensor, tuple[Tensor, ...], Tensor]:
        """(token embeddings with the ViT rows in, deepstack features [M, d] each, visual rows [M]); image and
        video rows in sequence order, as Qwen3-VL joins them."""
        assert self.vision is not None
        model = self.transformer
        embeds = model.embed_tokens(ids)
        is_img, is_vid = ids == self.image_token_id, ids == self.video_token_id
        rows = (is_img | is_vid).nonzero().squeeze(1)  # [M]
        deepstack: list[Tensor] = []
        for inputs, mask in ((prompt.vision, is_img), (prompt.video, is_vid)):
            if inputs is None:
                continue
            vis, ds = self.vision.encode(inputs)  # [m, d], each [m, d]
            embeds = embeds.index_copy(0, mask.nonzero().squeeze(1), vis.to(model.dtype))
            joint = mask[rows]  # [M] bool: which of the visual rows are this modality's
            if not deepstack:
                deepstack = [vis.new_zeros(rows.numel(), vis.shape[1]) for _ in ds]
            for acc, feat in zip(deepstack, ds, strict=True):
                acc[joint] = feat
        return embeds, tuple(deepstack), rows

    def kv_cache_usage(self) -> float:
        """Fraction of the pool's usable blocks held by chats (vLLM's kv_cache_usage_perc)."""
        usable = self.pool.num_blocks - 1
        return (usable - self.pool.num_free) / usable

    def decode(self, token: int, seq: PagedSequence, position: int) -> Tensor:
        """One decode step: token at `position` -> logits [vocab] of the next token."""
        return self.decode_many([(token, seq, position)])[0]

    def decode_many(self, steps: Sequence[tuple[int, PagedSequence, int]]) -> Tensor:
        """One batched decode step of several sequences: [(token, seq, position)] -> logits [B, vocab].
        Every sequence needs a free slot (prefill reserves the first; step_all reserves the others)."""
        for _, seq, _ in steps:
            seq.reserve(1)
        return self.decoder.step([t for t, _, _ in steps], [s for _, s, _ in steps], [p for _, _, p in steps])

    def step_all(self, sessions: Sequence[ReasonerSession]) -> list[ChatDelta]:
        """One step of every session: sample each (a preempted one first tries to resume), then one batched
        decode of the unfinished ones, preempting the newest when the pool runs out of blocks."""
        for s in [s for s in self._waiting if s in sessions]:
            if not s.resume():
                break  # oldest first: a later one must not take the blocks the older one waits for
            self._waiting.remove(s)
        ready = [s for s in sessions if not s.preempted]
        tokens = iter(sample_tokens([s._sampler for s in ready], torch.stack([s._logits for s in ready])))
        deltas, pending = [], []
        for s in sessions:
            if s.preempted:
                deltas.append(s.idle_delta())
                continue
            delta, decode = s.advance(next(tokens))
            deltas.append(delta)
            if decode is not None:
                pending.append((s, decode))
        pending = self._make_room(pending)
        if pending:
            logits = self.decode_many([decode for _, decode in pending])
            for (s, _), row in zip(pending, logits, strict=True):
                s.receive(row)
        return deltas

    def _make_room(self, pending: list) -> list:
        """Reserve each pending decode's slot; while the pool is short, preempt the newest pending session."""
        pending = sorted(pending, key=lambda p: p[0].started)  # oldest first keeps its blocks
        while pending:
            try:
                for _, (_, seq, _) in pending:
                    seq.reserve(1)
                return pending
            except PoolExhausted:
                victim, _ = pending.pop()
                victim.preempt()
                self.preemptions += 1
                self._waiting.append(victim)
        return pending

    def warm_up(self) -> None:
        """A short prompt's prefill and one decode step before serving, then the decode step's CUDA graph of
        every batch bucket: on a GPU the compiles and captures happen here, not in the first users' chats."""
        from worldserve.params import ChatMessage

        params = ChatParams(
            messages=(ChatMessage(role="user", content="Hello"),), max_tokens=1, temperature=0.0
        )
        prompt = self.build_prompt(params)
        _, seq, position = self.prefill(prompt)
        self.decode(prompt.input_ids[-1], seq, position)  # whatever the model would sample
        seq.release()
        self.decoder.capture_all()

    def start(self, params: ChatParams) -> ReasonerSession:
        """Validate, build the prompt, prefill; the session's step() yields the completion."""
        params.validate()
        prompt = self.build_prompt(params)
        n = len(prompt.input_ids)
        room = self.max_model_len - n
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            asked = n + (params.max_tokens or 1)
            raise ParamError(
                "max_tokens" if params.max_tokens is not None and room >= 1 else "messages",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{asked} tokens ({n} in the messages, {asked - n} in the completion). Please reduce the length "
                "of the messages or completion.",
            )
        budget = params.max_tokens if params.max_tokens is not None else room
        if self._waiting:
            raise ChatBackpressure("preempted chats wait for K/V blocks")
        try:
            hidden, seq, next_pos = self.prefill(prompt)
        except PoolExhausted as exc:
            raise ChatBackpressure(str(exc)) from exc
        logits = self.transformer.compute_logits(hidden[-1:])[0]
        sampler = TokenSampler(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),
            seed=params.seed,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            prompt_ids=tuple(prompt.input_ids),
        )
        self._started += 1
        return ReasonerSession(self, sampler, seq, logits, next_pos, prompt=prompt, started=self._started,
                               max_tokens=budget, stop=params.stop,
                               top_logprobs=params.top_logprobs if params.logprobs else None)  # fmt: skip


class ReasonerSession:
    """One chat completion in progress: pending logits, its paged K/V sequence and the text emitted so far."""

    def __init__(
        self, reasoner: Reasoner, sampler: TokenSampler, seq: PagedSequence | None, logits: Tensor,
        position: int, *, prompt: ChatPrompt, started: int, max_tokens: int, stop: Sequence[str],
        top_logprobs: int | None = None,
    ) -> None:  # fmt: skip
        self._r, self._sampler, self._seq = reasoner, sampler, seq
        self._logits: Tensor | None = logits
        self._position = position
        self._prompt = prompt
        self.started = started
        self.prompt_tokens = len(prompt.input_ids)
        self.max_tokens = max_tokens
        self.stop = tuple(stop)
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.token_ids: list[int] = []
        self._emitted = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def step(self) -> ChatDelta:
        """Sample one token, return the new text (possibly empty) and the finish reason once done."""
        return self._r.step_all([self])[0]

    @property
    def preempted(self) -> bool:
        """Its K/V blocks were taken back; it waits to be resumed (Reasoner.step_all)."""
        return self._seq is None and self.finish_reason is None

    def preempt(self) -> None:
        """Free its K/V blocks; the token `advance` just sampled stays in token_ids and is recomputed."""
        self._seq.release()
        self._seq, self._logits = None, None

    def resume(self) -> bool:
        """Prefill the prompt + the tokens produced so far again; False (nothing taken) while the pool is short.

        The last produced token's logits come out of this prefill, as its decode step would have given them."""
        prompt = ChatPrompt(
            input_ids=self._prompt.input_ids + self.token_ids,
            vision=self._prompt.vision,
            video=self._prompt.video,
        )
        try:
            hidden, seq, position = self._r.prefill(prompt)
        except PoolExhausted:
            return False
        self._seq, self._position = seq, position
        self._logits = self._r.transformer.compute_logits(hidden[-1:])[0]
        return True

    def idle_delta(self) -> ChatDelta:
        """The step outcome of a preempted session: no text yet."""
        return ChatDelta(text="", finish_reason=None, completion_tokens=self.completion_tokens)

    def close(self) -> None:
        """Give the K/V blocks back and leave the Reasoner's wait list (cancelled, failed or finished)."""
        if self._seq is not None:
            self._seq.release()
            self._seq = None
        if self in self._r._waiting:
            self._r._waiting.remove(self)

    def receive(self, logits: Tensor) -> None:
        """The next token's logits, after the decode of the token `advance` returned."""
        self._logits = logits
        self._position += 1

    def advance(self, token: int) -> tuple[ChatDelta, tuple[int, Any, int] | None]:
        """Take `token`, sampled from the pending logits by this session's sampler (step_all samples every
        session at once), and update the text: (delta, the decode step to run next as (token, paged sequence,
        position) for Reasoner.decode_many, or None once finished). The caller runs it and hands its logits
        to `receive`."""
        if self.finish_reason is not None or self._logits is None:
            raise RuntimeError("the session is finished")
        finished = token in self._r.stop_token_ids
        logprobs = () if finished or self.top_logprobs is None else (self._logprob(self._logits, token),)
        if not finished:
            self.token_ids.append(token)
        text = self._r.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        found = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        cut, matched = min(found) if found else (-1, None)
        if finished or cut >= 0:
            self.finish_reason = "stop"
            # vLLM's stop_reason: the matched stop string, None for an end-of-sequence token
            self.stop_reason = None if finished and cut < 0 else matched
            text = text if cut < 0 else text[:cut]
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is None:
            held = max((len(s) - 1 for s in self.stop), default=0)
            end = len(text) - held
            while end > self._emitted and text[end - 1] == "\ufffd":
                end -= 1  # an incomplete UTF-8 sequence: wait for its next byte
            self._logits = None  # until receive()
            decode = (token, self._seq, self._position)
        else:
            end = len(text)
            self._logits = None
            self.close()
            decode = None
        delta = text[self._emitted : max(end, self._emitted)]
        self._emitted = max(end, self._emitted)
        out = ChatDelta(
            text=delta,
            finish_reason=self.finish_reason,
            completion_tokens=self.completion_tokens,
            logprobs=logprobs,
            stop_reason=self.stop_reason,
        )
        return out, decode

    def _logprob(self, logits: Tensor, token: int) -> TokenLogprob:
        """The token's log-probability under the raw logits, and the top alternatives."""
        lp = torch.log_softmax(logits.detach().float(), dim=-1)
        tok = self._r.tokenizer
        top = ()
        if self.top_logprobs:
            vals, ids = torch.topk(lp, self.top_logprobs)
            top = tuple((tok.decode([int(i)]), float(v)) for v, i in zip(vals, ids, strict=True))
        return TokenLogprob(token=tok.decode([token]), logprob=float(lp[token]), top=top)
