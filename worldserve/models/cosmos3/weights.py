"""Checkpoint key -> slice of our (fused, possibly tensor-parallel) parameter, and the copy itself.

The checkpoint keeps diffusers' layout: separate to_q/to_k/to_v and gate_proj/up_proj per tower, with the
gen copy under `add_*` / `*_moe_gen` names (cosmos3-model.md §1.3). Our model fuses them at load time:
  layers.i.self_attn.{to_q,to_k,to_v}            -> layers.i.und.qkv_proj   rows [q | k | v]
  layers.i.self_attn.{add_q_proj,add_k_proj,...} -> layers.i.gen.qkv_proj
  layers.i.mlp.{gate_proj,up_proj}               -> layers.i.und.gate_up_proj rows [gate | up]
  layers.i.mlp_moe_gen.*                         -> layers.i.gen.*
  to_out / to_add_out, down_proj                 -> o_proj / down_proj (row-parallel: split along dim 1)
  norms                                          -> input_layernorm, q_norm, k_norm, post_attention_layernorm
Top-level keys (embed_tokens, norm, norm_moe_gen, lm_head, proj_in/out, time_embedder, audio_*) keep their
checkpoint names and are replicated (the action_* heads are checked, not loaded: transformer.py). Under
tensor parallelism a fused parameter holds each part's rank slice back to back, so `ParamTarget.offset/rows`
are in rank-local rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from worldserve.models.cosmos3.checkpoint_keys import transformer_checkpoint_shapes
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.parallel.groups import SINGLE, ParallelGroup


@dataclass(frozen=True, slots=True)
class ParamTarget:
    name: str
    """Our parameter's name (model.get_parameter(name))."""
    offset: int = 0
    """First rank-local row (dim 0) this checkpoint tensor fills."""
    rows: int | None = None
    """Rank-local rows it fills; None means the whole parameter."""
    shard_dim: int | None = None
    """Dim of the checkpoint tensor split across tensor-parallel ranks; None means replicated."""


# (und checkpoint suffix, gen checkpoint suffix, our suffix, fused part, checkpoint shard dim)
_LAYER_TABLE: tuple[tuple[str, str, str, str | None, int | None], ...] = (
    ("input_layernorm.weight", "input_layernorm_moe_gen.weight", "input_layernorm.weight", None, None),
    ("self_attn.to_q.weight", "self_attn.add_q_proj.weight", "qkv_proj.weight", "q", 0),
    ("self_attn.to_k.weight", "self_attn.add_k_proj.weight", "qkv_proj.weight", "k", 0),
    ("self_attn.to_v.weight", "self_attn.add_v_proj.weight", "qkv_proj.weight", "v", 0),
    ("self_attn.to_q.bias", "self_attn.add_q_proj.bias", "qkv_proj.bias", "q", 0),
    ("self_attn.to_k.bias", "self_attn.add_k_proj.bias", "qkv_proj.bias", "k", 0),
    ("self_attn.to_v.bias", "self_attn.add_v_proj.bias", "qkv_proj.bias", "v", 0),
    ("self_attn.to_out.weight", "self_attn.to_add_out.weight", "o_proj.weight", None, 1),
    ("self_attn.to_out.bias", "self_attn.to_add_out.bias", "o_proj.bias", None, None),
    ("self_attn.norm_q.weight", "self_attn.norm_added_q.weight", "q_norm.weight", None, None),
    ("self_attn.norm_k.weight", "self_attn.norm_added_k.weight", "k_norm.weight", None, None),
    (
        "post_attention_layernorm.weight",
        "post_attention_layernorm_moe_gen.weight",
        "post_attention_layernorm.weight",
        None,
        None,
    ),
    ("mlp.gate_proj.weight", "mlp_moe_gen.gate_proj.weight", "gate_up_proj.weight", "gate", 0),
    ("mlp.up_proj.weight", "mlp_moe_gen.up_proj.weight", "gate_up_proj.weight", "up", 0),
    ("mlp.down_proj.weight", "mlp_moe_gen.down_proj.weight", "down_proj.weight", None, 1),
)
_LAYER_KEYS: dict[str, tuple[str, str, str | None, int | None]] = {}
for _und, _gen, _ours, _part, _dim in _LAYER_TABLE:
    _LAYER_KEYS[_und] = ("und", _ours, _part, _dim)
    _LAYER_KEYS[_gen] = ("gen", _ours, _part, _dim)
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def _part_rows(part: str, config: Cosmos3Config, tp_size: int) -> tuple[int, int]:
    """(local offset, local rows) of a fused part on every rank."""
    q = config.q_dim // tp_size
    kv = config.kv_dim // tp_size
    f = config.intermediate_size // tp_size
    return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, f), "up": (f, f)}[part]


def layer_linear_rows(linear: str, config: Cosmos3Config, tp_size: int = 1) -> int:
    """Output rows on every rank of our layer linear `linear` (qkv_proj, o_proj, gate_up_proj, down_proj):
    the fused ones end with their last part; o_proj and down_proj are row-parallel (all d rows)."""
    last = {"qkv_proj": "v", "gate_up_proj": "up"}.get(linear)
    if last is None:
        return config.hidden_size
    offset, rows = _part_rows(last, config, tp_size)
    return offset + rows


def checkpoint_target(key: str, config: Cosmos3Config, tp_size: int = 1) -> ParamTarget:
    """Where checkpoint tensor `key` goes; KeyError for a key this architecture does not have."""
    m = _LAYER_RE.match(key)
    if m is None:
        if key not in transformer_checkpoint_shapes(config):
            raise KeyError(f"unexpected transformer checkpoint key {key!r}")
        return ParamTarget(key)
    layer, suffix = int(m.group(1)), m.group(2)
    if suffix not in _LAYER_KEYS or layer >= config.num_hidden_layers:
        raise KeyError(f"unexpected transformer checkpoint key {key!r}")
    if suffix.endswith("bias") and not config.attention_bias:
        raise KeyError(f"checkpoint has {key!r} but config.attention_bias is False")
    tower, ours, part, shard_dim = _LAYER_KEYS[suffix]
    name = f"layers.{layer}.{tower}.{ours}"
    if part is None:
        return ParamTarget(name, shard_dim=shard_dim)
    offset, rows = _part_rows(part, config, tp_size)
    return ParamTarget(name, offset=offset, rows=rows, shard_dim=shard_dim)


def copy_checkpoint_tensor(
    param: Tensor, target: ParamTarget, tensor: Tensor, key: str, tp: ParallelGroup = SINGLE
) -> None:
    """Copy this rank's slice of checkpoint `tensor` into its rows of `param`, converting dtype/device."""
    src = tensor
    if target.shard_dim is not None and tp.size > 1:
        n = src.shape[target.shard_dim] // tp.size
        src = src.narrow(target.shard_dim, tp.rank * n, n)
    dst = param if target.rows is None else param.narrow(0, target.offset, target.rows)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}; parameter {target.name!r} "
            f"expects {tuple(dst.shape)} for it (tp rank {tp.rank}/{tp.size})"
        )
    with torch.no_grad():
        dst.copy_(src)
