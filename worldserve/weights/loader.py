"""Streaming safetensors checkpoints into modules built on the meta device.

`check_checkpoint` reads only the safetensors headers of every shard and compares them with the expected
key -> shape table: missing, unexpected and mis-shaped keys (and non-float tensors) are one
`CheckpointError` naming them, before any tensor is read. `load_transformer` builds the model on the meta
device in the target dtype, materialises it with `to_empty`, then streams tensors one at a time from the
mmap'd shards into `model.load_checkpoint_tensor(key, tensor)` (which fuses q/k/v and gate/up) behind a
`Loading safetensors checkpoint shards` progress bar.

FP8 (ModelOpt-style) checkpoints store `float8_e4m3fn` weights with a `<key>_scale` (or `<name>.weight_scale`)
tensor and optional `input_scale`s; they are detected and dequantised on load to the target dtype.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from worldserve.weights.checkpoint import CheckpointError
from worldserve.weights.safetensors_shards import list_shards

if TYPE_CHECKING:
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.parallel.groups import ParallelGroup

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", *FP8_DTYPES)
# Side tensors of ModelOpt FP8 checkpoints: per-tensor or per-row scales next to each quantised weight.
SCALE_SUFFIXES = ("weight_scale", "input_scale", "weight_scale_2", "k_scale", "v_scale")
PROGRESS_DESC = "Loading safetensors checkpoint shards"


class WeightTarget(Protocol):
    def load_checkpoint_tensor(self, key: str, tensor: torch.Tensor) -> None: ...

    def post_load(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CheckpointHeader:
    files: dict[str, Path]
    """key -> shard holding it."""
    shapes: dict[str, tuple[int, ...]]
    """key -> stored shape."""
    dtypes: dict[str, str]
    """key -> safetensors dtype string (BF16, F32, F8_E4M3, ...)."""

    @property
    def is_fp8(self) -> bool:
        return any(d in FP8_DTYPES for d in self.dtypes.values())

    def non_float(self, keys: Iterable[str]) -> list[str]:
        """ "key: dtype" of those of `keys` whose tensors are not floating point, sorted."""
        return sorted(f"{k}: {self.dtypes[k]}" for k in keys if self.dtypes[k] not in FLOAT_DTYPES)


def read_header(folder: Path, prefix: str) -> CheckpointHeader:
    try:
        files = list_shards(folder, prefix)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from e
    except SafetensorError as e:  # a single file whose header is cut
        raise _unreadable(folder / f"{prefix}.safetensors", e) from e
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key, path in files.items():
        by_file[path].append(key)
    for path, keys in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                present = set(f.keys())
                for key in keys:
                    if key not in present:
                        raise CheckpointError(f"{path.name}: the index lists {key!r} but the shard lacks it")
                    sl = f.get_slice(key)
                    shapes[key] = tuple(sl.get_shape())
                    dtypes[key] = sl.get_dtype()
        except SafetensorError as e:
            raise _unreadable(path, e) from e
    return CheckpointHeader(files=files, shapes=shapes, dtypes=dtypes)


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{path}: unreadable safetensors file ({e}); re-download it")


def _is_scale_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in SCALE_SUFFIXES or key.endswith("_scale")


def _scale_key_for(key: str, header: CheckpointHeader) -> str | None:
    base = key[: -len("weight")] if key.endswith("weight") else key + "."
    for cand in (f"{base}weight_scale", f"{key}_scale"):
        if cand in header.shapes:
            return cand
    return None


def check_checkpoint(header: CheckpointHeader, expected: dict[str, tuple[int, ...]], where: str) -> None:
    """One error naming every missing, unexpected, mis-shaped or non-float key."""
    stored = {k for k in header.shapes if not (header.is_fp8 and _is_scale_key(k))}
    missing = sorted(set(expected) - stored)
    unexpected = sorted(stored - set(expected))
    misshaped = sorted(
        f"{k}: stored {list(header.shapes[k])}, expected {list(expected[k])}"
        for k in stored & set(expected)
        if header.shapes[k] != tuple(expected[k])
    )
    bad_dtype = header.non_float(stored)
    unscaled = sorted(
        k for k in stored if header.dtypes[k] in FP8_DTYPES and _scale_key_for(k, header) is None
    )
    problems = []
    for label, items in (
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("wrong shapes", misshaped),
        ("non-float tensors", bad_dtype),
        ("fp8 weights without a scale tensor", unscaled),
    ):
        if items:
            shown = "; ".join(items[:8]) + (f"; ... ({len(items) - 8} more)" if len(items) > 8 else "")
            problems.append(f"{len(items)} {label}: {shown}")
    if problems:
        raise CheckpointError(f"{where} does not match the model config: " + " | ".join(problems))


def stream_tensors(
    header: CheckpointHeader, keys: Iterable[str], progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, tensor) shard by shard from mmap'd files; fp8 weights come back dequantised to float32."""
    wanted = set(keys)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in wanted:
        by_file[header.files[key]].append(key)
    shards = sorted(by_file)
    # no tqdm at all without progress: even disabled, it makes a multiprocessing lock, which a peer process
    # (runner/peers.py, ended with os._exit) left to the resource tracker's "leaked semaphore" warning
    for path in tqdm(shards, desc=PROGRESS_DESC, unit="shard") if progress else shards:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in sorted(by_file[path]):
                t = f.get_tensor(key)
                if header.dtypes[key] in FP8_DTYPES:
                    scale_key = _scale_key_for(key, header)
                    assert scale_key is not None, key  # (check_checkpoint refused an fp8 weight without one)
                    with safe_open(str(header.files[scale_key]), framework="pt") as sf:
                        scale = sf.get_tensor(scale_key).float()
                    t = t.float() * (scale if scale.ndim == 0 or scale.numel() == 1 else scale.reshape(-1, 1))
                yield key, t


def load_into(target: WeightTarget, header: CheckpointHeader, expected: dict, progress: bool = True) -> None:
    with torch.no_grad():
        for key, tensor in stream_tensors(header, expected.keys(), progress=progress):
            target.load_checkpoint_tensor(key, tensor)
    target.post_load()


def load_transformer(
    root: Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", progress: bool = True,
    tp: ParallelGroup | None = None,
) -> Cosmos3Transformer:  # fmt: skip
    """Build the Cosmos3 transformer of checkpoint folder `root` and load its weights (with a tensor-parallel
    ParallelGroup `tp`: this rank's slices of the sharded linears)."""
    folder = Path(root) / "transformer"
    header = read_header(folder, "diffusion_pytorch_model")
    model = check_transformer_header(Path(root), header, dtype, tp)
    model = model.to_empty(device=device)
    load_into(model, header, model.loaded_shapes(), progress=progress)
    return model.eval().requires_grad_(False)


def check_transformer_header(
    root: Path, header: CheckpointHeader, dtype: torch.dtype = torch.bfloat16, tp: ParallelGroup | None = None
) -> Cosmos3Transformer:
    """The transformer of `root`'s config built on the meta device, its checkpoint `header` checked against it
    (CheckpointError naming every missing, unexpected or mis-shaped key): no tensor is read."""
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.weights.checkpoint import read_transformer_config

    with torch.device("meta"):
        model = Cosmos3Transformer(
            read_transformer_config(root), dtype=dtype, **({} if tp is None else {"tp": tp})
        )
    check_checkpoint(header, model.checkpoint_shapes(), str(root / "transformer"))
    return model
