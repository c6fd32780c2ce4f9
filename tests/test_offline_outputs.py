"""The offline Engine's outputs on their own (no model): `VideoOutput.save` writes its MP4 only under an MP4
name, as `ImageOutput.save` encodes by extension and `worldserve generate -o` does (a `.png` named MP4 was
written before)."""

from __future__ import annotations

import pytest

from worldserve.offline.outputs import VideoOutput
from worldserve.params import ParamError, VideoParams


def _output() -> VideoOutput:
    return VideoOutput(
        params=VideoParams(prompt="a fox"), seconds=1.0, video=b"\x00\x00\x00\x18ftypisom-not-real"
    )


@pytest.mark.parametrize("name", ["clip.mp4", "CLIP.MP4", "clip.m4v"])
def test_video_output_saves_its_mp4_under_an_mp4_name(tmp_path, name):
    out = _output()
    out.save(tmp_path / name)
    assert (tmp_path / name).read_bytes() == out.video


@pytest.mark.parametrize("name", ["still.png", "frames.npz", "clip", "clip.mov.txt"])
def test_video_output_refuses_another_extension_naming_the_path(tmp_path, name):
    with pytest.raises(ParamError) as info:
        _output().save(tmp_path / name)
    assert info.value.param == "path" and ".mp4" in str(info.value)
    assert not (tmp_path / name).exists()


def test_a_video_output_prints_its_mp4_by_size():
    """print(output) / a notebook cell's echo: the MP4 by its size (its bytes literal had been ~3 characters a
    byte, ~100 M for a 720p video), the rest as the dataclass shows it."""
    out = VideoOutput(params=VideoParams(prompt="a fox"), seconds=1.0, video=b"\x00" * 5_000_000)
    text = repr(out)
    assert text.startswith("VideoOutput(video=<MP4, 5,000,000 bytes>, params=VideoParams(prompt='a fox'")
    assert len(text) < 5_000 and "seconds=1.0" in text


def test_saving_into_a_missing_folder_names_the_callers_path(tmp_path):
    """(the error had named the hidden temporary file beside it)"""
    with pytest.raises(FileNotFoundError) as info:
        _output().save(tmp_path / "sub" / "clip.mp4")
    assert info.value.filename == str(tmp_path / "sub" / "clip.mp4") and ".tmp" not in str(info.value)
