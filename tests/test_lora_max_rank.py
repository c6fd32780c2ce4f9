"""--max-lora-rank (vLLM's flag): given, it bounds the rank of every adapter, read where the loader reads it (each
module's lora_A rows): a request's adapter above it is a 400 naming `lora` in vLLM's words, a --lora-path one
stops `serve` with one line, a `generate --lora` one exits 2 with one line; its values are vLLM's. Not given,
there is no bound (vLLM's default 16 would refuse adapters that run here today).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from pipeline_helpers import write_random_adapter
from safetensors.torch import save_file
from test_serve_compat_flags import config, serving

from worldserve.commands import serve_compat
from worldserve.config import LoraConfig, ModelConfig, ParallelConfig
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.params import ParamError
from worldserve.weights.lora_adapter import adaptable_modules, inspect_adapter

SMALL = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "1"}


def _config(ckpt) -> Cosmos3Config:
    return Cosmos3Config.from_json(Path(ckpt) / "transformer" / "config.json")


@pytest.fixture(scope="module")
def adapters(tiny_ckpt, tmp_path_factory):
    """Rank-8 and rank-16 PEFT folders of every module the tiny transformer applies LoRA to."""
    root = tmp_path_factory.mktemp("ranks")
    return {r: write_random_adapter(root / f"r{r}", tiny_ckpt, rank=r, alpha=float(r)) for r in (8, 16)}


def _two_modules(ckpt) -> list[str]:
    return [m for m in adaptable_modules(_config(ckpt)) if m.startswith("layers.")][:2]


def _two_module_adapter(folder: Path, ckpt, ranks: tuple[int, int], config: dict | None) -> str:
    """A PEFT folder (with `config`) or, without one, a kohya-style file (lora_down / lora_up, alphas) of the
    tiny transformer's `_two_modules` at `ranks`."""
    shapes = adaptable_modules(_config(ckpt))
    modules = _two_modules(ckpt)
    tensors = {}
    for module, r in zip(modules, ranks, strict=True):
        out_f, in_f = shapes[module]
        if config is None:
            tensors[f"{module}.lora_down.weight"] = torch.randn(r, in_f)
            tensors[f"{module}.lora_up.weight"] = torch.randn(out_f, r)
            tensors[f"{module}.alpha"] = torch.tensor(float(r))
        else:
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, in_f)
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, r)
    folder.mkdir(parents=True)
    if config is None:
        save_file(tensors, str(folder / "kohya.safetensors"))
    else:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return str(folder)


def test_the_bound_is_every_modules_rank(tiny_ckpt, adapters, tmp_path):
    """Each module's rank (lora_A's rows) against max_rank: the config's r, a rank_pattern entry above it, a
    kohya-style file with no config; at the bound or with none (the flag left out) the adapter passes."""
    cfg = _config(tiny_ckpt)
    with pytest.raises(ParamError) as error:
        inspect_adapter(adapters[16], cfg, max_rank=8)
    assert error.value.param == "lora"
    assert "LoRA rank 16 is greater than max_lora_rank 8 (module " in error.value.message
    assert error.value.message.startswith(f"LoRA adapter {adapters[16]!r}: ")
    assert inspect_adapter(adapters[16], cfg, max_rank=16).modules
    assert inspect_adapter(adapters[16], cfg).modules  # (no bound: today's behaviour)
    wide = _two_modules(tiny_ckpt)[1]
    peft = {"r": 4, "lora_alpha": 4, "rank_pattern": {wide: 16}}
    pattern = _two_module_adapter(tmp_path / "pattern", tiny_ckpt, (4, 16), peft)
    with pytest.raises(ParamError, match=rf"LoRA rank 16 is greater than max_lora_rank 8 \(module '{wide}'"):
        inspect_adapter(pattern, cfg, max_rank=8)
    kohya = _two_module_adapter(tmp_path / "kohya", tiny_ckpt, (32, 8), None)
    with pytest.raises(ParamError, match="LoRA rank 32 is greater than max_lora_rank 16"):
        inspect_adapter(kohya, cfg, max_rank=16)
    assert inspect_adapter(kohya, cfg, max_rank=32).modules


def test_the_flag_takes_vllms_values_and_is_a_real_one(tmp_path):
    """`--max-lora-rank N` reaches LoraConfig (one of vLLM's 1, 8, ..., 512; unset: None, no bound); others are
    argparse's exit 2 naming the flag; it is no longer an accepted-without-effect compat flag."""
    assert config("--max-lora-rank", "64").lora.max_lora_rank == 64
    assert config().lora.max_lora_rank is None and LoraConfig().max_lora_rank is None
    assert "--max-lora-rank" not in [c.flag for c in serve_compat.COMPAT_FLAGS]
    for value in (48, 0, 8.0, True):
        with pytest.raises(
            ValueError, match=r"^--max-lora-rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512"
        ):
            LoraConfig(max_lora_rank=value)  # type: ignore[arg-type]
    for value, said in (
        ("48", "invalid choice: 48"),
        ("-8", "invalid choice: -8"),
        ("x", "invalid int value"),
    ):
        proc = run_cli("serve", "--max-lora-rank", value, "--storage-dir", tmp_path)
        assert proc.returncode == 2 and f"argument --max-lora-rank: {said}" in proc.stderr, proc.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_request_above_the_bound_is_a_400_naming_lora(tiny_ckpt, adapters, tmp_path, monkeypatch, anyio_backend):  # fmt: skip
    """On a server loaded with --enable-lora --max-lora-rank 8 (serve_backend.load_backend, the tiny checkpoint):
    a request naming a rank-16 adapter is a 400 naming lora in vLLM's words, before any job; a rank-8 one
    runs."""
    from worldserve.commands.serve_backend import load_backend

    model = ModelConfig(model=str(tiny_ckpt), device="cpu", dtype="float32")
    pipeline = load_backend(model, ParallelConfig(), lora=LoraConfig(enable_lora=True, max_lora_rank=8))[0]
    assert pipeline.loras.max_rank == 8
    async with serving(
        tmp_path, monkeypatch, "--enable-lora", "--max-lora-rank", "8", backend=pipeline
    ) as http:
        wide = await http.post("/v1/videos/sync", json={**SMALL, "lora": {"name": "w", "path": adapters[16]}})
        assert wide.status_code == 400, wide.text
        error = wide.json()["error"]
        assert error["param"] == "lora" and "LoRA rank 16 is greater than max_lora_rank 8" in error["message"]
        assert (await http.get("/v1/videos")).json()["data"] == []  # (refused before a job was made)
        ok = await http.post("/v1/videos/sync", json={**SMALL, "lora": {"name": "n", "path": adapters[8]}})
        assert ok.status_code == 200, ok.text


def test_a_static_adapter_above_the_bound_stops_the_start(tiny_ckpt, adapters, tmp_path, monkeypatch):
    """--lora-path above --max-lora-rank: load_backend refuses it naming the flag before any weights load (merged
    or not); at the bound, or without the flag, the load goes ahead."""
    from worldserve.commands.serve_backend import load_backend
    from worldserve.runner import video_pipeline

    class Loaded(Exception):
        pass

    def load_pipeline(path, **kwargs):
        raise Loaded

    monkeypatch.setattr(video_pipeline, "load_pipeline", load_pipeline)
    model = ModelConfig(model=str(tiny_ckpt), device="cpu", dtype="float32")
    for flags in (dict(), dict(enable_lora=True)):
        with pytest.raises(
            ValueError, match=r"^--lora-path: LoRA adapter .*: LoRA rank 16 is greater than max_lora_rank 8"
        ):
            load_backend(
                model, ParallelConfig(), lora=LoraConfig(lora_path=adapters[16], max_lora_rank=8, **flags)
            )
    for bound in (16, None):
        with pytest.raises(Loaded):
            load_backend(
                model, ParallelConfig(), lora=LoraConfig(lora_path=adapters[16], max_lora_rank=bound)
            )


def _clean_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORLDSERVE_", "VLLM_"))}
    return {**env, "XDG_CACHE_HOME": str(tmp_path)}


def test_serve_refuses_to_start_with_one_line(tiny_ckpt, adapters, tmp_path):
    """`worldserve serve CKPT --lora-path R16 --max-lora-rank 8` (a real process): exit 2, one error line naming
    --lora-path, before the port binds or the model loads."""
    argv = [sys.executable, "-m", "worldserve.cli", "serve", str(tiny_ckpt), "--device", "cpu", "--port", "0",
            "--storage-dir", str(tmp_path / "store"), "--lora-path", adapters[16], "--max-lora-rank", "8"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_clean_env(tmp_path))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "LoRA rank" in line]
    assert len(errors) == 1 and "--lora-path: LoRA adapter" in errors[0], proc.stderr
    assert "LoRA rank 16 is greater than max_lora_rank 8" in errors[0] and "model ready" not in proc.stderr


def test_generate_exits_2_with_one_line(tiny_ckpt, adapters, tmp_path, monkeypatch):
    """`generate --lora R16 --max-lora-rank 8`: exit 2, one line naming --lora, no model loaded (in this process
    and as a real one); at the bound the run goes on to the load."""
    from worldserve.runner import video_pipeline

    loads = []
    monkeypatch.setattr(video_pipeline, "load_pipeline", lambda *a, **k: loads.append(a) or sys.exit(3))
    small = ("--size", "64x48", "--num-frames", "5", "--steps", "1", "--dtype", "float32", "--device", "cpu")
    argv = ("generate", tiny_ckpt, "--prompt", "a cat", *small, "--lora", adapters[16], "-o", tmp_path / "x.mp4")  # fmt: skip
    proc = run_cli(*argv, "--max-lora-rank", "8")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("worldserve generate: error: --lora: LoRA adapter ")
    assert "LoRA rank 16 is greater than max_lora_rank 8" in proc.stderr and loads == []
    assert run_cli(*argv, "--max-lora-rank", "16").returncode == 3 and len(loads) == 1
    real = subprocess.run([sys.executable, "-m", "worldserve.cli", *map(str, argv), "--max-lora-rank", "8"],
                          capture_output=True, text=True, timeout=300, env=_clean_env(tmp_path))  # fmt: skip
    assert real.returncode == 2 and "LoRA rank 16 is greater than max_lora_rank 8" in real.stderr, real.stderr
    assert real.stderr.count("\n") == 1 and not (tmp_path / "x.mp4").exists()
