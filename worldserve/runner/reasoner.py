"""Reasoner: Qwen3-VL chat completions on the und tower of the loaded Cosmos3 transformer (no second copy).

start(ChatParams) -> ReasonerSession (start_many: several at once, their prefills in one pass):
  prompt:  runner/chat_prompt.py (chat template, Qwen3-VL image / video placeholders, positions; or a raw
           prompt's token ids, ChatParams.prompt_ids: /v1/completions).
  prefill: one und_step over the whole prompt with embed_tokens rows replaced by the ViT embeddings at the
           image-pad and video-pad rows, Qwen3-VL get_rope_index positions, and deepstack features (image and
           video rows in sequence order) added after the first len(deepstack) und layers; the K/V go into the
           session's sequence of the shared paged K/V pool (models/layers/paged_kv.py); with prefix caching,
           only past the longest cached prefix (und_prefill.py, prefix_hashes.py).
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
the context limit. Callers serialize model access (the chat worker holds the model lock around start/step),
except where `concurrent_with_video` says the work may run beside video steps on the GPU (chat_share.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from worldserve.chat_params import ChatParams
from worldserve.engine.outputs import ChatBackpressure, ChatDelta
from worldserve.models.cosmos3.vision import QWEN3VL_MAX_PIXELS, QWEN3VL_MIN_PIXELS, VisionEncoder
from worldserve.models.layers.paged_kv import DEFAULT_BLOCK_SIZE, PagedSequence, PoolExhausted
from worldserve.runner.chat_prompt import (
    IMAGE_PAD,
    VIDEO_PAD,
    ChatPrompt,
    ChatPromptBuilder,
    completion_budget,
)
from worldserve.runner.chat_share import DEFAULT_CHAT_SM_MARGIN, ChatGpuShare
from worldserve.runner.reasoner_session import ReasonerSession, prompt_logprobs
from worldserve.runner.und_decoder import UndDecoder
from worldserve.runner.und_prefill import UndPrefill
from worldserve.sampling.token_grammar import GrammarCompiler, constrain_rows
from worldserve.sampling.tokens import TokenSampler, sample_tokens

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM's --max-num-batched-tokens (its default for online serving on large GPUs): the tokens one step
computes at most. An admission prefills whole prompts up to it (a longer one goes alone); with chunked prefill
a longer prompt is computed in chunks of it, one a step, less a token for each decoding chat."""
DEFERRED_PROMPTS = 256
"""Built prompts kept for chats refused for lack of room (their retry skips the preprocessing)."""


def default_kv_cache_tokens(max_model_len: int, *, layerwise_offload: bool = False) -> int:
    """Two full-length chats (one under layerwise offload, whose GPUs are small): 9.7 / 4.8 GB on Nano at the
    default max_model_len 32768 (144 KiB a token)."""
    return max_model_len if layerwise_offload else 2 * max_model_len


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
        chat_sm_margin: int = DEFAULT_CHAT_SM_MARGIN,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.transformer = transformer
        self.share = ChatGpuShare(transformer, sm_margin=chat_sm_margin)  # chats beside video (chat_share.py)
        self.tokenizer = tokenizer
        self.vision = vision
        self.image_token_id = image_token_id
        self.video_token_id = (
            video_token_id if video_token_id is not None else tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        )
        stops = {tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS} | set(eos_token_ids)
        self.stop_token_ids = frozenset(i for i in stops if i is not None and i != tokenizer.unk_token_id)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill  # long prompts prefill chunk by chunk (step_all)
        self.grammars = GrammarCompiler(tokenizer, transformer.config.vocab_size, self.stop_token_ids)
        self.prompts = ChatPromptBuilder(
            tokenizer, vision, vision.preprocessor(min_pixels=min_pixels, max_pixels=max_pixels) if vision else None,
            image_token_id=image_token_id, video_token_id=self.video_token_id,
        )  # fmt: skip
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
        self.prefiller = UndPrefill(
            transformer, self.pool, vision, image_token_id=image_token_id, video_token_id=self.video_token_id,
            caching=enable_prefix_caching, math=self.decoder.math, graphed=self.decoder.use_graphs,
        )  # fmt: skip
        self._waiting: list[ReasonerSession] = []  # preempted sessions, oldest first
        self._started = 0  # sessions started so far (their start order decides who is preempted)
        self.preemptions = 0  # sessions preempted so far (their K/V recomputed later)
        self._deferred: dict[int, tuple[ChatParams, ChatPrompt]] = {}  # chats refused for lack of room, by id
        self._live = 0  # sessions started and not closed: each may need a block for its next token

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
        """Chat template + image / video placeholder expansion + tokenization + positions; raises ParamError."""
        return self.prompts.build(params)

    # ------------------------------------------------------------------ model
    def prefill(
        self, prompt: ChatPrompt, generated: Sequence[int] = (), *, whole: bool = True
    ) -> tuple[Tensor, PagedSequence, int]:
        """-> (final-normed hidden [N, d] of every token, its filled paged sequence, next position); with
        `whole` False, of the tokens past its prefix-cache hit only.

        `generated`: tokens the chat already produced (a preempted chat's resume), prefilled after the prompt
        at the positions their decode steps had. PoolExhausted, before any work (the ViT included) and with
        nothing kept, when the pool cannot hold them all and the next token."""
        return self.prefill_batch([(prompt, generated)], [whole])[0]

    def prefill_batch(
        self, items: Sequence[tuple[ChatPrompt, Sequence[int]]], whole: Sequence[bool] = (),
        budget: int | None = None,
    ) -> list[tuple[Tensor, PagedSequence, int]]:  # fmt: skip
        """prefill() of several (prompt, generated) items in ONE und pass (und_prefill.py; the hidden states of
        the tokens computed: past a prefix-cache hit, unless `whole[i]`; at most `budget` tokens)."""
        return self.prefiller(items, whole, budget)

    @property
    def concurrent_with_video(self) -> bool:
        """Whether the chat worker may call start_many / step_all without the model lock (chat_share.py)."""
        return self.share.concurrent

    def kv_cache_usage(self) -> float:
        """Fraction of the pool's usable blocks held by chats (vLLM's kv_cache_usage_perc)."""
        usable = self.pool.num_blocks - 1
        return (usable - self.pool.num_free) / usable

    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache so far, and of them the tokens found (vLLM's metrics)."""
        return self.pool.prefix_queries, self.pool.prefix_hits

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
        with self.share.context():
            return self._step_all(sessions)

    def _step_all(self, sessions: Sequence[ReasonerSession]) -> list[ChatDelta]:
        self._resume_waiting(sessions)
        if filling := [s for s in sessions if s.prefilling]:  # chunked prefill: the oldest one's next chunk
            decoding = sum(not (s.preempted or s.prefilling) for s in sessions)
            min(filling, key=lambda s: s.started).prefill_next(max(1, self.max_num_batched_tokens - decoding))
        ready = [s for s in sessions if not (s.preempted or s.prefilling)]
        if ready:
            drawn = sample_tokens([s.sampler for s in ready], torch.stack([s.pending_logits for s in ready]))
            tokens = dict(zip(map(id, ready), drawn, strict=True))
        deltas, pending = [], []
        for s in sessions:
            if s.preempted or s.prefilling:
                deltas.append(s.idle_delta())
                continue
            delta, decode = s.advance(tokens[id(s)])
            deltas.append(delta)
            if decode is not None:
                pending.append((s, decode))
        pending = self._make_room(pending)
        if pending:
            logits = self.decode_many([decode for _, decode in pending])
            # the grammars' masks, computed on the host while the GPU decodes, applied to the batch at once
            logits = constrain_rows(logits, [s.grammar for s, _ in pending])
            for (s, _), row in zip(pending, logits, strict=True):
                s.receive(row)
        return deltas

    def _resume_waiting(self, sessions: Sequence[ReasonerSession]) -> None:
        """Resume preempted sessions, oldest first, while the pool has room for one plus a block for each
        running session (so that a resumed session is not preempted again by this very step)."""
        running = sum(not s.preempted for s in sessions)
        for s in [s for s in self._waiting if s in sessions]:
            need = self.pool.blocks_for(s.resume_tokens + 1) + running
            if self.pool.num_free < need or not s.resume():
                return  # a later one must not take the blocks the older one waits for
            self._waiting.remove(s)
            running += 1

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
                self._waiting.sort(key=lambda w: w.started)
        return pending

    def forget(self, session: ReasonerSession) -> None:
        """A session closed (once): drop it from the wait list and the live count."""
        self._live -= 1
        self.share.chats_live(self._live)
        if session in self._waiting:
            self._waiting.remove(session)

    def warm_up(self) -> None:
        """A short prompt's prefill and one decode step before serving, then the decode step's CUDA graph of
        every batch bucket and the prefill's of every token bucket: on a GPU the compiles and captures happen
        here, not in the first users' chats."""
        from worldserve.chat_params import ChatMessage

        params = ChatParams(
            messages=(ChatMessage(role="user", content="Hello"),), max_tokens=1, temperature=0.0
        )
        prompt = self.build_prompt(params)
        _, seq, position = self.prefill(prompt)
        self.decode(prompt.input_ids[-1], seq, position)  # whatever the model would sample
        seq.release()
        self.decoder.capture_all()
        self.prefiller.capture_all()
        _ = self.grammars.tokenizer  # structured outputs' view of the vocabulary (about a second on Qwen's)
        if self.decoder.use_graphs:  # eager decode steps (--enforce-eager) keep taking turns with video
            self.share.mark_ready()

    def start(self, params: ChatParams) -> ReasonerSession:
        """Validate, build the prompt, prefill (all of it: a chunked one to its end); the session's step()
        yields the completion."""
        (result,) = self.start_many([params])
        if isinstance(result, Exception):
            raise result
        while result.prefilling:
            result.prefill_next(self.max_num_batched_tokens)
        return result

    def start_many(self, batch: Sequence[ChatParams]) -> list[ReasonerSession | Exception]:
        """start() of several chats, their prefills in one und pass (up to max_num_batched_tokens tokens; with
        chunked prefill a longer prompt's first chunk, its session `prefilling` until step_all ends it). Per
        chat: its session, or the exception it raised (ParamError for a bad request; ChatBackpressure when
        the pool has no room for it now, leaving a block for each running chat's next token, or the pass is
        full: then every later one is refused too, which keeps the chats in order). Chats with the very same
        messages (the n choices of one request) share one prompt, one prefill and its full K/V blocks."""
        self.share.chats_live(self._live + len(batch))  # the margin up before the prefill, not after it
        try:
            with self.share.context():
                return self._start_many(batch)
        finally:
            self.share.chats_live(self._live)

    def _start_many(self, batch: Sequence[ChatParams]) -> list[ReasonerSession | Exception]:
        out: list[ReasonerSession | Exception | None] = []
        ready: list[tuple[int, ChatParams, ChatPrompt, int]] = []
        free = 0 if self._waiting else self.pool.num_free - self._live
        tokens = 0
        built: dict[int, ChatPrompt] = {}  # prompt_key -> its prompt (the batch holds the params alive)
        for params in batch:
            key = params.prompt_key
            try:
                prompt, budget = self._plan(params, built.get(key))
                built[key] = prompt
            except Exception as exc:  # ParamError: a bad request; anything else fails this chat alone
                out.append(exc)
                continue
            n = len(prompt.input_ids)
            need = self.pool.blocks_for(n + 1)
            if need > free or (ready and tokens + n > self.max_num_batched_tokens):
                free = 0  # the later chats wait too, in order
                self._remember(params, prompt)  # the retry reuses it: no new preprocessing
                out.append(ChatBackpressure(f"{need} K/V blocks wanted, {self.pool.num_free} free"))
                continue
            free -= need
            tokens += n
            ready.append((len(out), params, prompt, budget))
            out.append(None)
        leaders: dict[int, tuple] = {}  # id(prompt) -> the first ready chat with that prompt
        for r in ready:
            leaders.setdefault(id(r[2]), r)
        prefilled = {id(row[2]): row[4] for row in self._prefill_each(list(leaders.values()))}
        for i, params, prompt, budget in ready:
            out[i] = self._start_one(i, params, prompt, budget, prefilled, leaders[id(prompt)][0] == i)
        return out

    def _start_one(self, i: int, params: ChatParams, prompt: ChatPrompt, budget: int, prefilled: dict,
                   leader: bool) -> ReasonerSession | Exception:  # fmt: skip
        """The session of ready chat i from its prompt's prefill (a later choice of the same messages forks
        the leader's K/V), or the exception that fails this chat alone, its blocks given back."""
        done = prefilled[id(prompt)]
        if isinstance(done, Exception):
            return done
        try:
            seq = done[1] if leader else self.prefiller.fork(done[1], prompt, params)
        except PoolExhausted as exc:
            return ChatBackpressure(str(exc))
        except Exception as exc:
            return exc
        try:
            return self._session(params, prompt, budget, done[0], seq, done[2])
        except Exception as exc:  # e.g. out of memory for its logits
            seq.release()
            if leader:
                prefilled[id(prompt)] = exc  # its other choices have nothing to fork now
            return exc

    def _prefill_each(self, ready: list) -> list:
        """prefill_batch over the ready chats; when the pass fails (e.g. out of memory), each chat once more
        on its own, so that one chat's failure is not every chat's. [(*item, result or exception)]."""
        items = [(prompt, ()) for _, _, prompt, _ in ready]
        whole = [params.prompt_logprobs is not None for _, params, _, _ in ready]  # every prompt row's logits
        budget = self.max_num_batched_tokens if self.chunked_prefill and not any(whole) else None
        try:
            done = self.prefill_batch(items, whole, budget)
            return [(*r, d) for r, d in zip(ready, done, strict=True)]
        except Exception as exc:
            if len(ready) == 1:
                return [(*ready[0], exc)]
        return [row for r in ready for row in self._prefill_each([r])]

    def _remember(self, params: ChatParams, prompt: ChatPrompt) -> None:
        """Keep the prompt of a chat refused for lack of room (the most recent DEFERRED_PROMPTS of them)."""
        self._deferred[id(params)] = (params, prompt)
        while len(self._deferred) > DEFERRED_PROMPTS:
            self._deferred.pop(next(iter(self._deferred)))

    def _plan(self, params: ChatParams, prompt: ChatPrompt | None = None) -> tuple[ChatPrompt, int]:
        """Validate, build the prompt (or take `prompt`, built for the same messages, or the one of its last
        refused start), check the context: (prompt, completion token budget). ParamError for a bad request."""
        params.validate()
        self.prompts.check_ids(list(params.stop_token_ids), "stop_token_ids")
        self.prompts.check_ids(list(params.allowed_token_ids or ()), "allowed_token_ids")
        self.prompts.check_ids([token for token, _ in params.logit_bias], "logit_bias")
        deferred = self._deferred.pop(id(params), None)
        if prompt is None and params.prebuilt is not None:
            prompt = params.prebuilt
        if prompt is None:
            prompt = (
                deferred[1] if deferred is not None and deferred[0] is params else self.build_prompt(params)
            )
        if params.truncate_prompt_tokens is not None:
            prompt = self.prompts.truncated(prompt, params.truncate_prompt_tokens, self.max_model_len)
        return prompt, completion_budget(params, len(prompt.input_ids), self.max_model_len)

    def _session(
        self,
        params: ChatParams,
        prompt: ChatPrompt,
        budget: int,
        hidden: Tensor,
        seq: PagedSequence,
        pos: int,
    ) -> ReasonerSession:
        complete = seq.length == len(prompt.input_ids)  # else chunked: step_all computes the rest
        logits = self.transformer.compute_logits(hidden[-1:])[0] if complete else None
        sampler = TokenSampler.of(params, prompt.input_ids, self.prompts.bad_word_ids(params.bad_words))
        grammar = (
            None
            if params.structured is None
            else self.grammars.grammar(params.structured, params.think_first)
        )
        session = ReasonerSession(self, sampler, seq, logits, pos, prompt=prompt, started=self._started + 1,
                                  max_tokens=budget, stop=params.stop, ends=(params.ignore_eos, params.min_tokens,
                                  params.stop_token_ids, params.include_stop_str_in_output),
                                  top_logprobs=params.top_logprobs if params.logprobs else None,
                                  grammar=grammar, skip_special_tokens=params.skip_special_tokens)  # fmt: skip
        session.cached_tokens = seq.length - hidden.shape[0]  # (hidden: the rows computed)
        session.prefill_left = len(prompt.input_ids) - seq.length
        session.defer_stops_past_thoughts(params.stops_after_thoughts)
        if params.prompt_logprobs is not None:
            session.prompt_logprobs = prompt_logprobs(
                self.transformer, self.tokenizer, prompt.input_ids, hidden, params.prompt_logprobs
            )
        self._started += 1
        self._live += 1  # counted once the session exists: its close() takes it back (forget)
        return session
