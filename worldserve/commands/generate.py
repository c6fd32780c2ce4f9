"""`worldserve generate [MODEL] --prompt TEXT ... -o out.mp4`: one video (or image) offline, no server.

Bad input fails before the model loads, with the field named (exit code 2). Output by suffix: `.mp4`
(H.264 + AAC 48 kHz stereo), `.png` (text-to-image, num_frames 1), `.npz` (lossless: uint8 frames, float32
audio, fps, sample rate). `--save-latents F.safetensors` also writes the final video and audio latents.
Conditioning: `--image F` (image-to-video) or `--video F` (video-to-video: `--condition-frames 0,1` latent
frames held clean, taken from the `--condition-video-keep first|last` end of the clip). `--lora PATH
[--lora-scale S]` runs with a LoRA adapter (merged into the weights as they load; `--max-lora-rank N`, serve's
flag, refuses one of a higher rank). The flags become a VideoParams in commands/generate_params.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from worldserve.commands.cli_inputs import text_arg
from worldserve.commands.generate_params import build_params, flag_for, flags_said
from worldserve.config import LoraConfig, ModelConfig, ParallelConfig
from worldserve.config_flags import add_config_arguments, config_from_args
from worldserve.config_values import int64_seed
from worldserve.params import (
    DEFAULT_MAX_SEQUENCE_LENGTH,
    NEGATIVE_METADATA_MODES,
    ParamError,
    VideoParams,
)

if TYPE_CHECKING:
    from worldserve.engine.outputs import VideoResult
    from worldserve.runner.parallel_pipeline import ParallelPipeline
    from worldserve.runner.video_pipeline import VideoPipeline
    from worldserve.runner.video_state import VideoRequestState

GENERATE_MODEL_FLAGS = (
    "revision", "device", "dtype", "quantization", "fp8_attention", "diffusion_attention_backend",
    "enforce_eager", "vae_tiling",
)  # fmt: skip
"""The ModelConfig fields `generate` takes as flags (serve's own: the server's, such as --served-model-name,
are not)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`worldserve generate`'s flags, in --help's order."""
    _add_input_arguments(p)
    _add_sampling_arguments(p)
    _add_prompt_template_arguments(p)
    _add_adapter_and_output_arguments(p)
    # the model, kernel and parallel flags are serve's own (config.py)
    add_config_arguments(p, ModelConfig, only=GENERATE_MODEL_FLAGS)
    add_config_arguments(p, ParallelConfig)
    add_config_arguments(p, LoraConfig, only=("max_lora_rank",))  # (serve's bound on --lora's rank)


def _add_input_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the prompt and the conditioning inputs (image, video)."""
    p.add_argument(
        "model", nargs="?", default=None, help="folder or HF repo id (default: embedded tiny model)"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=text_arg, help="plain text or a JSON document")
    src.add_argument(
        "--prompt-file", type=Path, help="read the prompt from a file (e.g. a JSON prompt; - reads stdin)"
    )
    p.add_argument(
        "--negative-prompt", type=text_arg, default=None, help="default: the shipped Cosmos3 negative prompt"
    )
    p.add_argument("--image", type=Path, default=None, help="conditioning image for image-to-video")
    p.add_argument("--video", type=Path, default=None, help="conditioning clip for video-to-video")
    p.add_argument(
        "--condition-frames", default=None,
        help="V2V: latent frames held clean, comma-separated (default 0,1: the clip's first 5 frames)",
    )  # fmt: skip
    p.add_argument(
        "--condition-video-keep", default=None, choices=("first", "last"),
        help="V2V: take the conditioning frames from the first (default) or the last end of the clip",
    )  # fmt: skip


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """Size, frames and the sampler's knobs."""
    # an image (--num-frames 1) takes the text-to-image defaults of /v1/images/generations (IMAGE_DEFAULTS)
    p.add_argument(
        "--size", default=None, help="WIDTHxHEIGHT, multiples of 16 (default 1280x720; an image 1024x1024)"
    )
    p.add_argument("--num-frames", type=int, default=189, help="1 (an image) or 4k+1 (default 189)")
    p.add_argument("--fps", type=float, default=24.0, help="frames a second (default 24)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 35; an image 50)")
    p.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="CFG scale; 1 runs one branch (default 6; an image 7, inside --guidance-interval)",
    )
    p.add_argument(
        "--flow-shift", type=float, default=None, help="default: 10 / 5 / 3 by resolution tier; an image 3"
    )
    p.add_argument("--guidance-interval", default=None, metavar="LO,HI",
                   help="CFG only at timesteps (0..1000) in [LO, HI], e.g. 400,1000; default: every step (an "
                   "image: 400,1000)")  # fmt: skip
    p.add_argument("--seed", type=int64_seed, default=42, help="initial noise seed (default 42)")
    p.add_argument("--no-sound", action="store_true", help="no joint audio")
    p.add_argument("--max-sequence-length", type=int, default=DEFAULT_MAX_SEQUENCE_LENGTH,
                   help="prompt tokens after templating; a longer prompt is an error (with --upsample-prompt: "
                   f"the prompt the Reasoner writes) (default {DEFAULT_MAX_SEQUENCE_LENGTH})")  # fmt: skip


def _add_prompt_template_arguments(p: argparse.ArgumentParser) -> None:
    """What the reference adds to the prompts (templates, system message) and prompt upsampling."""
    p.add_argument("--no-duration-template", action="store_true",
                   help="leave out the duration / fps sentence (or JSON keys) the reference adds to the prompts")  # fmt: skip
    p.add_argument("--no-resolution-template", action="store_true",
                   help="leave out the resolution sentence (or JSON keys) the reference adds to the prompts")  # fmt: skip
    p.add_argument("--negative-metadata", choices=NEGATIVE_METADATA_MODES, default="same",
                   help="the metadata sentences on the negative prompt: same as the prompt's (the reference), "
                   "inverse ('is not', as diffusers), none")  # fmt: skip
    p.add_argument("--use-system-prompt", action="store_true", help="prepend the reference's system message")
    p.add_argument("--system-prompt", type=text_arg, default=None, help="a system message of your own")
    p.add_argument("--upsample-prompt", action="store_true",
                   help="have the checkpoint's Reasoner rewrite the prompt into Cosmos3's JSON prompt first")  # fmt: skip


def _add_adapter_and_output_arguments(p: argparse.ArgumentParser) -> None:
    """The LoRA adapter and the output files."""
    p.add_argument("--lora", type=Path, default=None, metavar="PATH",
                   help="run with this LoRA adapter: a PEFT folder, or a diffusers LoRA file or its folder")  # fmt: skip
    p.add_argument("--lora-scale", type=float, default=None,
                   help="the --lora adapter's scale (default 1.0; 0 runs the base model)")  # fmt: skip
    p.add_argument("-o", "--output", type=Path, required=True, help="out.mp4, out.png or out.npz")
    p.add_argument("--save-latents", type=Path, default=None, help="also write final latents (.safetensors)")


def _upsampled(
    args: argparse.Namespace, params: VideoParams, pipe: VideoPipeline | ParallelPipeline, root: Path
) -> VideoParams:
    """`params` with the prompt the Reasoner wrote (engine/prompt_upsampling.py), on the pipeline's own
    transformer (its K/V pool freed afterwards); printed to stderr."""
    import gc

    import torch

    from worldserve.engine.prompt_upsampling import UpsamplerConfig, check_upsampling, upsample_with
    from worldserve.runner.reasoner import Reasoner

    t0 = time.perf_counter()
    reasoner = Reasoner.from_pretrained(root, pipe.transformer, pipe.encoder.tokenizer, max_model_len=16384,
                                        max_num_seqs=1, kv_cache_tokens=16384, enforce_eager=args.enforce_eager,
                                        chat_sm_margin=0)  # fmt: skip
    try:
        # (a brief leaving the answer too little context: one line naming --prompt, as the server's 400)
        check_upsampling(reasoner, params, UpsamplerConfig())
        prompt = upsample_with(reasoner, params)
    finally:
        del reasoner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"upsampled prompt ({time.perf_counter() - t0:.1f} s): {prompt}", file=sys.stderr)
    return dataclasses.replace(params, prompt=prompt, upsample_prompt=False)


def streams_to(path: Path) -> bool:
    """Whether an output at `path` is muxed while the VAE decodes (an MP4; npz and PNG take whole frames)."""
    return path.suffix.lower() not in (".npz", ".png")


def write_output(path: Path, result: VideoResult) -> None:
    """`result` as `path` (.npz raw, .png the first frame, else MP4). A FrameStream's frames are muxed in
    another thread while this one decodes them, as the server does (media/frame_stream.py). Each is written
    whole or not at all: a failed or interrupted write leaves `path` as it was (media/atomic_write.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from worldserve.media.atomic_write import write_atomically
    from worldserve.media.frame_stream import FrameStream, read_beside
    from worldserve.media.image import encode_png
    from worldserve.media.video import encode_mp4, write_npz

    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    frames = result.frames
    if isinstance(frames, FrameStream) and streams_to(path):
        with ThreadPoolExecutor(1) as pool:
            mux = read_beside(
                frames, lambda f: encode_mp4(f, result.fps, result.audio, result.sample_rate), pool
            )
            write_atomically(path, mux.result())
        return
    if isinstance(frames, FrameStream):  # (npz and PNG take whole frames)
        frames = frames.to_array()
    if suffix == ".npz":
        write_npz(path, frames, result.audio, result.fps, result.sample_rate)
    elif suffix == ".png":
        write_atomically(path, encode_png(frames[0]))
    else:
        write_atomically(path, encode_mp4(frames, result.fps, result.audio, result.sample_rate))


def run(args: argparse.Namespace) -> int:
    try:  # serve's checks of the same flags, before any input is read (an --image may be 4 GiB)
        model = config_from_args(ModelConfig, args)
        par = config_from_args(ParallelConfig, args)
    except ValueError as e:
        print(f"worldserve generate: error: {e}", file=sys.stderr)
        return 2
    try:
        params = build_params(args)
    except ParamError as e:
        flag, message = flag_for(e.param, args), flags_said(e.message, args)  # (prose: the flags' names too)
        said = message if message.startswith(f"{flag} ") else f"{flag}: {message}"  # (not "-o: -o ...")
        print(f"worldserve generate: error: {said}", file=sys.stderr)
        return 2
    import torch

    from worldserve.parallel.comm import PeerError
    from worldserve.runner.devices import check_layout_device
    from worldserve.runner.lora_cache import check_adapter_fits
    from worldserve.runner.video_pipeline import load_pipeline
    from worldserve.weights.checkpoint import resolve_model

    t0 = time.perf_counter()
    try:  # before the checkpoint is resolved (an HF id may download it)
        check_layout_device(
            model.device,
            cfg_parallel_size=par.cfg_parallel_size,
            ulysses_degree=par.ulysses_degree,
            tensor_parallel_size=par.tensor_parallel_size,
        )
    except ValueError as e:
        print(f"worldserve generate: error: {e}", file=sys.stderr)
        return 2
    root = resolve_model(model.model, model.revision)
    if model.model is None:
        print(f"using the embedded tiny random checkpoint {root}: its output is noise", file=sys.stderr)
    try:
        kernels = model.kernel_options(enable_layerwise_offload=par.enable_layerwise_offload)
        if params.lora is not None:  # the run's only adapter: merged into the weights as they load
            check_adapter_fits(root, params.lora, "--lora", args.max_lora_rank)
            kernels = dataclasses.replace(kernels, merged_lora=params.lora)
        pipe = load_pipeline(
            root, cfg_parallel_size=par.cfg_parallel_size, ulysses_degree=par.ulysses_degree,
            tensor_parallel_size=par.tensor_parallel_size, device=model.device,
            dtype=getattr(torch, model.dtype) if model.dtype else None, vae_tiling=model.vae_tiling,
            kernels=kernels, max_lora_rank=args.max_lora_rank,
        )  # fmt: skip
    except ValueError as e:  # e.g. --quantization fp8 without fp8 GEMMs, --cfg-parallel-size 2 on 1 GPU
        print(f"worldserve generate: error: {e}", file=sys.stderr)
        return 2
    except PeerError as e:  # a peer rank died at start-up (its own log says why): one line, not a traceback
        print(f"worldserve generate: error: {e}", file=sys.stderr)
        return 1
    try:
        return _generate(args, params, pipe, time.perf_counter() - t0, root)
    finally:
        pipe.close()


def _generate(
    args: argparse.Namespace,
    params: VideoParams,
    pipe: VideoPipeline | ParallelPipeline,
    load_s: float,
    root: Path,
) -> int:
    """Generate `params` on the loaded `pipe` and write `args.output` (and --save-latents): 0, or the exit
    code after one line on stderr (2: the model refuses the params; 1: a peer rank died or a write failed)."""
    from tqdm.auto import tqdm

    checked_params = _model_checked(args, params, pipe, root)
    if checked_params is None:
        return 2
    params = checked_params
    stream = streams_to(args.output)  # the VAE decode then runs in write_output, beside the mux
    from worldserve.engine.outputs import BackendLost

    try:
        with tqdm(total=params.num_inference_steps, desc="Denoising", unit="step") as bar:
            result, state = pipe.generate(params, on_step=lambda done, total: bar.update(1), stream=stream)
    except BackendLost as e:  # a peer rank of a multi-GPU layout died: its own log holds the traceback
        print(f"worldserve generate: error: {e}", file=sys.stderr)
        return 1
    # the writes' own failures (a full disk, a folder gone since the checks) are one line naming the flag; the
    # latents go first, so that a failed -o still leaves the denoised state to decode again
    if args.save_latents is not None and not _save_latents(args.save_latents, state):
        return 1
    t1 = time.perf_counter()
    try:
        write_output(args.output, result)
    except OSError as e:
        print(
            f"worldserve generate: error: -o {args.output}: cannot write it ({e.strerror or e})",
            file=sys.stderr,
        )
        return 1
    encoded = time.perf_counter() - t1
    stages = {"load": load_s, **result.stage_seconds, "decode + encode" if stream else "encode": encoded}
    print(f"wrote {args.output}")
    for name, seconds in stages.items():
        print(f"  {name:16s} {seconds:8.3f} s")
    return 0


def _model_checked(
    args: argparse.Namespace, params: VideoParams, pipe: VideoPipeline | ParallelPipeline, root: Path
) -> VideoParams | None:
    """`params` checked against the model (and, with --upsample-prompt, rewritten by the Reasoner and checked
    again); None once the refusal is printed, naming the flag."""
    from worldserve.engine.prompt_upsampling import UpsamplingFailed, checked, model_checked

    try:
        model_checked(pipe.validate, params)
        if params.upsample_prompt:
            # (the written prompt past max_sequence_length: an error naming that limit, not the prompt)
            params = checked(pipe.validate, _upsampled(args, params, pipe, root))
    except (ParamError, UpsamplingFailed, ValueError) as e:
        named = isinstance(e, (ParamError, UpsamplingFailed))
        where = (
            f"{flag_for(getattr(e, 'param', None), args)}: {flags_said(str(e), args)}" if named else str(e)
        )
        print(f"worldserve generate: error: {where}", file=sys.stderr)
        return None
    return params


def _save_latents(path: Path, state: VideoRequestState) -> bool:
    """The final video (and sound) latents as safetensors at `path` (--save-latents), written whole or not at
    all (media/atomic_write.py); False once a failed write is printed."""
    from safetensors import SafetensorError
    from safetensors.torch import save

    from worldserve.media.atomic_write import write_atomically

    tensors = {"video_latents": state.latents.cpu().contiguous()}
    if state.sound is not None:
        tensors["sound_latents"] = state.sound.cpu().contiguous()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # as -o's
        # written as -o is (the umask's mode: save_file's temporary file left it 0600)
        write_atomically(path, save(tensors))
    except (OSError, SafetensorError) as e:
        print(f"worldserve generate: error: --save-latents {path}: cannot write it ({e})",
              file=sys.stderr)  # fmt: skip
        return False
    return True
