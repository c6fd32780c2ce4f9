"""The public Python API as a user meets it: what `import worldserve` offers (names, dir(), the errors its
functions raise) and the README's Python examples, run as written in a fresh interpreter on the embedded tiny
checkpoint (the Engine's and VideoPipeline's), their MP4 / PNG outputs decoded with PyAV and Pillow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python_blocks() -> list[str]:
    """Every ```python block of the README, as written."""
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_public_names_resolve_and_dir_lists_the_lazy_ones(tmp_path):
    import worldserve
    from worldserve.param_errors import ParamError

    for name in worldserve.__all__:
        assert getattr(worldserve, name) is not None
    # dir() (and a REPL's completion) had listed neither VideoPipeline nor resolve_model: they load lazily
    assert set(worldserve.__all__) <= set(dir(worldserve))
    assert worldserve.ParamError is ParamError and issubclass(ParamError, ValueError)
    # what resolve_model and VideoPipeline.from_pretrained raise for a folder that is not a checkpoint can be
    # caught from the package itself (it was only importable from worldserve.weights.checkpoint)
    with pytest.raises(worldserve.CheckpointError, match="model_index.json"):
        worldserve.resolve_model(str(tmp_path))
    # design.md §3.2's public API: Engine, EngineConfig, VideoParams, ChatParams (Engine had been missing)
    from worldserve.chat_params import ChatParams
    from worldserve.config import EngineConfig
    from worldserve.offline.engine import Engine

    exported = (worldserve.Engine, worldserve.EngineConfig, worldserve.ChatParams)
    assert exported == (Engine, EngineConfig, ChatParams)
    with pytest.raises(AttributeError, match="no attribute 'LLM'"):
        _ = worldserve.LLM


def test_readme_python_examples_run_as_written(tiny_ckpt, tmp_path):
    """The example had loaded nvidia/Cosmos3-Nano at the model's defaults: a CheckpointError offline, and tens of
    minutes of CPU on the tiny checkpoint. It now runs on the embedded tiny checkpoint (linked here where
    resolve_model(None) looks for it) and writes a T2V MP4 with audio, a PNG and an I2V MP4; the Engine's block
    its own T2V and I2V MP4s (and chats)."""
    import av
    from PIL import Image

    from worldserve.weights.checkpoint import TINY_LAYOUT, TINY_SEED

    blocks = readme_python_blocks()
    assert blocks, "the README has no Python example"
    cache = tmp_path / "cache"
    (cache / "worldserve").mkdir(parents=True)
    (cache / "worldserve" / f"tiny-cosmos3-v{TINY_LAYOUT}-seed{TINY_SEED}").symlink_to(tiny_ckpt)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1"}
    for i, code in enumerate(blocks):
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0 and "Traceback" not in run.stderr, (
            f"README python block {i}:\n{run.stderr}"
        )
    for name in ("fox.mp4", "more.mp4", "engine_fox.mp4", "engine_i2v.mp4"):
        with av.open(str(tmp_path / name)) as container:
            video, audio = container.streams.video[0], container.streams.audio[0]
            assert (video.codec_context.name, audio.codec_context.name) == ("h264", "aac")
            assert (audio.codec_context.sample_rate, audio.codec_context.channels) == (48000, 2)
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 17 and frames[0].shape == (192, 320, 3)
    with Image.open(tmp_path / "still.png") as still:
        assert still.size == (320, 192) and still.mode == "RGB"
