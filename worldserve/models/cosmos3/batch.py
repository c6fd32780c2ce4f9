"""Input and output dataclasses of the Cosmos3 transformer, and the packing of several requests into one.

- `UndBatch`: new text tokens of one or more sequences for an und (understanding-tower) step: a prompt
  prefill, a chunk, or one decode token each. Each sequence has its own `KVCache`.
- `GenItem`: one denoising input: video latent [C, T, H, W] (clean conditioning frames included),
  optional sound latent [C_s, T_s], the integer scheduler timestep, the fps, which latent frames are
  clean, and the und K/V cache of its prompt (the CFG branch). cond and uncond are two items.
- `GenBatch.pack(items, ...)`: the packed gen stream, item after item, each [video T*Hp*Wp | sound T_s]
  tokens. It holds host metadata (an `ItemLayout` per item; `twins`: identical items computed once) and
  small device index tensors built once, so that `forward` needs no host syncs and runs its linear layers
  over all tokens of all items at once.
- `GenOutput`: per item the velocity [C, T, H, W] (zeros on clean frames) and [C_s, T_s] or None.
Patchify is 2x2 with zero padding of odd latent H/W; the feature index is (ph*p + pw)*C + c; tokens are
T-major, then row, then column (cosmos3-model.md §2.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.positions import media_origin, sound_positions, text_positions, video_positions
from worldserve.models.layers.attention import KVCache


def patchify(latents: Tensor, p: int) -> Tensor:
    """[C, T, H, W] -> [T*Hp*Wp, p*p*C] with Hp = ceil(H/p), Wp = ceil(W/p) (bottom/right zero pad)."""
    c, t, h, w = latents.shape
    pad_h, pad_w = (-h) % p, (-w) % p
    if pad_h or pad_w:
        latents = F.pad(latents, (0, pad_w, 0, pad_h))
    hp, wp = (h + pad_h) // p, (w + pad_w) // p
    x = latents.reshape(c, t, hp, p, wp, p)  # [C, T, Hp, ph, Wp, pw]
    x = x.permute(1, 2, 4, 3, 5, 0)  # [T, Hp, Wp, ph, pw, C]
    return x.reshape(t * hp * wp, p * p * c)


def unpatchify(tokens: Tensor, grid: tuple[int, int, int], hw: tuple[int, int], p: int) -> Tensor:
    """[T*Hp*Wp, p*p*C] -> [C, T, H, W], cropping the patchify padding."""
    t, hp, wp = grid
    x = tokens.reshape(t, hp, wp, p, p, -1)  # [T, Hp, Wp, ph, pw, C]
    x = x.permute(5, 0, 1, 3, 2, 4)  # [C, T, Hp, ph, Wp, pw]
    x = x.reshape(x.shape[0], t, hp * p, wp * p)  # [C, T, Hp*p, Wp*p]
    return x[:, :, : hw[0], : hw[1]].contiguous()


@dataclass(frozen=True, slots=True, kw_only=True)
class UndBatch:
    input_ids: Tensor
    """[N] long: the new tokens of every sequence, packed in sequence order."""
    positions: Tensor
    """[3, N] mRoPE ids of those tokens (text: (k, k, k))."""
    seq_lens: tuple[int, ...]
    """New tokens per sequence (host metadata); sums to N."""
    inputs_embeds: Tensor | None = None
    """[N, hidden] optional override of embed_tokens(input_ids) (e.g. vision embeddings spliced in)."""
    deepstack: tuple[Tensor, ...] = ()
    """Qwen3-VL deepstack: deepstack[i] [M, hidden] is added to the rows `visual_rows` after und layer i."""
    visual_rows: Tensor | None = None
    """[M] long: rows of the visual tokens in this batch (required with `deepstack`)."""

    def __post_init__(self) -> None:
        if sum(self.seq_lens) != self.input_ids.shape[0] or any(n <= 0 for n in self.seq_lens):
            raise ValueError(
                f"seq_lens {self.seq_lens} must be positive and sum to {self.input_ids.shape[0]}"
            )
        if tuple(self.positions.shape) != (3, self.input_ids.shape[0]):
            raise ValueError(
                f"positions must be [3, {self.input_ids.shape[0]}], got {tuple(self.positions.shape)}"
            )
        if self.deepstack and (
            self.visual_rows is None or any(f.shape[0] != self.visual_rows.shape[0] for f in self.deepstack)
        ):
            raise ValueError("deepstack features need visual_rows with one row per feature row")

    @classmethod
    def text(cls, token_ids: Sequence[Tensor], starts: Sequence[int] | None = None) -> UndBatch:
        """Plain text chunks; sequence i's tokens sit at positions starts[i], starts[i]+1, ... (default 0)."""
        starts = [0] * len(token_ids) if starts is None else list(starts)
        ids = torch.cat([t.reshape(-1) for t in token_ids])
        pos = torch.cat(
            [text_positions(t.numel(), start=s) for t, s in zip(token_ids, starts, strict=True)], 1
        )
        return cls(input_ids=ids, positions=pos.to(ids.device), seq_lens=tuple(t.numel() for t in token_ids))


@dataclass(frozen=True, slots=True, kw_only=True)
class GenItem:
    latents: Tensor
    """[C, T, H, W] video latent at this step (clean frames hold the conditioning latent)."""
    timestep: Tensor | float
    """Integer scheduler timestep (0-d tensor or number); the network sees timestep * timestep_scale."""
    und_cache: KVCache
    """The prompt's und K/V (prefill_und) of this item's CFG branch; its length is L_text."""
    fps: float = 24.0
    """Video fps (temporal mRoPE modulation)."""
    clean_frames: tuple[int, ...] = ()
    """Latent frames given clean (I2V: (0,)): no timestep embedding, zero velocity."""
    sound: Tensor | None = None
    """[C_s, T_s] sound latent (all frames noisy), or None."""


@dataclass(frozen=True, slots=True)
class ItemLayout:
    gen_offset: int
    """First row of this item in the packed gen stream."""
    grid: tuple[int, int, int]
    """Video patch grid (T, Hp, Wp)."""
    latent_hw: tuple[int, int]
    """Unpadded latent (H, W)."""
    num_sound: int
    """Sound tokens (0 without sound)."""

    @property
    def num_video(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def num_tokens(self) -> int:
        return self.num_video + self.num_sound


@dataclass(frozen=True, slots=True, kw_only=True)
class GenBatch:
    items: tuple[GenItem, ...]
    """The requests / CFG branches, in stream order."""
    layout: tuple[ItemLayout, ...]
    """Host metadata per item."""
    positions: Tensor
    """[3, N] mRoPE ids of the whole gen stream."""
    timesteps: Tensor
    """[B] float32 integer scheduler timesteps, one per item."""
    temb_rows: Tensor
    """[N_noisy] long: gen rows that get the timestep embedding (noisy video tokens and sound tokens)."""
    temb_items: Tensor
    """[N_noisy] long: item of each such row."""
    video_rows: Tensor
    """[N_vout] long: gen rows of noisy video tokens (read by proj_out)."""
    video_slots: Tensor
    """[N_vout] long: their row in the item-after-item stack of all video tokens."""
    sound_rows: Tensor
    """[N_s] long: gen rows of sound tokens."""
    twins: tuple[tuple[int, ...], ...] = ()
    """Groups (2+ items, ascending) whose gen input is identical (`same_gen_input`: the CFG branches of
    one request). Their first layer's gen-gen attention is the same function (transformer.py shares it)."""

    @property
    def num_tokens(self) -> int:
        return sum(x.num_tokens for x in self.layout)

    @classmethod
    def pack(cls, items: Sequence[GenItem], *, config: Cosmos3Config, device: torch.device | str) -> GenBatch:
        """Lay out `items` into one gen stream. The layout's positions and index tensors depend only on the
        items' shapes, prompt lengths, fps and clean frames, which stay the same over a request's steps:
        they are built on the CPU and moved to `device` once per layout (`_packed_layout`, cached), and
        each step moves only its timesteps, without waiting for the GPU (a plain `.to(device)` of a CPU
        tensor synchronizes the stream: the GPU would idle while the host packs and launches)."""
        if not items:
            raise ValueError("GenBatch needs at least one item")
        device = torch.device(device)
        shapes = tuple(_check_item(item, config) for item in items)
        key = tuple(
            (shape, None if it.sound is None else it.sound.shape[1], it.und_cache.length, float(it.fps),
             tuple(it.clean_frames))
            for shape, it in zip(shapes, items, strict=True)
        )  # fmt: skip
        packed = _packed_layout(key, config, device)
        return cls(
            items=tuple(items), timesteps=_timesteps(items, device), twins=twin_groups(items), **packed
        )


_LAYOUTS: dict[tuple, tuple[Cosmos3Config, dict]] = {}
_LAYOUTS_KEPT = 8
"""Layouts kept on their devices (a few MB each at 720p), least recently used first."""


def _packed_layout(key: tuple, config: Cosmos3Config, device: torch.device) -> dict:
    """GenBatch's layout fields for items described by `key` (per item: latent shape, sound tokens or None,
    prompt length, fps, clean frames), built once per (key, config, device) and then shared: read only.
    The config (unhashable) is keyed by identity; each entry holds it, so its id cannot be reused meanwhile."""
    cache_key = (key, id(config), device)
    if (hit := _LAYOUTS.pop(cache_key, None)) is not None:
        _LAYOUTS[cache_key] = hit  # most recently used last
        return hit[1]
    p = config.latent_patch_size
    layouts, positions = [], []
    temb_rows, temb_items, video_rows, video_slots, sound_rows = [], [], [], [], []
    offset = video_base = 0
    for b, ((_, t, h, w), num_sound, prompt_len, fps, clean_frames) in enumerate(key):
        num_sound = num_sound or 0
        grid = (t, -(-h // p), -(-w // p))
        lay = ItemLayout(gen_offset=offset, grid=grid, latent_hw=(h, w), num_sound=num_sound)
        origin = media_origin(prompt_len, config)
        positions.append(video_positions(grid, origin=origin, fps=fps, config=config))
        per_frame = grid[1] * grid[2]
        frame = torch.arange(lay.num_video) // per_frame  # [N_vid] latent frame of each token
        noisy = ~torch.isin(frame, torch.tensor(clean_frames, dtype=torch.long))
        rows = torch.arange(lay.num_video)[noisy]
        video_rows.append(rows + offset)
        video_slots.append(rows + video_base)
        snd = torch.arange(num_sound) + offset + lay.num_video
        if num_sound:
            positions.append(sound_positions(num_sound, origin=origin, config=config))
        sound_rows.append(snd)
        temb_rows += [rows + offset, snd]
        temb_items.append(torch.full((rows.numel() + num_sound,), b, dtype=torch.long))
        layouts.append(lay)
        offset += lay.num_tokens
        video_base += lay.num_video
    packed = {
        "layout": tuple(layouts),
        "positions": torch.cat(positions, dim=1).to(device),
        "temb_rows": torch.cat(temb_rows).to(device),
        "temb_items": torch.cat(temb_items).to(device),
        "video_rows": torch.cat(video_rows).to(device),
        "video_slots": torch.cat(video_slots).to(device),
        "sound_rows": torch.cat(sound_rows).to(device),
    }
    if len(_LAYOUTS) >= _LAYOUTS_KEPT:
        del _LAYOUTS[next(iter(_LAYOUTS))]  # the least recently used layout
    _LAYOUTS[cache_key] = (config, packed)
    return packed


def _timesteps(items: Sequence[GenItem], device: torch.device) -> Tensor:
    """[B] float32 timesteps on `device`. Host numbers (or CPU tensors) travel in one pinned, non-blocking
    copy on CUDA, so the host does not wait for the GPU to drain its queue."""
    if any(isinstance(it.timestep, Tensor) and it.timestep.device != torch.device("cpu") for it in items):
        return torch.stack(
            [torch.as_tensor(it.timestep).to(device=device, dtype=torch.float32).reshape(()) for it in items]
        )
    values = torch.tensor([float(it.timestep) for it in items], dtype=torch.float32)
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def same_gen_input(a: GenItem, b: GenItem) -> bool:
    """Whether two items feed the gen tower the same tokens: the same latents and sound tensors (identity:
    a request's branches share them), the same timestep, fps and clean frames. Only the prompts differ, and
    with them the mRoPE origin, a constant shift of every gen position that attention among gen tokens
    does not see (RoPE is relative): the same function up to the float32 rounding of the shifted positions
    (non-integer ones, sound or fps != 24, move by up to ~0.002 of a position at 15k-token origins)."""
    ts_a, ts_b = a.timestep, b.timestep
    same_ts = ts_a is ts_b or (not isinstance(ts_a, Tensor) and not isinstance(ts_b, Tensor) and ts_a == ts_b)
    return (
        a.latents is b.latents
        and a.sound is b.sound
        and same_ts
        and a.fps == b.fps
        and a.clean_frames == b.clean_frames
    )


def twin_groups(items: Sequence[GenItem]) -> tuple[tuple[int, ...], ...]:
    """GenBatch.twins of `items`: each group's members in stream order, groups by their first member."""
    groups: list[list[int]] = []
    for i, item in enumerate(items):
        for group in groups:
            if same_gen_input(items[group[0]], item):
                group.append(i)
                break
        else:
            groups.append([i])
    return tuple(tuple(g) for g in groups if len(g) > 1)


def _check_item(item: GenItem, config: Cosmos3Config) -> tuple[int, int, int, int]:
    if item.latents.ndim != 4 or item.latents.shape[0] != config.latent_channel:
        raise ValueError(
            f"latents must be [{config.latent_channel}, T, H, W], got {tuple(item.latents.shape)}"
        )
    c, t, h, w = item.latents.shape
    if any(not 0 <= f < t for f in item.clean_frames):
        raise ValueError(f"clean_frames {item.clean_frames} out of range for {t} latent frames")
    if item.sound is not None:
        if not config.sound_gen:
            raise ValueError(
                "this checkpoint has no sound heads (sound_gen=False) but a sound latent was given"
            )
        if item.sound.ndim != 2 or item.sound.shape[0] != config.sound_dim or item.sound.shape[1] == 0:
            raise ValueError(f"sound must be [{config.sound_dim}, T_s>0], got {tuple(item.sound.shape)}")
    if item.und_cache.length == 0:
        raise ValueError("und_cache is empty: run prefill_und on the prompt first")
    if item.fps <= 0:
        raise ValueError(f"fps must be positive, got {item.fps}")
    return c, t, h, w


@dataclass(frozen=True, slots=True)
class GenOutput:
    video: tuple[Tensor, ...]
    """Per item velocity [C, T, H, W]; zeros on clean frames."""
    sound: tuple[Tensor | None, ...]
    """Per item sound velocity [C_s, T_s], or None for an item without sound."""
