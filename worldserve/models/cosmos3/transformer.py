"""Cosmos3Transformer: our inference-first Mixture-of-Transformers (und tower + gen tower) for Cosmos3.

Data flow of a video request (cosmos3-model.md §5.6):
  prefill_und(prompts)      -> one K/V cache per prompt (cond, uncond), computed once per request;
  forward(GenBatch)         -> per denoising step: patchify + proj_in (+ timestep embedding on noisy
                               tokens), sound via audio_proj_in + audio_modality_embed (+ temb), the gen
                               layers attending to [cached und K/V ; gen K/V], norm_moe_gen, proj_out /
                               audio_proj_out, unpatchify. Several requests and both CFG branches share it.
The und pathway also stands alone for the Reasoner: und_step(UndBatch, caches) prefills or decodes text
with its own K/V caches (contiguous ones, or sequences of a paged pool from `new_paged_pool`) and returns
final-normed hidden states; compute_logits applies lm_head (runner/und_decoder.py has the graphed decode). An
UndBatch may carry Qwen3-VL deepstack features, added at the visual rows after the first und layers.
Loading: build under `torch.device("meta")` with the target dtype, `to_empty(device=...)`, call
`load_checkpoint_tensor(key, tensor)` for every key of `loaded_shapes()` (q/k/v and gate/up are fused
here; the action heads are checked in the checkpoint, not loaded), then `post_load()`. time_embedder
stays float32 whatever the model dtype; do not call `.to(dtype)` on the model.
A LoRA adapter merges into the gen pathway's weights before any of the below (`merge_gen_lora`, runner/
lora_cache.py merge_lora; `merged_lora` keeps its unmerged und deltas), else runs unmerged (models/layers/lora.py).
FP8 mode (opt-in, after loading): `quantize_gen_fp8()` turns the gen tower's four GEMMs per layer into
row-wise scaled e4m3 GEMMs (models/layers/fp8.py) and frees their bf16 weights; the und tower, the norms
and the heads stay in the model dtype (und runs once per request).
Layerwise offload (`enable_layerwise_offload(device)`, on a model loaded on the CPU): the 36 und and 36 gen
blocks stay in pinned host memory and stream through two device slots per tower while they run
(models/layers/offload.py); everything else moves to the device.
Attention kernel: `set_attention_backend(name)` picks FlashAttention-3 or SDPA for every layer
(models/layers/flash_attention.py; auto = FA3 where it can run, and the gen tower then FA4's cluster
kernel where it can run: models/layers/fa4_cluster.py); `fp8_attention=True` sends the gen tower's
attention through FA3's e4m3 kernel (lossy, the fp8 mode). These after-load steps (compile, LoRA merge, fp8,
offload, attention backend) are the base class's, in transformer_setup.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn

from worldserve.models.cosmos3.batch import GenBatch, GenOutput, UndBatch, patchify, unpatchify
from worldserve.models.cosmos3.checkpoint_keys import loaded_checkpoint_shapes, transformer_checkpoint_shapes
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.gen_attention import GenAttentionBuffers
from worldserve.models.cosmos3.layer import MoTLayer, gen_layer_step, und_layer_step
from worldserve.models.cosmos3.timestep import TimestepEmbedder
from worldserve.models.cosmos3.transformer_setup import Cosmos3TransformerSetup
from worldserve.models.cosmos3.weights import checkpoint_target, copy_checkpoint_tensor
from worldserve.models.layers.attention import ContiguousKVCache, KVCache
from worldserve.models.layers.linear import Embedding, ReplicatedLinear
from worldserve.models.layers.lora import LoraWeights, MergedLora
from worldserve.models.layers.norm import RMSNorm
from worldserve.models.layers.offload import BlockStreamer
from worldserve.models.layers.paged_kv import DEFAULT_BLOCK_SIZE, PagedKVPool
from worldserve.models.layers.rope import MRotaryEmbedding
from worldserve.parallel import ulysses
from worldserve.parallel.groups import SINGLE, ParallelGroup


def _resident(blocks: BlockStreamer | None, i: int) -> AbstractContextManager[object]:
    """Layer i's block on the device for the with-body (a no-op without layerwise offload)."""
    return nullcontext() if blocks is None else blocks.use(i)


class LaunchWindow:
    """Keeps the host at most `layers` gen layers of kernels ahead of the GPU (CUDA events; the wait
    releases the GIL). A forward otherwise queues a whole 5 s denoising step at once, and a setting read at
    kernel launch (runner/chat_share.py's SM margin for chats) would reach the GPU only a step later. The
    window never starves the GPU: the host waits only while `layers` layers are still queued."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.events: deque[torch.cuda.Event] = deque()

    def mark(self) -> None:
        """A layer's kernels are queued."""
        event = torch.cuda.Event()
        event.record()
        self.events.append(event)
        if len(self.events) > self.layers:
            self.events.popleft().synchronize()


class Cosmos3Transformer(Cosmos3TransformerSetup):
    """Both towers, embeddings, heads; parameter names are ours, checkpoint keys map via weights.py."""

    def __init__(
        self, config: Cosmos3Config, *, dtype: torch.dtype = torch.bfloat16, tp: ParallelGroup = SINGLE
    ) -> None:
        super().__init__()
        c, d = config, config.hidden_size
        self.config = c
        self.tp = tp
        self.embed_tokens = Embedding(c.vocab_size, d, dtype=dtype)
        self.layers = nn.ModuleList(MoTLayer(c, dtype=dtype, tp=tp) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.norm_moe_gen = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.lm_head = ReplicatedLinear(d, c.vocab_size, bias=False, dtype=dtype)
        self.rotary_emb = MRotaryEmbedding(c.head_dim, c.rope_theta, c.mrope_sections)
        self.proj_in = ReplicatedLinear(c.patch_latent_dim, d, bias=True, dtype=dtype)
        self.proj_out = ReplicatedLinear(d, c.patch_latent_dim, bias=True, dtype=dtype)
        self.time_embedder = TimestepEmbedder(d)
        if c.sound_gen:
            assert c.sound_dim is not None  # (Cosmos3Config refuses sound_gen without sound_dim)
            self.audio_proj_in = ReplicatedLinear(c.sound_dim, d, bias=True, dtype=dtype)
            self.audio_proj_out = ReplicatedLinear(d, c.sound_dim, bias=True, dtype=dtype)
            self.audio_modality_embed = nn.Parameter(torch.empty(d, dtype=dtype), requires_grad=False)
        self.und_blocks: BlockStreamer | None = None  # set by enable_layerwise_offload
        self.gen_blocks: BlockStreamer | None = None
        self.launch_window = 0  # gen layers a forward may queue ahead of the GPU (0: all); see LaunchWindow
        self.merged_lora: MergedLora | None = None  # set by merge_gen_lora

    @property
    def dtype(self) -> torch.dtype:
        """Activation / weight dtype (time_embedder excepted)."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    # ------------------------------------------------------------------ loading
    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every key of this model's checkpoint, with its on-disk shape (all are checked before loading)."""
        return transformer_checkpoint_shapes(self.config)

    def loaded_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint keys this model loads, with their shapes: all but the action heads."""
        return loaded_checkpoint_shapes(self.config)

    def load_checkpoint_tensor(self, key: str, tensor: Tensor) -> None:
        """Copy checkpoint tensor `key` (any dtype/device) into its (fused, rank-local) parameter slice."""
        target = checkpoint_target(key, self.config, self.tp.size)
        copy_checkpoint_tensor(self.get_parameter(target.name), target, tensor, key, self.tp)

    def post_load(self) -> None:
        """Recompute non-persistent buffers (RoPE tables) on the model's device, e.g. after to_empty()."""
        self.rotary_emb.reset_buffers()

    # ------------------------------------------------------------------ und pathway
    def und_kv_bytes_per_token(self) -> int:
        """K + V bytes of one token over every und layer (rank-local heads)."""
        blk = self.layers[0].und
        return PagedKVPool.bytes_per_token(len(self.layers), blk.num_kv_heads, blk.head_dim, self.dtype)

    def new_paged_pool(self, tokens: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> PagedKVPool:
        """A paged K/V pool on this model's device holding `tokens` tokens (+ the scratch block) of every und
        layer, rank-local heads (the Reasoner's chats share it: models/layers/paged_kv.py)."""
        blk = self.layers[0].und
        return PagedKVPool(
            num_layers=len(self.layers), num_kv_heads=blk.num_kv_heads, head_dim=blk.head_dim,
            num_blocks=1 + -(-tokens // block_size), block_size=block_size, dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def new_und_cache(self, capacity: int) -> ContiguousKVCache:
        """An empty contiguous K/V cache for one sequence on this model's device."""
        blk = self.layers[0].und
        return ContiguousKVCache(
            num_layers=len(self.layers),
            num_kv_heads=blk.num_kv_heads,
            head_dim=blk.head_dim,
            capacity=capacity,
            dtype=self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def und_step(
        self, batch: UndBatch, caches: Sequence[KVCache], *, kv_only: bool = False, math: tuple | None = None,
        lora: LoraWeights | None = None,
    ) -> Tensor | None:  # fmt: skip
        """Run the und tower on the new tokens of len(caches) sequences, appending their K/V.

        Returns the final-normed hidden states [N, d] (feed rows to compute_logits), or None with kv_only,
        which skips everything after the last layer's K/V. `math`: (qkv, finish) functions for every layer
        in place of the blocks' eager ones (layer.compiled_decode_math's). `lora`: an adapter whose und deltas
        apply (a video prompt's K/V; the Reasoner's chats run the base weights).
        """
        if len(caches) != len(batch.seq_lens):
            raise ValueError(f"{len(caches)} caches for {len(batch.seq_lens)} sequences")
        h = batch.inputs_embeds if batch.inputs_embeds is not None else self.embed_tokens(batch.input_ids)
        h = h.to(self.dtype)  # [N, d]
        cos, sin = self.rotary_emb.cos_sin(batch.positions, h.dtype)
        for cache, n in zip(caches, batch.seq_lens, strict=True):
            cache.reserve(n)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            with _resident(self.und_blocks, i):
                out = und_layer_step(
                    layer.und, i, h, cos, sin, caches, batch.seq_lens, kv_only=kv_only and i == last,
                    math=math, lora=None if lora is None else lora.tower(i, "und"),
                )  # fmt: skip
            if out is not None:
                h = out
                if i < len(batch.deepstack):  # Qwen3-VL deepstack: ViT features into the early layers
                    h = h.index_add(0, batch.visual_rows, batch.deepstack[i].to(h.dtype))
        for cache, n in zip(caches, batch.seq_lens, strict=True):
            cache.advance(n)
        return None if kv_only else self.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Final-normed hidden [M, d] -> logits [M, vocab] (lm_head)."""
        return self.lm_head(hidden)

    def prefill_und(
        self, prompts: Sequence[Tensor], lora: LoraWeights | None = None
    ) -> list[ContiguousKVCache]:
        """Text K/V of each prompt ([L_i] token ids, positions (k, k, k)), in one batched und pass (under
        `lora`'s und deltas when given)."""
        caches = [self.new_und_cache(int(p.numel())) for p in prompts]
        batch = UndBatch.text([p.to(self.device) for p in prompts])
        self.und_step(batch, caches, kv_only=True, lora=lora)
        return caches

    # ------------------------------------------------------------------ gen pathway
    @torch.inference_mode()
    def forward(
        self, batch: GenBatch, sp: ParallelGroup = SINGLE, lora: LoraWeights | None = None
    ) -> GenOutput:
        """One denoising forward of every item in `batch` -> per-item velocities.

        `sp`: a Ulysses group (every rank calls forward with the same batch); each rank runs the layers on
        its block of the stream and the blocks are gathered before the heads (parallel/ulysses.py). `lora`:
        the LoRA adapter every item runs with (models/layers/lora.py), None for the base model."""
        g = self._embed_gen(batch, lora)  # [N, d]
        n = g.shape[0]
        cos, sin = self.rotary_emb.cos_sin(batch.positions, g.dtype)  # [N, D] each
        g, cos, sin = ulysses.shard(g, sp), ulysses.shard(cos, sp), ulysses.shard(sin, sp)  # [N_pad/P, ...]
        caches = [item.und_cache for item in batch.items]
        spans = [(x.gen_offset, x.num_tokens) for x in batch.layout]
        buffers = None
        if sp.size == 1:
            buffers = GenAttentionBuffers(caches, spans, self.layers[0].gen, g, batch.twins)
        window = LaunchWindow(self.launch_window) if self.launch_window and g.is_cuda else None
        for i, layer in enumerate(self.layers):
            with _resident(self.gen_blocks, i):
                tower = None if lora is None else lora.tower(i, "gen")
                g = gen_layer_step(layer.gen, i, g, cos, sin, caches, spans, sp, buffers, tower)
            if window is not None:
                window.mark()
        del buffers  # the K/V and output workspace (~1 GB at 720p with CFG) before the heads allocate
        return self._decode_gen(ulysses.gather(g, n, sp), batch, lora)

    def _embed_gen(self, batch: GenBatch, lora: LoraWeights | None = None) -> Tensor:
        """Packed gen stream [N, d]: per item [proj_in(video patches) | audio_proj_in(sound) + embed] + temb."""
        dtype, p = self.dtype, self.config.latent_patch_size
        top = {} if lora is None else lora.top
        patches = [patchify(item.latents.to(dtype), p) for item in batch.items]  # each [T*Hp*Wp, 192]
        video = self.proj_in(torch.cat(patches), top.get("proj_in")).split(
            [x.num_video for x in batch.layout]
        )
        sounds = [item.sound.to(dtype).t() for item in batch.items if item.sound is not None]  # [T_s, C_s]
        sound_tokens: list[Tensor] = []
        if sounds:
            sound_all = (
                self.audio_proj_in(torch.cat(sounds), top.get("audio_proj_in")) + self.audio_modality_embed
            )
            sound_tokens = list(sound_all.split([x.num_sound for x in batch.layout if x.num_sound]))
        parts: list[Tensor] = []
        for vid, lay in zip(video, batch.layout, strict=True):
            parts.append(vid)
            if lay.num_sound:
                parts.append(sound_tokens.pop(0))
        g = torch.cat(parts) if len(parts) > 1 else parts[0]
        temb = self.time_embedder(batch.timesteps * self.config.timestep_scale, lora).to(dtype)  # [B, d]
        return g.index_add(0, batch.temb_rows, temb.index_select(0, batch.temb_items))

    def _decode_gen(self, g: Tensor, batch: GenBatch, lora: LoraWeights | None = None) -> GenOutput:
        """norm_moe_gen + heads on the noisy rows, back to per-item latent-shaped velocities."""
        p, top = self.config.latent_patch_size, {} if lora is None else lora.top
        vel = self.proj_out(
            self.norm_moe_gen(g.index_select(0, batch.video_rows)), top.get("proj_out")
        )  # [N_vout, 192]
        num_video = sum(x.num_video for x in batch.layout)
        all_video = vel.new_zeros(num_video, vel.shape[1]).index_copy_(0, batch.video_slots, vel)
        video = tuple(
            unpatchify(tok, lay.grid, lay.latent_hw, p)
            for tok, lay in zip(
                all_video.split([x.num_video for x in batch.layout]), batch.layout, strict=True
            )
        )
        sound: list[Tensor | None] = [None] * len(batch.items)
        if batch.sound_rows.numel():
            s = self.audio_proj_out(
                self.norm_moe_gen(g.index_select(0, batch.sound_rows)), top.get("audio_proj_out")
            )
            chunks = iter(s.split([x.num_sound for x in batch.layout if x.num_sound]))
            sound = [next(chunks).t().contiguous() if x.num_sound else None for x in batch.layout]
        return GenOutput(video=video, sound=tuple(sound))
