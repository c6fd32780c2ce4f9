"""The fixed tail of a request: Wan2.2 VAE decode, audio (AVAE) decode, uint8 conversion + copy to the
host, and the MP4 mux (H.264 + AAC), each timed on its own; then the decode and the mux overlapped as the
engine runs them (the mux reading the frames chunk by chunk while the VAE decodes) against one after the other.

The VAE decode is timed as `VideoVAE.decode_pixels` (denormalise + our `WanDecoder`, torch.compile'd on
CUDA as the product runs it; the warm-up decode compiles; bench/vae_decode.py compares it with diffusers' `AutoencoderKLWan.decode` and the compiled decoder); the
uint8 postprocess and the device-to-host copy separately; the audio decode as `AudioVAE.decode` (weight
norm folded, trimmed to the video length). The mux is `worldserve.media.video.encode_mp4` (libx264
ultrafast crf 18 + AAC). Random VAE weights decode to noise-like frames, which x264 compresses far worse
than real video, so the mux is also timed on a smooth synthetic clip of the same size. Optional: a profile
of one VAE decode. (The cudnn.benchmark / channels_last_3d variants of diffusers' decoder that
bench/results/README.md reports were removed with that decoder; our WanDecoder is channels-last on CUDA.)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from worldserve.bench.timing import allocated_gib, free_memory, peak_gib, reset_peak, time_region
from worldserve.bench.workload import Workload

if TYPE_CHECKING:
    from worldserve.models.cosmos3.vae import VideoVAE


def synthetic_clip(w: Workload) -> np.ndarray:
    """A smooth moving gradient (F, H, W, 3) uint8: compresses like real footage, unlike noise."""
    y = np.linspace(0, 1, w.height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, w.width, dtype=np.float32)[None, :]
    out = np.empty((w.num_frames, w.height, w.width, 3), dtype=np.uint8)
    for i in range(w.num_frames):
        s = i / max(w.num_frames - 1, 1)
        out[i, ..., 0] = (255 * (0.5 + 0.5 * np.sin(6.28 * (x + s)))).astype(np.uint8)
        out[i, ..., 1] = (255 * (0.5 + 0.5 * np.cos(6.28 * (y - s)))).astype(np.uint8)
        out[i, ..., 2] = (255 * ((x + y) / 2)).astype(np.uint8)
    return out


def bench_decode(
    w: Workload,
    device: torch.device,
    dtype: torch.dtype,
    *,
    tiny: bool,
    repeats: int,
    log: Callable[[str], None],
    profile_file: Path | None = None,
) -> dict:
    """Time the VAE, audio decode, postprocess and mux for workload `w`; returns a JSON-able dict.

    With `profile_file`, one default decode runs under torch.profiler.
    """
    res: dict = {"workload": w.label}
    # one generator for the video latents, then the audio latents
    g = torch.Generator(device="cpu").manual_seed(1)
    latents = torch.randn(w.latent_shape, generator=g).to(device)  # normalised, as the sampler leaves them
    video, frames = _bench_video_vae(
        latents, w, device, dtype, tiny=tiny, repeats=repeats, log=log, profile_file=profile_file
    )
    res.update(video)
    audio = None
    if w.sound:
        sound, audio = _bench_audio_vae(g, w, device, dtype, tiny=tiny, repeats=repeats, log=log)
        res.update(sound)
    res.update(_time_mux(frames, audio, w))
    return res


def _bench_video_vae(
    latents: torch.Tensor,
    w: Workload,
    device: torch.device,
    dtype: torch.dtype,
    *,
    tiny: bool,
    repeats: int,
    log: Callable[[str], None],
    profile_file: Path | None,
) -> tuple[dict, np.ndarray]:
    """The video VAE's timings (decode, uint8 + copy to the host, decode overlapped with the mux, the optional
    profile) and the decoded frames (F, H, W, 3) uint8. The VAE is dropped and the cache freed before it
    returns, so the audio phase runs without it."""
    from worldserve.bench.models import build_video_vae, param_count

    vae = build_video_vae(device, dtype, tiny=tiny, compile_decoder=device.type == "cuda")  # product default
    res: dict = {
        "vae_params": param_count(vae.model) + (param_count(vae.decoder) if vae.decoder is not None else 0)
    }
    pixels = _time_vae_decode(res, vae, latents, w, device, repeats=repeats, log=log)
    frames = _time_postprocess(res, vae, pixels, device, repeats=repeats)
    # the decoded clip is not kept through the overlapped decodes
    pixels = None  # type: ignore[assignment]
    res.update(overlap_decode_and_mux(vae, latents[0], w, log))
    if profile_file is not None:
        from worldserve.bench.variants import profile_step

        log("profiling one VAE decode")
        res["vae_profile"] = profile_step(lambda: vae.decode_pixels(latents), device, profile_file)
    vae = None  # type: ignore[assignment]  # drop the decoder before the audio phase
    free_memory(device)
    return res, frames


def _time_vae_decode(
    res: dict,
    vae: VideoVAE,
    latents: torch.Tensor,
    w: Workload,
    device: torch.device,
    *,
    repeats: int,
    log: Callable[[str], None],
) -> torch.Tensor:
    """Time `vae.decode_pixels(latents)` (one warm-up) and its peak memory above the memory resident before
    it, into `res`; returns the last decode's pixels."""
    resident = allocated_gib(device)
    reset_peak(device)
    pixels_box: list[torch.Tensor] = []

    def decode() -> None:
        pixels_box[:] = [vae.decode_pixels(latents)]

    log(f"VAE decode {w.label} (warm-up + {repeats})")
    t = time_region(decode, device, warmup=1, repeats=repeats)
    res["vae_decode_s"] = t.to_dict()
    res["vae_peak_gib"] = peak_gib(device)
    res["vae_peak_above_resident_gib"] = res["vae_peak_gib"] - resident
    pixels = pixels_box[0]
    res["decoded_shape"] = list(pixels.shape)
    return pixels


def _time_postprocess(
    res: dict, vae: VideoVAE, pixels: torch.Tensor, device: torch.device, *, repeats: int
) -> np.ndarray:
    """Time the uint8 conversion and the copy to the host of `pixels` (one warm-up), into `res`; returns the
    frames (F, H, W, 3) uint8 of the first clip."""
    frames_box: list[np.ndarray] = []
    t_post = time_region(
        lambda: frames_box.__setitem__(slice(None), [vae.pixels_to_uint8(pixels).cpu().numpy()]),
        device,
        warmup=1,
        repeats=repeats,
    )
    res["postprocess_d2h_s"] = t_post.to_dict()
    return frames_box[0][0]


def _bench_audio_vae(
    g: torch.Generator,
    w: Workload,
    device: torch.device,
    dtype: torch.dtype,
    *,
    tiny: bool,
    repeats: int,
    log: Callable[[str], None],
) -> tuple[dict, np.ndarray]:
    """The audio VAE's timing on random latents drawn from `g` (one warm-up, at least 3 repeats) and its
    decoded waveform; the audio VAE is dropped on return, as the video VAE."""
    from worldserve.bench.models import build_audio_vae, param_count

    avae = build_audio_vae(device, dtype, tiny=tiny)
    res: dict = {"audio_vae_params": param_count(avae.model.decoder)}
    snd = torch.randn((64, w.audio_frames), generator=g).to(device)
    box: list[np.ndarray] = []
    log(f"audio decode {w.audio_frames} latent frames")
    ta = time_region(
        lambda: box.__setitem__(slice(None), [avae.decode(snd, w.audio_samples)]),
        device,
        warmup=1,
        repeats=max(repeats, 3),
    )
    res["audio_decode_s"] = ta.to_dict()
    return res, box[0]


def _time_mux(frames: np.ndarray, audio: np.ndarray | None, w: Workload) -> dict:
    """Wall time and size of the MP4 mux of the decoded frames, then of a smooth synthetic clip of the same
    size (x264 compresses random-weight noise far worse than real video), with the same audio."""
    from worldserve.media.video import encode_mp4

    res: dict = {"mux_encoder": "worldserve.media.video.encode_mp4"}
    for label, clip in (("decoded", frames), ("synthetic", synthetic_clip(w))):
        t0 = time.perf_counter()
        data = encode_mp4(clip, w.fps, audio)
        res[f"mux_{label}_s"] = time.perf_counter() - t0
        res[f"mux_{label}_bytes"] = len(data)
    return res


def overlap_decode_and_mux(
    vae: VideoVAE, latents: torch.Tensor, w: Workload, log: Callable[[str], None]
) -> dict:
    """The decode + MP4 mux wall time as the engine runs a job's (the mux reads the frames chunk by chunk
    in another thread while the VAE decodes: media/frame_stream.py) against one after the other, twice
    each, alternating; the same decoded frames and a stand-in audio track (the audio is decoded first,
    ~0.04 s, so it is not part of either)."""
    from concurrent.futures import ThreadPoolExecutor

    from worldserve.media.frame_stream import FrameStream, lower_thread_priority, read_beside
    from worldserve.media.video import encode_mp4

    audio = None
    if w.sound:
        audio = np.random.default_rng(2).uniform(-0.3, 0.3, (2, w.audio_samples)).astype(np.float32)

    def one_after_the_other() -> bytes:
        return encode_mp4(vae.decode(latents), w.fps, audio)

    def overlapped() -> bytes:
        stream = FrameStream(w.num_frames, w.height, w.width, vae.decode_frames(latents))
        with ThreadPoolExecutor(1, initializer=lower_thread_priority) as pool:  # as the engine's
            return read_beside(stream, lambda frames: encode_mp4(frames, w.fps, audio), pool).result()

    times: dict[str, list[float]] = {"sequential": [], "overlapped": []}
    digests = {}
    log("decode + mux, one after the other vs overlapped (2 each)")
    for _ in range(2):
        for name, run in (("sequential", one_after_the_other), ("overlapped", overlapped)):
            t0 = time.perf_counter()
            digests[name] = hashlib.sha256(run()).hexdigest()
            times[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {f"decode_mux_{name}_s": min(ts) for name, ts in times.items()}
    out["decode_mux_runs_s"] = times
    out["decode_mux_same_bytes"] = digests["sequential"] == digests["overlapped"]
    out["decode_mux_saved_s"] = out["decode_mux_sequential_s"] - out["decode_mux_overlapped_s"]
    return out


def decode_total(res: dict) -> float:
    """Fixed decode tail: audio + the VAE decode overlapped with the mux of its (noise-like) frames as the
    engine runs it; without that measurement, VAE + uint8/D2H + mux of real-looking frames one after the
    other (medians)."""
    total = res["audio_decode_s"]["median"] if "audio_decode_s" in res else 0.0
    if "decode_mux_overlapped_s" in res:
        return total + res["decode_mux_overlapped_s"]
    return (
        total
        + res["vae_decode_s"]["median"]
        + res["postprocess_d2h_s"]["median"]
        + res.get("mux_synthetic_s", 0.0)
    )
