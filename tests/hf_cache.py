"""A Hugging Face hub cache on disk holding the tiny checkpoint as a repo's snapshot, for the tests of model
references (resolve_model, VideoPipeline.from_pretrained) with no network."""

from __future__ import annotations

import shutil
from pathlib import Path


def hf_cache_snapshot(tiny_ckpt, tmp_path: Path, monkeypatch, repo_id: str = "nvidia/Cosmos3-Nano") -> Path:
    """An offline cache (HF_HUB_CACHE under tmp_path) holding `tiny_ckpt` as `repo_id`'s main snapshot; the
    snapshot's folder."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_ckpt, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    return snap
