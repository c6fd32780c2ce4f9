"""Sharded safetensors on disk: writing shards + index json (diffusers/transformers naming) and listing them back.

A component folder holds either one `<prefix>.safetensors` or `<prefix>-0000k-of-0000N.safetensors` files
plus `<prefix>.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {key: file}}`).
Shards are filled in key order up to `max_shard_bytes`, so the same tensors always give the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_sharded(
    folder: Path, prefix: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> dict[str, str]:
    """Write `tensors`; returns the weight map {key: file name}."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        name = f"{prefix}.safetensors"
        save_file(shards[0], str(folder / name), metadata={"format": "pt"})
        return {k: name for k in shards[0]}
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{prefix}.safetensors.index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n"
    )
    return weight_map


def list_shards(folder: Path, prefix: str) -> dict[str, Path]:
    """The weight map {key: shard path} of a component folder; raises FileNotFoundError naming what is missing
    (a shard, or a readable weight map in the index file)."""
    index_path = folder / f"{prefix}.safetensors.index.json"
    single = folder / f"{prefix}.safetensors"
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_bytes())
        except ValueError:  # (broken JSON, or not UTF-8)
            index = None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise FileNotFoundError(
                f"{index_path}: no weight_map of keys to shard files in it; re-download it"
            )
        files = {name: folder / name for name in set(weight_map.values())}
        missing = sorted(str(p) for p in files.values() if not p.is_file())
        if missing:
            raise FileNotFoundError(f"shards listed in {index_path} are missing: {', '.join(missing)}")
        return {k: files[v] for k, v in weight_map.items()}
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"no {prefix}.safetensors or {prefix}.safetensors.index.json in {folder}")
