"""Reasoner video input: Qwen3-VL's video pipeline piece by piece against transformers' own functions (frame
sampling, smart_resize, timestamps, patchify), the whole prefill + decode against transformers'
Qwen3VLForConditionalGeneration fed our pixel_values_videos (positions, ViT, deepstack with images and
videos interleaved), and decoding real MP4 bytes. CPU, fp32, tiny checkpoint.

transformers' video processor itself needs torchvision (not installed here); its resize is torchvision's
antialiased bicubic of a uint8 tensor (torch's interpolate on float32, clamped and rounded once), which the
resize test holds ours to (within 1 level on under 0.1 % of values; Pillow's 8-bit resize was up to ~20 off)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from test_reasoner import _check_parity, _image, oracle, reasoner  # noqa: F401  (fixtures)

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart, ChatVideo, VideoSampling
from worldserve.media.video import encode_mp4
from worldserve.media.video_input import decode_chat_video
from worldserve.models.cosmos3.vision import chat_positions, video_inputs, video_timestamps
from worldserve.params import ParamError


def _video(seed: int, n: int = 5, h: int = 64, w: int = 96, fps: float = 2.0) -> ChatVideo:
    frames = np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    return ChatVideo(frames=frames, indices=tuple(range(0, 2 * n, 2)), source_fps=fps)


@pytest.mark.parametrize(
    ("total", "fps"), [(30, 24.0), (1, 30.0), (3, 25.0), (240, 24.0), (2000, 30.0), (90, 29.97)]
)
def test_frame_sampling_matches_qwen3vl(total, fps):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    stub = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    ref = Qwen3VLVideoProcessor.sample_frames(stub, VideoMetadata(total_num_frames=total, fps=fps))
    assert VideoSampling().indices(total, fps) == ref.tolist()
    ref8 = Qwen3VLVideoProcessor.sample_frames(
        stub, VideoMetadata(total_num_frames=total, fps=fps), num_frames=8, fps=None
    )
    assert VideoSampling(fps=None, num_frames=8).indices(total, fps) == ref8.tolist()


@pytest.mark.parametrize("n", [1, 2, 4, 9, 64])
@pytest.mark.parametrize(("h", "w"), [(20, 20), (100, 150), (720, 1280), (1080, 1920), (31, 400)])
def test_frame_size_matches_smart_resize(n, h, w):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    # transformers refuses fewer frames than the temporal patch; we size them as the two patchify makes.
    # The default budget is the Qwen3-VL checkpoints' video_preprocessor_config.json `size` (what AutoProcessor
    # and vLLM load: shortest_edge 4096, longest_edge 25165824), not the processor class's own default
    ref = smart_resize(max(n, 2), h, w, temporal_factor=2, factor=32, min_pixels=4096, max_pixels=25165824)
    assert VideoSampling().frame_size(n, h, w) == ref
    small = dict(min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32)  # (a request's size, e.g. the class's)
    ref = smart_resize(max(n, 2), h, w, temporal_factor=2, factor=32, **small)
    assert VideoSampling(**small).frame_size(n, h, w) == ref


def test_timestamps_and_patches_match_qwen3vl():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    for idx in ([0, 8, 16, 29], [0, 10, 19], [3]):
        assert video_timestamps(idx, 24.0) == pytest.approx(
            Qwen3VLProcessor._calculate_timestamps(None, list(idx), 24.0, 2)
        )
    frames = np.random.default_rng(0).integers(0, 256, (5, 64, 96, 3), dtype=np.uint8)
    ours = video_inputs(frames)
    x = (torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    ref, t, h, w = Qwen3VLVideoProcessor.patchify(
        None, x[None], patch_size=16, merge_size=2, temporal_patch_size=2
    )
    assert ours.grid_thw.tolist() == [[t, h, w]] == [[3, 4, 6]]
    torch.testing.assert_close(ours.pixel_values(), ref[0])


def test_video_chat_matches_qwen3vl(reasoner, oracle):  # noqa: F811
    params = ChatParams(messages=(ChatMessage(role="user", content=(
        ChatPart(type="video", video=_video(0)), ChatPart(type="text", text="What happens?"),
    )),), temperature=0.0)  # fmt: skip
    prompt, _ = _check_parity(reasoner, oracle, params)
    assert prompt.vision is None and prompt.video.grid_thw.tolist() == [[3, 4, 6]]
    text = reasoner.tokenizer.decode(prompt.input_ids)
    # 3 temporal patches (5 frames padded to 6) at the mean time of their two frames, 2x3 merged tokens each
    assert "<0.5 seconds><|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|><2.5 seconds>" in text
    assert text.count("<|video_pad|>") == 18 and "<4.0 seconds>" in text


def test_image_and_videos_interleaved_match_qwen3vl(reasoner, oracle):  # noqa: F811
    params = ChatParams(messages=(ChatMessage(role="user", content=(
        ChatPart(type="video", video=_video(1, n=4, h=32, w=64)), ChatPart(type="text", text="and"),
        ChatPart(type="image", image=_image(3)), ChatPart(type="video", video=_video(2, n=2, h=96, w=32)),
        ChatPart(type="text", text="compare them"),
    )),), temperature=0.0)  # fmt: skip
    prompt, _ = _check_parity(reasoner, oracle, params)
    ids = torch.tensor(prompt.input_ids)[None]
    kind = (ids == reasoner.image_token_id).int() + 2 * (ids == reasoner.video_token_id).int()
    ref, _ = oracle.model.get_rope_index(
        ids, kind, image_grid_thw=prompt.vision.grid_thw, video_grid_thw=prompt.video.grid_thw
    )
    ours, nxt = chat_positions(
        prompt.input_ids, reasoner.image_token_id, prompt.vision.grid_thw.tolist(), 2,
        video_token_id=reasoner.video_token_id, video_grids=prompt.video.grid_thw.tolist(),
    )  # fmt: skip
    assert torch.equal(ours.long(), ref[:, 0]) and nxt == int(ref.max()) + 1


def test_decode_chat_video_samples_and_resizes_an_mp4():
    rng = np.random.default_rng(0)
    clip = np.repeat(rng.integers(0, 256, (30, 9, 12, 3), dtype=np.uint8), 8, axis=1).repeat(8, axis=2)
    data = encode_mp4(clip, 24.0)  # 30 frames of 72x96 at 24 fps
    video = decode_chat_video(data, VideoSampling())
    assert video.indices == (0, 10, 19, 29) and video.source_fps == pytest.approx(24.0)
    assert (
        video.frames.shape == (4, *VideoSampling().frame_size(4, 72, 96), 3)
        and video.frames.dtype == np.uint8
    )
    two = decode_chat_video(data, VideoSampling(fps=None, num_frames=2))
    assert two.indices == (0, 29)
    with pytest.raises(ParamError) as e:
        decode_chat_video(b"not a video at all", VideoSampling())
    assert e.value.param == "messages"


def test_a_chat_videos_display_rotation_is_applied():
    """A phone's portrait clip in a video_url part reaches the Reasoner upright (OpenCV, vLLM's loader, turns
    it by its display matrix), sized as the portrait clip it is: it had been sampled sideways."""
    from test_v2v import ROTATE_90, _marked_clip, rotated_mp4

    video = decode_chat_video(rotated_mp4(_marked_clip(8), ROTATE_90), VideoSampling())
    height, width = video.frames.shape[1:3]
    assert (height, width) == VideoSampling().frame_size(4, 48, 32) and height > width
    top_right = video.frames[:, : height // 4, -width // 4 :]
    assert (top_right[..., 0] > 200).all() and (top_right[..., 2] < 60).all()
    assert (video.frames[:, -height // 4 :, : width // 4, 2] > 200).all()


def test_a_chat_video_frame_above_the_pixel_limit_is_refused_before_it_is_converted(monkeypatch):
    from PIL import Image

    from worldserve.media.image import ImageTooLarge

    data = encode_mp4(np.zeros((3, 72, 96, 3), np.uint8), 24.0)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 72 * 96 - 1)  # (images are refused from this size on)
    with pytest.raises(ImageTooLarge, match="a video frame of 96x72") as e:
        decode_chat_video(data, VideoSampling(), param="messages[0].content[0].video_url")
    assert e.value.param == "messages[0].content[0].video_url"
    # fps and num_frames together: the fewer frames of the two (vLLM's loader), never repeated
    both = VideoSampling(fps=2.0, num_frames=8).validate()
    assert both.indices(48, 24.0) == VideoSampling(fps=2.0).indices(48, 24.0)  # 2 s at 2 fps: 4 frames
    assert both.indices(480, 24.0) == VideoSampling(fps=None, num_frames=8).indices(480, 24.0)  # 8 of 40


def test_a_file_without_a_video_stream_says_so():
    """An audio-only MP4 in a video_url part: a 400 saying it has no video stream (it had been "not a valid
    video", as for a broken file)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=48000)
        stream.layout = "stereo"
        frame = av.AudioFrame.from_ndarray(np.zeros((2, 1024), np.float32), format="fltp", layout="stereo")
        frame.sample_rate = 48000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    path = "messages[0].content[0].video_url"
    with pytest.raises(
        ParamError, match=r"messages\[0\]\.content\[0\]\.video_url: the file has no video stream"
    ):
        decode_chat_video(buf.getvalue(), VideoSampling(), param=path)


def test_a_damaged_container_is_not_called_audio_only():
    """An MP4 whose track boxes are damaged opens with no stream at all: "not a valid video" (it was "the file
    has no video stream (audio only?)")."""
    data = encode_mp4(np.zeros((4, 32, 48, 3), np.uint8), 24.0).replace(b"trak", b"xxxx")
    with pytest.raises(ParamError, match=r"^Invalid p: provided content is not a valid video\.$"):
        decode_chat_video(data, VideoSampling(), param="p")


@pytest.mark.parametrize(
    ("src", "dst"),
    [((1080, 1920), (448, 800)), ((720, 1280), (448, 800)), ((100, 150), (128, 192)), ((31, 400), (32, 416)),
     ((300, 200), (300, 200))],
)  # fmt: skip
def test_frame_resize_is_torchvisions(src, dst):
    """Frames resize as transformers' video processor resizes them (torchvision's resize of a uint8 tensor:
    antialiased bicubic in float32, clamped, rounded once), on noise (the sharpest detail there is): within 1
    level on under 0.1 % of values. Pillow's 8-bit resize, used before, rounds between its passes."""
    from PIL import Image

    from worldserve.media.frame_resize import bicubic_antialiased

    frame = np.random.default_rng(sum(src)).integers(0, 256, (*src, 3), dtype=np.uint8)
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float()  # [1, 3, H, W]
    ref = torch.nn.functional.interpolate(x, dst, mode="bicubic", antialias=True, align_corners=False)
    ref = ref.clamp(0, 255).round().to(torch.uint8)[0].permute(1, 2, 0).numpy()  # [h, w, 3]
    diff = np.abs(bicubic_antialiased(frame, dst[1], dst[0]).astype(int) - ref.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    if src != dst:  # (the 8-bit resize this replaced: far off on the same frames)
        old = np.asarray(Image.fromarray(frame).resize(dst[::-1], resample=Image.Resampling.BICUBIC))
        assert np.abs(old.astype(int) - ref.astype(int)).max() > 2
