"""The server's own adapter at scale 0 (`--lora-path X --lora-scale 0`, the offline `Engine(lora_path=X,
lora_scale=0.0)`) is checked once, at the start (runner/lora_cache.py `load_static`), not on every request
that names no adapter (the API fills it into those): removing X after the start leaves plain requests running
the base model, not a 400 naming a `lora` their caller never sent. An adapter a request names is still checked
at scale 0 (tests/test_lora_scale_zero.py), the static one's path under a request's own name included.
"""

from __future__ import annotations

import shutil

import pytest
from pipeline_helpers import write_random_adapter
from test_serve_compat_flags import serving

from worldserve.config import LoraConfig, ModelConfig, ParallelConfig

SMALL = {"width": 64, "height": 48, "num_frames": 5, "num_inference_steps": 1, "seed": 3}
FORM = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "1", "seed": "3"}
IMAGE = {"prompt": "x", "size": "64x48", "num_inference_steps": 1, "seed": 3}


@pytest.mark.parametrize("enable_lora", [False, True])
def test_the_offline_engine_runs_plain_videos_after_the_static_adapter_is_removed(
    tiny_ckpt, tmp_path, enable_lora
):
    """Engine(lora_path=X, lora_scale=0.0): a video, X removed, a second plain video still made (the base
    model's, byte for byte the first); with enable_lora a request naming a missing adapter at scale 0, or X
    under a name of its own, is a ParamError naming `lora`."""
    from worldserve import Engine
    from worldserve.params import LoraRequest, ParamError

    adapter = write_random_adapter(tmp_path / "static", tiny_ckpt, rank=8, alpha=8.0, std=0.5)
    options = {"device": "cpu", "dtype": "float32", "max_model_len": 2048, "enable_lora": enable_lora}
    with Engine(tiny_ckpt, lora_path=adapter, lora_scale=0.0, **options) as engine:
        first = engine.generate_video("x", **SMALL)
        assert first.params.lora == LoraRequest("static", adapter, 0.0)
        shutil.rmtree(adapter)
        second = engine.generate_video("x", **SMALL)
        assert second.video == first.video
        if enable_lora:
            for named in (
                LoraRequest("gone", str(tmp_path / "nothing"), 0.0),
                LoraRequest("mine", adapter, 0.0),
            ):
                with pytest.raises(ParamError, match="no such file or folder") as err:
                    engine.generate_video("x", lora=named, **SMALL)
                assert err.value.param == "lora"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_answers_plain_requests_after_the_static_adapter_is_removed(tiny_ckpt, tmp_path, monkeypatch, anyio_backend):  # fmt: skip
    """`--lora-path X --lora-scale 0`: X removed after the start, plain requests on /v1/videos/sync,
    /v1/videos and /v1/images/generations are answered (200), not a 400 naming `lora`."""
    from worldserve.commands.serve_backend import load_backend

    adapter = write_random_adapter(tmp_path / "static", tiny_ckpt, rank=8, alpha=8.0, std=0.5)
    model = ModelConfig(model=str(tiny_ckpt), device="cpu", dtype="float32")
    pipeline = load_backend(model, ParallelConfig(), lora=LoraConfig(lora_path=adapter, lora_scale=0.0))[0]
    async with serving(
        tmp_path, monkeypatch, "--lora-path", adapter, "--lora-scale", "0", backend=pipeline
    ) as http:
        before = await http.post("/v1/videos/sync", data=FORM)
        assert before.status_code == 200, before.text
        shutil.rmtree(adapter)
        after = await http.post("/v1/videos/sync", data=FORM)
        assert after.status_code == 200, after.text
        assert after.content == before.content
        job = await http.post("/v1/videos", data=FORM)
        assert job.status_code == 200, job.text
        image = await http.post("/v1/images/generations", json=IMAGE)
        assert image.status_code == 200, image.text
