"""LoRA adapters for the Cosmos3 transformer: find the files, check them against the model, load them into our
fused layout (models/layers/lora.py LoraWeights).

Formats (the adapter's module names are diffusers' Cosmos3OmniTransformer's, the checkpoint's key names):
- PEFT's folder: `adapter_config.json` + `adapter_model.safetensors` (keys `base_model.model.<module>.lora_A
  .weight` / `.lora_B.weight`), what `PeftModel.save_pretrained` writes and vLLM-Omni requires;
- diffusers' LoRA file: `pytorch_lora_weights.safetensors` (or any one `.safetensors` file, or the folder
  holding just one), keys `<module>.lora_A.weight` optionally prefixed `transformer.`, its LoraConfig in the
  `lora_adapter_metadata` header entry when `save_lora_adapter` wrote it (a pipeline's `save_lora_weights`:
  its `transformer.`-prefixed part; without one, lora_alpha = r);
- kohya-style trainers' files: `lora_down` / `lora_up` for A / B, a scalar `<module>.alpha` each, keys
  optionally prefixed `diffusion_model.` (the scaling alpha / r, as those trainers and diffusers read them).
Scaling as PEFT's: lora_alpha / r per module (`rank_pattern` / `alpha_pattern` matched on module names as
PEFT matches them; rsLoRA: lora_alpha / sqrt(r)), times the request's scale; folded into B at load.
Modules: every linear of both towers' layers (to_q/to_k/to_v/to_out, add_q_proj/add_k_proj/add_v_proj/
to_add_out, mlp.* and mlp_moe_gen.* gate/up/down) and the gen pathway's proj_in, proj_out, time_embedder's
two linears, audio_proj_in/out; `lm_head` (the Reasoner's head, unused by generation) is skipped with a log
line. Anything else (DoRA, LoRA biases, fan_in_fan_out, embeddings, unknown modules, shapes that do not fit
the model) is refused naming it: a request never runs with part of its adapter silently dropped.

`inspect_adapter` reads headers (and kohya-style alphas, scalars) only: the API's check before a job is
accepted, --max-lora-rank's bound on every module's rank included (`check_rank`); `load_adapter` reads the
tensors and builds this rank's LoraWeights on the device. Which file a path names and its LoraConfig (PEFT's,
or diffusers' header metadata): weights/lora_adapter_files.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from worldserve.models.cosmos3.checkpoint_keys import transformer_checkpoint_shapes
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.weights import checkpoint_target, layer_linear_rows
from worldserve.models.layers.lora import TOP_LINEARS, LoraWeights
from worldserve.parallel.groups import SINGLE, ParallelGroup
from worldserve.weights.loader import FLOAT_DTYPES
from worldserve.weights.lora_adapter_files import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    check_peft_config,
    find_adapter_files,
    metadata_config,
    pattern_value,
    refuse_adapter,
)

log = logging.getLogger(__name__)

_PREFIXES = ("base_model.model.", "transformer.", "diffusion_model.")
_KEY_RE = re.compile(
    r"^(?P<module>.+)\.(?:lora_(?P<ab>[AB])\.weight|lora_(?P<du>down|up)\.weight|(?P<alpha>alpha))$"
)
_PART = {"A": "A", "B": "B", "down": "A", "up": "B"}
"""Key suffix -> pair part: PEFT's lora_A / lora_B, the kohya-style trainers' lora_down / lora_up."""
_SKIPPED = ("lm_head",)
"""Modules an adapter may carry that generation never runs (the Reasoner's vocabulary head)."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter's files, checked against a model config: what `load_adapter` reads."""

    path: str
    """As the request gave it."""
    weights: Path
    identity: tuple
    """The weights file (real path, inode, size, times) and every module's (rank, scaling): `_identity`."""
    modules: dict[str, tuple[int, float]]
    """module -> (rank, lora_alpha / r scaling) of every module applied."""
    keys: dict[str, tuple[str, str]]
    """module -> (its A key, its B key) in the file."""


def adaptable_modules(config: Cosmos3Config) -> dict[str, tuple[int, int]]:
    """module -> its weight's (out, in) for every module an adapter may carry deltas for: the layers' linears
    (their 2-D weights) and the gen pathway's TOP_LINEARS."""
    return {
        key.removesuffix(".weight"): shape
        for key, shape in transformer_checkpoint_shapes(config).items()
        if key.endswith(".weight") and len(shape) == 2
        and (key.startswith("layers.") or key.removesuffix(".weight") in TOP_LINEARS)
    }  # fmt: skip


def _identity(weights: Path, modules: dict) -> tuple:
    """What makes this adapter this one: its weights file (real path, inode, size, modification and change
    times: a rewrite in place is another adapter) and what its config made of it (every module's rank and
    scaling: an edited config, or the same file read with and without its config, is another adapter)."""
    st = os.stat(weights)
    files = (str(weights.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return (*files, tuple(sorted(modules.items())))


def inspect_adapter(path: str, config: Cosmos3Config, *, max_rank: int | None = None) -> AdapterSpec:
    """The adapter at `path` checked against the model (headers only, no tensor read): every key a LoRA A or
    B of a module the model has and worldserve applies, shapes fitting the module, float dtypes, and with
    `max_rank` (--max-lora-rank) no module of a higher rank (`check_rank`)."""
    weights, peft = find_adapter_files(path)
    metadata, header, alphas = _read_header(path, weights)
    if peft is None:
        peft = metadata_config(metadata, path)
    check_peft_config(peft or {}, path)
    pairs = _pair_keys(path, header)
    shapes = adaptable_modules(config)
    modules, keys, unknown = {}, {}, []
    for module, ab in sorted(pairs.items()):
        if set(ab) - {"alpha"} != {"A", "B"}:
            raise refuse_adapter(path, f"module {module!r} has lora_{''.join(sorted(set(ab) - {'alpha'}))} but not both "
                          "lora_A and lora_B")  # fmt: skip
        if module in _SKIPPED:
            log.info("LoRA adapter %s: %s is not used by generation, skipped", path, module)
            continue
        target = shapes.get(module)
        if target is None:
            unknown.append(module)
            continue
        rank = _pair_rank(path, module, header[ab["A"]], header[ab["B"]], target, peft)
        own_alpha = alphas[ab["alpha"]] if "alpha" in ab else None
        modules[module] = (rank, _pair_scaling(path, module, rank, peft, own_alpha))
        keys[module] = (ab["A"], ab["B"])
    if unknown:
        raise refuse_adapter(path, f"it targets modules worldserve's Cosmos3 transformer does not apply LoRA to: "
                      f"{unknown[:4]}{f' (and {len(unknown) - 4} more)' if len(unknown) > 4 else ''}")  # fmt: skip
    check_rank(path, modules, max_rank)
    return AdapterSpec(
        path=path, weights=weights, identity=_identity(weights, modules), modules=modules, keys=keys
    )


_Header = dict[str, tuple[tuple[int, ...], str]]
"""key -> (shape, dtype name) of every tensor in a safetensors header."""


def _read_header(path: str, weights: Path) -> tuple[dict[str, str], _Header, dict[str, Tensor]]:
    """The weights file's (metadata, header, kohya-style alphas): no tensor read but the `.alpha` scalars;
    ParamError naming `lora` when it is not a readable safetensors file."""
    try:
        with safe_open(str(weights), framework="pt") as f:
            metadata = f.metadata() or {}
            header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
            alphas = {k: f.get_tensor(k) for k in header if k.endswith(".alpha")}  # (scalars: kohya's alphas)
    except (SafetensorError, OSError) as exc:
        raise refuse_adapter(path, f"{weights.name} is not a readable safetensors file ({exc})") from None
    return metadata, header, alphas


def _pair_keys(path: str, header: _Header) -> dict[str, dict[str, str]]:
    """module -> {"A" / "B" / "alpha": its key} of every key in the header, their prefixes (_PREFIXES) dropped;
    ParamError naming `lora` for a key that is no LoRA part, a part given twice, or no LoRA key at all."""
    pairs: dict[str, dict[str, str]] = defaultdict(dict)
    strange = []
    for key in header:
        name = next((key[len(p) :] for p in _PREFIXES if key.startswith(p)), key)
        m = _KEY_RE.match(name)
        if m is None:
            strange.append(key)
        else:
            part = "alpha" if m["alpha"] else _PART[m["ab"] or m["du"]]
            # (one module's part twice, under two prefixes or as lora_A and lora_down: which one ran
            # depended on the header's order, the other dropped in silence)
            if (twin := pairs[m["module"]].get(part)) is not None:
                raise refuse_adapter(
                    path, f"module {m['module']!r} has two {part} tensors ({twin!r} and {key!r})"
                )
            pairs[m["module"]][part] = key
    if strange:
        raise refuse_adapter(path, f"keys that are not LoRA weights (lora_A / lora_B, lora_down / lora_up, alpha): {strange[:3]}"
                      f"{f' (and {len(strange) - 3} more)' if len(strange) > 3 else ''}")  # fmt: skip
    if not pairs:
        raise refuse_adapter(path, "it holds no LoRA weights")
    return pairs


def _pair_rank(
    path: str, module: str, a: tuple[tuple[int, ...], str], b: tuple[tuple[int, ...], str],
    target: tuple[int, int], peft: dict | None,
) -> int:  # fmt: skip
    """The rank of `module`'s pair, from its lora_A's and lora_B's (shape, dtype) in the header: ParamError
    naming `lora` unless they fit the module's weight `target` (out, in), are floating point, have a rank of
    at least 1 and, with a config, the rank it says (its rank_pattern's, or r)."""
    (a_shape, a_dtype), (b_shape, b_dtype) = a, b
    out_f, in_f = target
    if (
        len(a_shape) != 2
        or len(b_shape) != 2
        or a_shape[1] != in_f
        or b_shape[0] != out_f
        or a_shape[0] != b_shape[1]
    ):
        raise refuse_adapter(path, f"module {module!r}: lora_A {list(a_shape)} / lora_B {list(b_shape)} do not fit its "
                      f"weight [{out_f}, {in_f}] (A [r, {in_f}], B [{out_f}, r])")  # fmt: skip
    if a_dtype not in FLOAT_DTYPES or b_dtype not in FLOAT_DTYPES:
        raise refuse_adapter(
            path, f"module {module!r}: lora weights must be floating point ({a_dtype}, {b_dtype})"
        )
    if a_shape[0] < 1:  # (no rows: nothing to apply, and lora_alpha / r divides by zero)
        raise refuse_adapter(path, f"module {module!r}: lora_A {list(a_shape)} has rank 0")
    rank = a_shape[0]  # (with a config, its values, or PEFT's LoraConfig defaults: r 8, lora_alpha 8)
    if (
        peft is not None
        and (said := pattern_value(peft.get("rank_pattern"), module, peft.get("r", 8))) != rank
    ):
        raise refuse_adapter(path, f"module {module!r} has rank {rank}, its config says {said}")
    return rank


def _pair_scaling(path: str, module: str, rank: int, peft: dict | None, value: Tensor | None) -> float:
    """`module`'s scaling, PEFT's: lora_alpha / r (rsLoRA: / sqrt(r)), lora_alpha from the config (its
    alpha_pattern's, or lora_alpha; without a config, r) unless the file holds the module's own alpha `value`
    (kohya-style); ParamError naming `lora` when that is not one finite number."""
    alpha = (
        rank if peft is None else pattern_value(peft.get("alpha_pattern"), module, peft.get("lora_alpha", 8))
    )
    if value is not None:  # (a kohya-style file's own alpha for the module: its scaling is alpha / r)
        # (a float or an integer, as trainers store it and diffusers reads it: `.item()`)
        numeric = value.is_floating_point() or not (value.dtype.is_complex or value.dtype == torch.bool)
        if value.numel() != 1 or not numeric or not math.isfinite(float(value)):
            raise refuse_adapter(path, f"module {module!r}: its alpha must be one finite number")
        alpha = float(value)
    rs = bool(peft and peft.get("use_rslora"))
    return float(alpha) / (math.sqrt(rank) if rs else rank)


def check_rank(path: str, modules: dict[str, tuple[int, float]], max_rank: int | None) -> None:
    """vLLM's --max-lora-rank bound: ParamError naming `lora`, in vLLM's words ("LoRA rank R is greater than
    max_lora_rank N."), when a module applied has more than `max_rank` rows in its lora_A (None: no bound).
    vLLM compares the config's r; this compares every module's own rank (A's rows, the loader's), so a
    rank_pattern entry above the bound is refused too, and a kohya-style file without a config is bounded."""
    if max_rank is None or not modules:
        return
    module, (rank, _) = max(modules.items(), key=lambda item: item[1][0])
    if rank > max_rank:
        raise refuse_adapter(path, f"LoRA rank {rank} is greater than max_lora_rank {max_rank} (module "
                             f"{module!r}; the server's --max-lora-rank)")  # fmt: skip


def load_adapter(
    spec: AdapterSpec, scale: float, config: Cosmos3Config, *, dtype: torch.dtype, device: torch.device,
    tp: ParallelGroup = SINGLE,
) -> LoraWeights:  # fmt: skip
    """The adapter's tensors as this rank's LoraWeights on `device`: B scaled by the module's scaling times
    `scale`, fused parts stacked (A) and block-diagonal (B), tensor-parallel slices cut as the base weights
    are (models/cosmos3/weights.py). The time embedder's pairs stay float32 as its weights do."""
    fused: dict[str, list[tuple]] = defaultdict(list)  # our linear -> [(target, A, B)]
    top = {}
    with safe_open(str(spec.weights), framework="pt") as f:
        for module, (_, scaling) in spec.modules.items():
            a_key, b_key = spec.keys[module]
            a = f.get_tensor(a_key).float()  # [r, in]
            b = f.get_tensor(b_key).float() * (scaling * scale)  # [out, r]
            pair_dtype = torch.float32 if module.startswith("time_embedder.") else dtype
            if not (a.to(pair_dtype).isfinite().all() and b.to(pair_dtype).isfinite().all()):
                raise refuse_adapter(spec.path, f"module {module!r}: its weights, B times the scaling "
                              f"({scaling:g} x scale {scale:g}), are not all finite in {str(pair_dtype)[6:]} "
                              "(NaN or inf in the file, or a scale too large)")  # fmt: skip
            if module in TOP_LINEARS:
                top[module] = (a.to(device, pair_dtype), b.to(device, pair_dtype))
                continue
            target = checkpoint_target(f"{module}.weight", config, tp.size)
            fused[target.name.removesuffix(".weight")].append((target, a, b))
    if _identity(spec.weights, spec.modules) != spec.identity:  # (replaced between the check and the read)
        raise refuse_adapter(spec.path, "its weights file changed while it was read; send the request again")
    layers: list[dict[str, dict]] = [{} for _ in range(config.num_hidden_layers)]
    for name, parts in fused.items():
        _, layer, tower, linear = name.split(".")  # layers.<i>.<und|gen>.<linear>
        out_local = layer_linear_rows(linear, config, tp.size)
        layers[int(layer)].setdefault(tower, {})[linear] = _fuse(parts, out_local, tp, dtype, device)
    return LoraWeights(key=(spec.identity, float(scale), tp.rank), layers=tuple(layers), top=top)


def _fuse(
    parts: list[tuple], out_local: int, tp: ParallelGroup, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """One fused linear's (A [R, in_local], B [out_local, R]) from its parts' (target, A, B): A rows stacked,
    B block-diagonal at each part's rows (zeros elsewhere: a part without an adapter gets no delta)."""
    a_rows, blocks, total = [], [], 0
    for target, a, b in parts:
        if target.shard_dim == 1 and tp.size > 1:  # row-parallel: this rank's input columns of A
            n = a.shape[1] // tp.size
            a = a.narrow(1, tp.rank * n, n)
        if target.shard_dim == 0 and tp.size > 1:  # column-parallel: this rank's output rows of B
            n = b.shape[0] // tp.size
            b = b.narrow(0, tp.rank * n, n)
        a_rows.append(a)
        blocks.append((target, b, total))
        total += a.shape[0]
    fused_b = torch.zeros(out_local, total)
    for target, b, col in blocks:
        fused_b[target.offset : target.offset + b.shape[0], col : col + b.shape[1]] = b
    return torch.cat(a_rows).to(device, dtype), fused_b.to(device, dtype)


def write_random_adapter(
    folder: str | Path, config: Cosmos3Config, *, rank: int = 4, alpha: float = 8.0, seed: int = 0,
    std: float = 0.05, dtype: torch.dtype = torch.float32,
) -> str:  # fmt: skip
    """A PEFT adapter folder with random A (std 0.2) and B (`std`) for every module this file applies (both
    towers' layer linears, the gen pathway's embeddings and heads): tests' and benchmarks' adapters, a delta
    everywhere. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_f, in_f) in adaptable_modules(config).items():
        a = torch.randn(rank, in_f, generator=g) * 0.2
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = (
            torch.randn(out_f, rank, generator=g) * std
        ).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / PEFT_WEIGHTS))
    (folder / PEFT_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha}))
    return str(folder)
