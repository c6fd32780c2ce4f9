"""A request naming a LoRA adapter at scale 0 runs the base model, but its adapter is checked as at any other
scale (headers and adapter_config only, runner/lora_cache.py `check`): a path with nothing there, a file that is
no adapter, or an adapter above --max-lora-rank is a 400 naming `lora` before a job is made, as diffusers'
`set_adapters` refuses an adapter it does not hold at weight 0 and serve refuses --lora-path at --lora-scale 0.
A good adapter at scale 0 answers the base model's video, its weights never read.
"""

from __future__ import annotations

import json

import pytest
from pipeline_helpers import write_random_adapter
from test_serve_compat_flags import serving

from worldserve.config import LoraConfig, ModelConfig, ParallelConfig
from worldserve.runner import lora_cache

SMALL = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "1", "seed": "3"}
IMAGE = {"prompt": "x", "size": "64x48", "num_inference_steps": 1, "seed": 3}


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt):
    """serve's backend on the tiny checkpoint (float32 CPU) with --enable-lora --max-lora-rank 8."""
    from worldserve.commands.serve_backend import load_backend

    model = ModelConfig(model=str(tiny_ckpt), device="cpu", dtype="float32")
    return load_backend(model, ParallelConfig(), lora=LoraConfig(enable_lora=True, max_lora_rank=8))[0]


@pytest.fixture(scope="module")
def bad_adapters(tiny_ckpt, tmp_path_factory):
    """name -> (a path a request may give, what its 400 says): nothing there, a file that is not safetensors,
    safetensors that hold no LoRA weights, and a rank-16 adapter (above the bound)."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("bad")
    (root / "text.safetensors").write_text("not an adapter")
    save_file({"layers.0.weight": torch.zeros(2, 2)}, str(root / "plain.safetensors"))
    wide = write_random_adapter(root / "wide", tiny_ckpt, rank=16, alpha=16.0)
    return {
        "missing": (str(root / "nothing"), "no such file or folder"),
        "unreadable": (str(root / "text.safetensors"), "is not a readable safetensors file"),
        "not LoRA": (str(root / "plain.safetensors"), "keys that are not LoRA weights"),
        "above the bound": (wide, "LoRA rank 16 is greater than max_lora_rank 8"),
    }


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_bad_adapter_at_scale_0_is_a_400_naming_lora(pipeline, bad_adapters, tmp_path, monkeypatch, anyio_backend):  # fmt: skip
    """Each bad adapter at scale 0 (a number or a numeric string) on /v1/videos/sync, /v1/videos and
    /v1/images/generations: a 400 naming `lora` with the same reason as at scale 1, no job made."""
    async with serving(
        tmp_path, monkeypatch, "--enable-lora", "--max-lora-rank", "8", backend=pipeline
    ) as http:
        for name, (path, said) in bad_adapters.items():
            for scale in (0, "0", 1):
                lora = {"name": name, "path": path, "scale": scale}
                for route, body in (
                    ("/v1/videos/sync", {"json": {**SMALL, "lora": lora}}),
                    ("/v1/videos", {"data": {**SMALL, "lora": json.dumps(lora)}}),
                    ("/v1/images/generations", {"json": {**IMAGE, "lora": lora}}),
                ):
                    r = await http.post(route, **body)
                    assert r.status_code == 400, (name, scale, route, r.text)
                    error = r.json()["error"]
                    assert error["param"] == "lora" and said in error["message"], (name, scale, route, error)
        assert (await http.get("/v1/videos")).json()["data"] == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_good_adapter_at_scale_0_runs_the_base_model_unread(pipeline, tiny_ckpt, tmp_path, monkeypatch, anyio_backend):  # fmt: skip
    """A rank-8 adapter at scale 0: 200, the same MP4 as the request without `lora` (the base model), and no
    adapter weights read (load_adapter never called); at scale 1 it is read and the video differs."""
    good = write_random_adapter(tmp_path / "good", tiny_ckpt, rank=8, alpha=8.0, std=0.5)
    reads = []
    real = lora_cache.load_adapter
    monkeypatch.setattr(lora_cache, "load_adapter", lambda *a, **k: reads.append(a[0].path) or real(*a, **k))
    async with serving(
        tmp_path, monkeypatch, "--enable-lora", "--max-lora-rank", "8", backend=pipeline
    ) as http:
        base = await http.post("/v1/videos/sync", json=SMALL)
        zero = await http.post(
            "/v1/videos/sync", json={**SMALL, "lora": {"name": "g", "path": good, "scale": 0}}
        )
        assert base.status_code == 200 and zero.status_code == 200, (base.text, zero.text)
        assert zero.content == base.content and reads == []
        one = await http.post(
            "/v1/videos/sync", json={**SMALL, "lora": {"name": "g", "path": good, "scale": 1}}
        )
        assert one.status_code == 200 and reads == [good] and one.content != base.content


def test_the_offline_engine_checks_the_same(tiny_ckpt, bad_adapters, tmp_path):
    """worldserve.Engine (serve's load_backend: its cache made with max_lora_rank): an adapter above the bound,
    or none there, at scale 0 is a ParamError naming `lora`; a good one at scale 0 makes the base model's video."""
    from worldserve import Engine
    from worldserve.params import LoraRequest, ParamError

    small = {"width": 64, "height": 48, "num_frames": 5, "num_inference_steps": 1, "seed": 3}
    good = write_random_adapter(tmp_path / "good", tiny_ckpt, rank=8, alpha=8.0, std=0.5)
    options = {
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 2048,
        "enable_lora": True,
        "max_lora_rank": 8,
    }
    with Engine(tiny_ckpt, **options) as engine:
        for name in ("missing", "above the bound"):
            path, said = bad_adapters[name]
            with pytest.raises(ParamError, match=said) as err:
                engine.generate_video("x", lora=LoraRequest(name, path, 0.0), **small)
            assert err.value.param == "lora"
        base = engine.generate_video("x", **small)
        assert engine.generate_video("x", lora=LoraRequest("g", good, 0.0), **small).video == base.video
