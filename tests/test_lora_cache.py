"""runner/lora_cache.py's key (and so LoraWeights.key, the batch key): an adapter is what its weights file holds
(real path, inode, size, modification and change times) and what its config makes of it (every module's rank and
scaling): an edited config or a rewrite in place is read again, one adapter named by its folder or its weights
file is one entry, the same file read without its config another."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from pipeline_helpers import write_random_adapter

from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.parallel.groups import SINGLE
from worldserve.params import LoraRequest
from worldserve.runner.lora_cache import LoraCache
from worldserve.weights.lora_adapter import inspect_adapter


@pytest.fixture(scope="module")
def transformer(tiny_ckpt):
    """What LoraCache reads of a transformer (config, dtype, device, tensor-parallel group)."""
    config = Cosmos3Config.from_json(tiny_ckpt / "transformer" / "config.json")
    return SimpleNamespace(
        config=config, dtype=torch.float32, device=torch.device("cpu"), tp=SINGLE, merged_lora=None
    )


def _b(weights, module="proj_out"):
    return weights.top[module][1]


def test_an_edited_adapter_config_is_read_again(transformer, tiny_ckpt, tmp_path):
    """lora_alpha edited in adapter_config.json (the weights file untouched): inspect_adapter sees the new
    scaling, the cache keeps serving the old weights (same key), so the next request runs the old alpha."""
    folder = write_random_adapter(tmp_path / "a", tiny_ckpt, rank=4, alpha=4.0)
    cache = LoraCache(transformer)
    before = cache.get(LoraRequest("a", folder, 1.0))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 8.0}))
    assert inspect_adapter(folder, transformer.config).modules["proj_out"] == (4, 2.0)  # (the new alpha)
    after = cache.get(LoraRequest("a", folder, 1.0))
    torch.testing.assert_close(_b(after), 2.0 * _b(before))


def test_folder_and_its_weights_file_are_one_adapter(transformer, tiny_ckpt, tmp_path):
    """The PEFT folder (alpha 8, r 4: scaling 2) and the same folder's adapter_model.safetensors named directly
    are one adapter (its config read either way): one cache entry, one key. Read without its config (a copy
    of the file alone: scaling 1) it is another adapter with another key, never batched with the first."""
    import shutil

    folder = write_random_adapter(tmp_path / "a", tiny_ckpt, rank=4, alpha=8.0)
    file = os.path.join(folder, "adapter_model.safetensors")
    cfg = transformer.config
    assert inspect_adapter(folder, cfg).modules == inspect_adapter(file, cfg).modules
    cache = LoraCache(transformer)
    by_folder = cache.get(LoraRequest("a", folder, 1.0))
    assert cache.get(LoraRequest("b", file, 1.0)) is by_folder
    (tmp_path / "alone").mkdir()
    shutil.copy(file, tmp_path / "alone" / "lora.safetensors")
    alone = cache.get(LoraRequest("c", str(tmp_path / "alone"), 1.0))
    assert alone.key != by_folder.key
    torch.testing.assert_close(2.0 * _b(alone), _b(by_folder))


def test_same_size_rewrite_with_the_old_mtime_is_read_again(transformer, tiny_ckpt, tmp_path):
    """An adapter retrained at the same rank rewrites a file of exactly the same size; only mtime_ns tells it
    apart. A copy that carries a timestamp (cp -p / rsync -t of a file saved within the same mtime tick, or
    a coarse-mtime file system) leaves (path, size, mtime) equal and the stale weights are served."""
    folder = write_random_adapter(tmp_path / "a", tiny_ckpt, seed=1)
    weights = os.path.join(folder, "adapter_model.safetensors")
    stat = os.stat(weights)
    cache = LoraCache(transformer)
    old = cache.get(LoraRequest("a", folder, 1.0))
    write_random_adapter(tmp_path / "a", tiny_ckpt, seed=2)  # the same shapes: the same size
    assert os.stat(weights).st_size == stat.st_size
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    new = cache.get(LoraRequest("a", folder, 1.0))
    stale = torch.equal(_b(new), _b(old))
    assert not stale, "stale adapter served after the file changed"
