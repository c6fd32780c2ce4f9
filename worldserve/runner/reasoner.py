"""Reasoner: Qwen3-VL chat completions on the und tower of the loaded Cosmos3 transformer (no second copy).

start(ChatParams) -> ReasonerSession (start_many: several at once, their prefills in one pass; admission,
budgets and sessions in chat_admission.py; step_all, preemption and resumes in chat_stepping.py):
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
Token budget (step_budget.py, vLLM's --max-num-batched-tokens): one budget per iteration of the chat worker
  (an admission pass, then a step), shared in vLLM's order: the decodes (a token each), the prefilling
  sessions' next chunks (oldest first), the resumes of preempted sessions, then the new chats (a pass takes
  what the next step's running sessions leave; the last new prompt is chunked to fit), so the running chats'
  gap is one budget's.
Finish: "stop" on <|im_end|> / <|endoftext|> / the config eos or a `stop` string, "length" at max_tokens or
the context limit. Callers serialize model access (the chat worker holds the model lock around start/step),
except where `concurrent_with_video` says the work may run beside video steps on the GPU (chat_share.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from worldserve.chat_params import ChatParams
from worldserve.config import DEFAULT_MAX_NUM_SEQS
from worldserve.media.processor_cache import DEFAULT_PROCESSOR_CACHE_GB, ProcessorCache
from worldserve.models.cosmos3.vision import QWEN3VL_MAX_PIXELS, QWEN3VL_MIN_PIXELS, VisionEncoder
from worldserve.models.layers.compile_limits import limits_in_this_thread
from worldserve.models.layers.paged_kv import DEFAULT_BLOCK_SIZE, PagedSequence
from worldserve.runner.chat_admission import ChatAdmission
from worldserve.runner.chat_logprobs import TokenTexts
from worldserve.runner.chat_prompt import IMAGE_PAD, VIDEO_PAD, ChatPrompt, ChatPromptBuilder
from worldserve.runner.chat_share import DEFAULT_CHAT_SM_MARGIN, ChatGpuShare
from worldserve.runner.chat_stepping import ChatStepping
from worldserve.runner.reasoner_session import ReasonerSession
from worldserve.runner.step_budget import StepBudget
from worldserve.runner.und_decoder import UndDecoder
from worldserve.runner.und_prefill import UndPrefill
from worldserve.sampling.chat_defaults import ChatDefaults
from worldserve.sampling.token_grammar import GrammarCompiler
from worldserve.weights.checkpoint import read_json_object
from worldserve.weights.load_lock import model_loads

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM's --max-num-batched-tokens (its default for online serving on large GPUs): the tokens one iteration (an
admission pass and a step) computes at most, decodes, chunks, resumes and new prompts together (step_budget.py);
without chunked prefill an admission prefills whole prompts up to it (a longer one goes alone)."""


def default_kv_cache_tokens(max_model_len: int, *, layerwise_offload: bool = False) -> int:
    """Two full-length chats (one under layerwise offload, whose GPUs are small): 9.7 / 4.8 GB on Nano at the
    default max_model_len 32768 (144 KiB a token)."""
    return max_model_len if layerwise_offload else 2 * max_model_len


def check_context(root: str | Path, max_model_len: int, cfg: dict | None = None) -> None:
    """vLLM's check of the context against the checkpoint's positions, in its words: ValueError when
    `max_model_len` is above the max_position_embeddings of `root`/config.json (`cfg`: that file, read
    already; serve runs the check before the model loads)."""
    path = Path(root) / "config.json"
    if cfg is None:
        cfg = read_json_object(path) if path.is_file() else {}
    limit = (cfg.get("text_config") or {}).get("max_position_embeddings")
    if isinstance(limit, int) and max_model_len > limit:
        raise ValueError(f"--max-model-len {max_model_len} is greater than the derived max_model_len {limit} "
                         f"(max_position_embeddings in {path})")  # fmt: skip


def _stop_token_ids(
    tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], sampling_defaults: ChatDefaults
) -> tuple[frozenset[int], frozenset[int]]:
    """(the ids that end a chat, those of them a finished chat reports as its stop_reason): <|im_end|>,
    <|endoftext|>, the checkpoint config's eos and the generation config's (those within the vocabulary)."""
    stops = {tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS} | set(eos_token_ids)
    # (the generation config's, as vLLM stops on them)
    stops |= {i for i in sampling_defaults.eos_token_ids if i < vocab_size}
    stop_token_ids = frozenset(i for i in stops if i is not None and i != tokenizer.unk_token_id)
    # (vLLM stops on the tokenizer's eos with stop_reason None, and adds the generation config's other
    # end-of-sequence ids to the request's stop_token_ids: ended by one of those, stop_reason is its id)
    return stop_token_ids, stop_token_ids - {tokenizer.eos_token_id}


class Reasoner(ChatAdmission, ChatStepping):
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
        processor_cache_bytes: int = int(DEFAULT_PROCESSOR_CACHE_GB * 2**30),
        sampling_defaults: ChatDefaults = ChatDefaults(),
        chat_template: str | None = None,
    ) -> None:
        """The chat view of `transformer`'s und tower (shared, not copied) with `tokenizer` and the ViT `vision`
        (None: text only); the options are serve's flags of the same names. ValueError when `kv_cache_tokens`
        cannot hold one `max_model_len` chat."""
        self.transformer = transformer
        self.sampling_defaults = sampling_defaults  # what requests' omitted sampling fields take (API layer)
        self.share = ChatGpuShare(transformer, sm_margin=chat_sm_margin)  # chats beside video (chat_share.py)
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # logprobs' token texts, decoded once an id
        self.vision = vision
        self.image_token_id = image_token_id
        self.video_token_id = (
            video_token_id if video_token_id is not None else tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        )
        self.stop_token_ids, self.reported_stop_ids = _stop_token_ids(
            tokenizer, transformer.config.vocab_size, eos_token_ids, sampling_defaults
        )
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill  # long prompts prefill chunk by chunk (step_all)
        self.budget = StepBudget(max_num_batched_tokens, enable_chunked_prefill)  # one an iteration
        self.grammars = GrammarCompiler(tokenizer, transformer.config.vocab_size, sorted(self.stop_token_ids))
        self.media_cache = ProcessorCache(processor_cache_bytes)  # decoded / resized chat media, by content
        self.prompts = self._prompt_builder(min_pixels, max_pixels, chat_template)
        self.pool, self.decoder, self.prefiller = self._und_steps(
            kv_cache_tokens, kv_block_size, max_num_seqs, enforce_eager, enable_prefix_caching
        )
        self._waiting: list[ReasonerSession] = []  # preempted sessions, oldest first
        self._started = 0  # sessions started so far (their start order decides who is preempted)
        self.preemptions = 0  # sessions preempted so far (their K/V recomputed later)
        self._deferred: dict[int, tuple[ChatParams, ChatPrompt]] = {}  # chats refused for lack of room, by id
        # sessions started and not closed: each may need a block for its next token
        self._open: list[ReasonerSession] = []

    def _prompt_builder(
        self, min_pixels: int, max_pixels: int, chat_template: str | None
    ) -> ChatPromptBuilder:
        """The chat prompts' builder: the ViT's preprocessing (images resized within `min_pixels` and
        `max_pixels`, through the media cache) when there is a ViT, `chat_template` (None: the tokenizer's)."""
        vision = self.vision
        preprocess = (
            vision.preprocessor(min_pixels=min_pixels, max_pixels=max_pixels, cache=self.media_cache)
            if vision is not None else None
        )  # fmt: skip
        return ChatPromptBuilder(
            self.tokenizer, vision, preprocess, image_token_id=self.image_token_id,
            video_token_id=self.video_token_id, media_cache=self.media_cache, chat_template=chat_template,
        )  # fmt: skip

    def _und_steps(
        self, kv_cache_tokens: int | None, kv_block_size: int, max_num_seqs: int, enforce_eager: bool,
        enable_prefix_caching: bool,
    ) -> tuple[Any, UndDecoder, UndPrefill]:  # fmt: skip
        """(the paged K/V pool, the decode step, the prefill) over the und tower: a pool of `kv_cache_tokens`
        (None: default_kv_cache_tokens), ValueError when it cannot hold one max_model_len chat; on a GPU
        unless --enforce-eager, the ViT's math compiled too."""
        transformer, vision, max_model_len = self.transformer, self.vision, self.max_model_len
        if kv_cache_tokens is None:
            kv_cache_tokens = default_kv_cache_tokens(
                max_model_len, layerwise_offload=transformer.und_blocks is not None
            )
        if kv_cache_tokens < max_model_len:
            raise ValueError(
                f"the Reasoner's K/V cache holds {kv_cache_tokens} tokens, fewer than --max-model-len "
                f"{max_model_len}: raise --kv-cache-memory-bytes or lower --max-model-len"
            )
        pool = transformer.new_paged_pool(kv_cache_tokens, block_size=kv_block_size)
        decoder = UndDecoder(
            transformer, pool, max_batch=max_num_seqs, max_model_len=max_model_len,
            enforce_eager=enforce_eager,
        )  # fmt: skip
        if vision is not None and decoder.use_graphs:  # on a GPU unless --enforce-eager
            vision.set_attention_backend(None)
            vision.tower.compile_math()
        prefiller = UndPrefill(
            transformer, pool, vision, image_token_id=self.image_token_id, video_token_id=self.video_token_id,
            caching=enable_prefix_caching, math=decoder.math, graphed=decoder.use_graphs,
        )  # fmt: skip
        return pool, decoder, prefiller

    @classmethod
    @model_loads("Reasoner.from_pretrained")
    def from_pretrained(cls, root: str | Path, transformer: Any, tokenizer: Any, **options: Any) -> Reasoner:
        """Share `transformer` (already loaded); load the ViT from `<root>/vision_encoder` when present.
        `options`: the constructor's keyword options (max_model_len, max_num_seqs, kv_cache_tokens, ...)."""
        root = Path(root)
        cfg = read_json_object(root / "config.json") if (root / "config.json").is_file() else {}
        check_context(root, options.get("max_model_len", 0), cfg)
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
    def prepare_thread(self) -> None:
        """As VideoPipeline.prepare_thread (compile_limits.limits_in_this_thread)."""
        limits_in_this_thread()

    def build_prompt(self, params: ChatParams) -> ChatPrompt:
        """Chat template + image / video placeholder expansion + tokenization + positions; raises ParamError."""
        return self.prompts.build(params)

    # ------------------------------------------------------------------ model
    def prefill(
        self,
        prompt: ChatPrompt,
        generated: Sequence[int] = (),
        *,
        whole: bool = True,
        budget: int | None = None,
        resumed: bool = False,
    ) -> tuple[Tensor, PagedSequence, int]:
        """-> (final-normed hidden [N, d] of every token, its filled paged sequence, next position); with
        `whole` False, of the tokens past its prefix-cache hit only.

        `generated`: tokens the chat already produced (a preempted chat's resume), prefilled after the prompt
        at the positions their decode steps had (`resumed`: a preempted chat's resume, also one with none yet).
        PoolExhausted, before any work (the ViT included) and with nothing kept, when the pool cannot hold them
        all and the next token."""
        return self.prefill_batch([(prompt, generated)], [whole], budget, [resumed])[0]

    def prefill_batch(
        self, items: Sequence[tuple[ChatPrompt, Sequence[int]]], whole: Sequence[bool] = (),
        budget: int | None = None, resumed: Sequence[bool] = (),
    ) -> list[tuple[Tensor, PagedSequence, int]]:  # fmt: skip
        """prefill() of several (prompt, generated) items in ONE und pass (und_prefill.py; the hidden states of
        the tokens computed: past a prefix-cache hit, unless `whole[i]`; at most `budget` tokens)."""
        return self.prefiller(items, whole, budget, resumed)

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

    @property
    def _live(self) -> int:
        """Sessions started and not closed."""
        return len(self._open)

    def forget(self, session: ReasonerSession) -> None:
        """A session closed (once): drop it from the wait list and the open sessions."""
        if session in self._open:
            self._open.remove(session)
        self.share.chats_live(len(self._open))
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
        if (graphs := self.prefiller.graphs) is not None and graphs.buckets[-1] < self.max_model_len - 1:
            # a pass past the largest bucket runs the compiled math without graphs: its (dynamic) graph now, which
            # the decode step compiled only with a batch bucket past 1 (--max-num-seqs > 1)
            long = self.build_prompt(ChatParams(prompt_ids=(prompt.input_ids[0],) * (graphs.buckets[-1] + 1)))
            self.prefill(long)[1].release()
        if self.vision is not None and self.decoder.use_graphs:  # the ViT's compiled math (one dynamic graph)
            self.vision.encode(self.prompts.preprocess([np.zeros((64, 64, 3), dtype=np.uint8)]))
        _ = self.grammars.tokenizer  # structured outputs' view of the vocabulary (about a second on Qwen's)
        if self.decoder.use_graphs:  # eager decode steps (--enforce-eager) keep taking turns with video
            self.share.mark_ready()
