"""End-to-end full-size generation on a GPU with random weights: 1280x720, 189 frames, 35 steps, CFG 6, audio.

Builds the real Cosmos3-Nano shapes (15.2B transformer, Wan2.2 VAE, AVAE decoder) with random bf16 weights
behind our VideoPipeline (no checkpoint can be downloaded here), runs one text-to-video + audio request
through prepare / 35 denoise steps / decode, muxes the MP4 (H.264 + AAC 48 kHz stereo), decodes it back to
check the streams, and writes per-stage times as JSON. The decode and the mux overlap as in the engine
(`decode_and_mux` in the stages: the decode's wall time plus the mux's tail). The output is noise by construction.

    PYTHONPATH=. python bench/e2e_generate.py --out $OUT [--steps 35] [--size 1280x720] [--frames 189]
    PYTHONPATH=. python bench/e2e_generate.py --out $OUT --steps 3 --warmup --enable-layerwise-offload --memory-cap-gib 32

`--enable-layerwise-offload` moves the transformer's layers to pinned host memory as the product flag does;
`--memory-cap-gib G` then caps this process's GPU memory at G GiB (torch.cuda.set_per_process_memory_fraction),
the way to check that a request fits a smaller card.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

EXAMPLE_PROMPT = json.dumps(
    {
        "subjects": [{"description": "a red fox", "action": "runs through fresh snow"}],
        "background_setting": "a pine forest at dawn",
        "cinematography": {"camera_motion": "slow pan right", "framing": "wide shot"},
        "audio_description": "wind in the trees, soft crunch of snow",
    }
)


def decode_and_mux(pipe, state):
    """The engine's decode tail: audio, then the VAE decode with the MP4 mux reading its frames chunk by
    chunk in another thread (media/frame_stream.py) -> (VideoResult, MP4 bytes)."""
    from concurrent.futures import ThreadPoolExecutor

    from worldserve.media.frame_stream import lower_thread_priority, read_beside
    from worldserve.media.video import encode_mp4

    result = pipe.decode(state, stream=True)
    with ThreadPoolExecutor(1, initializer=lower_thread_priority) as pool:  # as the engine's
        mux = read_beside(
            result.frames,
            lambda frames: encode_mp4(frames, result.fps, result.audio, result.sample_rate),
            pool,
        )
        return result, mux.result()


def build_pipeline(device: torch.device, seed: int = 0, tiny: bool = False, offload: bool = False):
    from worldserve.bench.models import build_audio_vae, build_our_transformer, build_video_vae
    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.models.cosmos3.prompt import PromptEncoder
    from worldserve.runner.kernel_options import KernelOptions
    from worldserve.runner.video_pipeline import VideoPipeline
    from worldserve.weights.tokenizer_fixture import write_tiny_tokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = Cosmos3Config.tiny(vocab_size=2048) if tiny else Cosmos3Config.nano()
    transformer = build_our_transformer(config, device, dtype, None, seed)
    if offload:
        for layer in transformer.layers:  # where KernelOptions.load_device puts them at load time
            layer.to("cpu")
        torch.cuda.empty_cache()
    kernels = KernelOptions(layerwise_offload=offload)  # otherwise VideoPipeline.from_pretrained's default
    print("transformer kernels:", kernels.apply(transformer, device))
    vae = build_video_vae(  # plain convs under offload, as the product (VideoPipeline.from_pretrained)
        device, dtype, tiny=tiny, compile_decoder=device.type == "cuda", time_winograd=not offload
    )
    audio = build_audio_vae(device, dtype, tiny=tiny)
    tok_dir = Path(tempfile.mkdtemp()) / "text_tokenizer"
    write_tiny_tokenizer(tok_dir)  # the real Qwen tokenizer is not available offline; ids are a subset
    return VideoPipeline(transformer, vae, audio, PromptEncoder.from_pretrained(tok_dir), device)


def main() -> None:
    from worldserve.params import VideoParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--frames", type=int, default=189)
    ap.add_argument(
        "--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test of this script)"
    )
    ap.add_argument(
        "--warmup",
        action="store_true",
        help="first run a 1-step request of the same shape (compiles everything)",
    )
    ap.add_argument(
        "--enable-layerwise-offload", action="store_true", help="the transformer layers on the host"
    )
    ap.add_argument("--memory-cap-gib", type=float, default=None, help="cap this process's GPU memory (GiB)")
    ap.add_argument(
        "--profile-step", type=int, default=None,
        help="run denoising step K (0-based) under torch.profiler: kernel table, time by kernel category and "
        "where the GPU waited for the host (its step time then includes the profiler's overhead)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.profile_step is not None and not 0 <= args.profile_step < args.steps:
        ap.error(f"--profile-step must be in [0, {args.steps}), got {args.profile_step}")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny else "cuda", None if args.tiny else torch.cuda.current_device())
    t0 = time.perf_counter()
    pipe = build_pipeline(device, tiny=args.tiny, offload=args.enable_layerwise_offload)
    build_s = time.perf_counter() - t0
    if args.memory_cap_gib and device.type == "cuda":
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / total, device)
    w, h = (int(x) for x in args.size.split("x"))
    params = VideoParams(
        prompt=EXAMPLE_PROMPT,
        width=w,
        height=h,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        seed=123,
    )
    warmup_s = None
    if args.warmup:
        t = time.perf_counter()
        pipe.generate(dataclasses.replace(params, num_inference_steps=1, seed=1))
        warmup_s = time.perf_counter() - t
    step_times: list[float] = []
    last = [time.perf_counter()]

    def on_step(done: int, total: int) -> None:
        now = time.perf_counter()
        step_times.append(now - last[0])
        last[0] = now
        print(f"step {done}/{total}: {step_times[-1]:.3f} s", flush=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t1 = time.perf_counter()
    pipe.validate(params)
    state = pipe.prepare("e2e", params)
    profile = None
    while not state.done:
        if state.step_index == args.profile_step:
            from worldserve.bench.variants import profile_step

            profile = profile_step(lambda: pipe.denoise([state]), device, args.out / "profile_e2e_step.txt")
        else:
            pipe.denoise([state])
        on_step(state.step_index, state.num_steps)
    tiling = False
    t2 = time.perf_counter()
    try:
        result, mp4 = decode_and_mux(pipe, state)
    except torch.OutOfMemoryError:
        print("decode ran out of memory untiled; retrying the decode with VAE tiling", flush=True)
        torch.cuda.empty_cache()
        pipe.vae.model.enable_tiling()
        tiling = True
        t2 = time.perf_counter()
        result, mp4 = decode_and_mux(pipe, state)
    t3 = time.perf_counter()
    decode_mux_s = t3 - t2
    import io

    import av

    with av.open(io.BytesIO(mp4)) as c:
        vs, aus = c.streams.video[0], c.streams.audio[0]
        n_frames = sum(1 for _ in c.decode(vs))
        probe = {
            "video_codec": vs.codec_context.name,
            "pix_fmt": vs.codec_context.pix_fmt,
            "frames": n_frames,
            "fps": float(vs.average_rate),
            "audio_codec": aus.codec_context.name,
            "sample_rate": aus.codec_context.sample_rate,
            "channels": aus.codec_context.channels,
            "bytes": len(mp4),
        }
    report = {
        "command": "PYTHONPATH=. python bench/e2e_generate.py "
        + " ".join([f"--steps {args.steps}", f"--size {args.size}", f"--frames {args.frames}"])
        + (" --warmup" if args.warmup else "")
        + (" --enable-layerwise-offload" if args.enable_layerwise_offload else "")
        + (f" --memory-cap-gib {args.memory_cap_gib:g}" if args.memory_cap_gib else "")
        + (f" --profile-step {args.profile_step}" if args.profile_step is not None else ""),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "build_random_model_s": build_s,
        "warmup_request_s": warmup_s,
        "generate_s": t3 - t1,  # request start to MP4 bytes
        "stages_s": {**result.stage_seconds, "decode_and_mux": decode_mux_s},
        "step_s": step_times,
        "median_step_s": sorted(step_times)[len(step_times) // 2],
        "vae_tiling": tiling,
        "layerwise_offload": args.enable_layerwise_offload,
        "memory_cap_gib": args.memory_cap_gib,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
        "mp4": probe,
        # its step time (in step_s and generate_s) includes the profiler's overhead
        "profiled_step": None
        if profile is None
        else {"index": args.profile_step, "step_s": step_times[args.profile_step], **profile},
    }
    (args.out / "e2e_generate.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "step_s"}, indent=2))


if __name__ == "__main__":
    main()
