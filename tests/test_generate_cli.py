"""`worldserve generate` end to end on the tiny checkpoint: MP4 / PNG / NPZ outputs decoded back, latents file,
and bad input rejected before any model work with the field named. One run is a real subprocess; the rest
call the same `main` in this process (tests/cli_helpers.py)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli_helpers import run_cli
from media_probe import probe_mp4
from PIL import Image
from safetensors.torch import load_file
from serving_helpers import mp4_bytes

SMALL = ["--size", "80x48", "--num-frames", "9", "--steps", "2", "--negative-prompt", ""]


def _generate(*args, check=True):
    """`worldserve generate ARGS` in this process (tests/cli_helpers.py); a non-zero exit fails when `check`."""
    proc = run_cli("generate", *args)
    assert not check or proc.returncode == 0, proc.stderr
    return proc


def test_t2v_with_sound_to_mp4_and_latents(tiny_ckpt, tmp_path):
    """The one run through a real `python -m worldserve.cli generate` subprocess, as a user starts it."""
    out, lat = tmp_path / "out.mp4", tmp_path / "new" / "lat.safetensors"  # its folder made, as -o's are
    argv = [tiny_ckpt, "--prompt", "a cat", *SMALL, "--fps", "24", "-o", out, "--save-latents", lat]
    proc = subprocess.run([sys.executable, "-m", "worldserve.cli", "generate", *map(str, argv)],
                          capture_output=True, text=True, check=True, timeout=300)  # fmt: skip
    assert f"wrote {out}" in proc.stdout and "diffuse" in proc.stdout and "vae.decode" in proc.stdout
    assert "decode + encode" in proc.stdout, "an MP4 is muxed while the VAE decodes"
    info = probe_mp4(out.read_bytes())
    assert info.video_codec == "h264" and info.pix_fmt == "yuv420p"
    assert info.num_frames == 9 and abs(info.fps - 24) < 1e-6
    assert info.audio_codec == "aac" and info.sample_rate == 48000 and info.channels == 2
    assert abs(info.audio_duration - 9 / 24) < 0.05
    tensors = load_file(lat)
    # the latents' mode is the MP4's (the umask's; safetensors' save_file had left them 0600)
    assert lat.stat().st_mode & 0o777 == out.stat().st_mode & 0o777
    assert tuple(tensors["video_latents"].shape) == (48, 3, 3, 5)
    assert tuple(tensors["sound_latents"].shape) == (64, 10)


def test_a_multi_rank_run_exits_without_leaking(tiny_ckpt, tmp_path):
    """--cfg-parallel-size 2 on CPU through a real subprocess: the uncond rank, a process of its own ended with
    os._exit, leaves nothing to the resource tracker (a disabled tqdm's multiprocessing lock had made it warn
    "leaked semaphore objects" at every exit)."""
    out = tmp_path / "out.npz"
    argv = [tiny_ckpt, "--prompt", "a cat", *SMALL[:-2], "--negative-prompt", "blurry", "--no-sound",
            "--cfg-parallel-size", "2", "--device", "cpu", "-o", out]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "worldserve.cli", "generate", *map(str, argv)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert np.load(out)["frames"].shape == (9, 48, 80, 3)
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr


def test_i2v_and_npz(tiny_ckpt, tmp_path):
    img = tmp_path / "in.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 50, 3), dtype=np.uint8)).save(img)
    out = tmp_path / "out.npz"
    _generate(tiny_ckpt, "--prompt", "a cat", *SMALL, "--image", img, "--no-sound", "-o", out,
              "--no-duration-template", "--system-prompt", "You render documentaries.",
              "--guidance-interval", "400,1000")  # fmt: skip
    data = np.load(out)
    assert data["frames"].shape == (9, 48, 80, 3) and data["frames"].dtype == np.uint8
    assert "audio" not in data and float(data["fps"]) == 24.0


def test_upsampled_prompt_is_the_one_generated_from(tiny_ckpt, tmp_path, monkeypatch):
    """--upsample-prompt: the Reasoner writes a JSON prompt (printed), and the frames equal a run given it.
    Its fields are bounded short (the random tiny model fills each to its bound: ~2,400 tokens by default)."""
    import functools
    import json

    from worldserve.engine import prompt_upsampling

    short = prompt_upsampling.UpsamplerConfig(max_chars=12, max_subjects=1, max_actions=1)
    monkeypatch.setattr(prompt_upsampling, "upsample_with",
                        functools.partial(prompt_upsampling.upsample_with, config=short))  # fmt: skip
    up, direct = tmp_path / "up.npz", tmp_path / "direct.npz"
    proc = _generate(tiny_ckpt, "--prompt", "a cat", *SMALL, "--upsample-prompt", "--no-sound", "-o", up)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("upsampled prompt ("))
    prompt = line.split("): ", 1)[1]
    assert "subjects" in json.loads(prompt)
    _generate(tiny_ckpt, "--prompt", prompt, *SMALL, "--no-sound", "-o", direct)
    assert np.array_equal(np.load(up)["frames"], np.load(direct)["frames"])


def test_a_brief_too_long_to_upsample_is_one_line_naming_the_prompt(tiny_ckpt, tmp_path):
    """--upsample-prompt with a prompt that leaves the Reasoner's answer too little context: refused in one
    line naming --prompt before the chat (it ran, and its cut answer failed as "not complete JSON"); past
    --max-sequence-length alone it is not refused (the Reasoner's input, not the gen tower's)."""
    proc = _generate(tiny_ckpt, "--prompt", "a red fox runs " * 3500, *SMALL, "--upsample-prompt",
                     "--no-sound", "-o", tmp_path / "x.npz", check=False)  # fmt: skip
    assert proc.returncode == 2 and "error: --prompt: the prompt is too long to upsample" in proc.stderr, (
        proc.stderr
    )
    assert "upsampled prompt (" not in proc.stderr and not (tmp_path / "x.npz").exists()


def test_v2v_npz(tiny_ckpt, tmp_path):
    from worldserve.media.video import encode_mp4

    clip = tmp_path / "in.mp4"
    src = np.random.default_rng(0).integers(0, 255, (7, 32, 48, 3), dtype=np.uint8)
    clip.write_bytes(encode_mp4(src, fps=8.0, audio=None))
    out = tmp_path / "out.npz"
    _generate(tiny_ckpt, "--prompt", "a cat", *SMALL, "--video", clip, "--condition-video-keep", "last",
              "--condition-frames", "0", "--no-sound", "-o", out)  # fmt: skip
    assert np.load(out)["frames"].shape == (9, 48, 80, 3)


def test_layerwise_offload_gives_the_same_frames(tiny_ckpt, tmp_path):
    """The offloaded transformer gives bitwise the same latents and audio; the frames agree to float
    rounding (under offload the VAE decodes with plain Conv3d calls, not the Winograd convs: ~1e-7 apart,
    at most one uint8 step after rounding)."""
    from safetensors.numpy import load_file

    outs = [tmp_path / "plain.npz", tmp_path / "offload.npz"]
    for out, extra in zip(outs, ([], ["--enable-layerwise-offload"]), strict=True):
        _generate(tiny_ckpt, "--prompt", "a cat", *SMALL, "--device", "cpu", *extra, "-o", out,
                  "--save-latents", out.with_suffix(".safetensors"))  # fmt: skip
    plain, offload = (np.load(o) for o in outs)
    latents = [load_file(o.with_suffix(".safetensors")) for o in outs]
    assert latents[0].keys() == latents[1].keys()
    assert all(np.array_equal(latents[0][k], latents[1][k]) for k in latents[0])
    assert np.array_equal(plain["audio"], offload["audio"])
    assert np.abs(plain["frames"].astype(int) - offload["frames"].astype(int)).max() <= 1


def test_t2i_png(tiny_ckpt, tmp_path):
    out = tmp_path / "img.png"
    prompt = tmp_path / "p.json"
    prompt.write_text('{"subjects": [{"description": "a lighthouse"}], "style_medium": "photo"}')
    _generate(
        tiny_ckpt, "--prompt-file", prompt, "--size", "64x64", "--num-frames", "1", "--steps", "2", "-o", out
    )
    with Image.open(io.BytesIO(out.read_bytes())) as im:
        assert im.size == (64, 64) and im.mode == "RGB"


def test_a_still_takes_the_images_routes_defaults_and_a_video_the_videos():
    """`generate --num-frames 1` with no --size / --steps / --guidance / --flow-shift / --guidance-interval
    makes the image /v1/images/generations makes (it took the video defaults: 35 steps, guidance 6 at every
    step, the 720p tier's shift 10); flags given win; a video keeps the video defaults."""
    from worldserve.api.images_protocol import ImageGenerationRequest
    from worldserve.api.images_protocol import build_params as image_params
    from worldserve.cli import build_parser
    from worldserve.commands.generate_params import build_params

    def params(*argv):
        argv = ["generate", "--prompt", "a lighthouse", "-o", "out.npz", *argv]
        return build_params(build_parser(argv).parse_args(argv))

    still = params("--num-frames", "1")
    route = image_params(ImageGenerationRequest(prompt="a lighthouse", seed=42))[0]
    fields = ("width", "height", "num_inference_steps", "guidance_scale", "guidance_interval")
    assert [getattr(still, f) for f in fields] == [getattr(route, f) for f in fields]
    assert still.resolved_flow_shift() == route.resolved_flow_shift() == 3.0
    given = params("--num-frames", "1", "--size", "64x64", "--steps", "2", "--guidance", "4", "--flow-shift", "5",
                   "--guidance-interval", "0,1000")  # fmt: skip
    assert (given.width, given.num_inference_steps, given.guidance_scale, given.flow_shift) == (
        64,
        2,
        4.0,
        5.0,
    )
    assert given.guidance_interval == (0.0, 1000.0)
    video = params()
    assert (video.width, video.height, video.num_frames, video.num_inference_steps) == (1280, 720, 189, 35)
    assert (video.guidance_scale, video.guidance_interval, video.resolved_flow_shift()) == (6.0, None, 10.0)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--size", "81x48"], "--size"),
        (["--size", "1920x1080"], "--size"),
        (["--size", "wide"], "--size"),
        (["--num-frames", "10"], "--num-frames"),
        (["--num-frames", "401", "--size", "320x192"], "--num-frames"),
        (["--steps", "0"], "--steps"),
        (["--image", "/nonexistent.png"], "--image"),
        (["--image", __file__], "--image"),
        (["--max-sequence-length", "5"], "--prompt"),
        (["--video", __file__], "--video"),
        (["--video", "/nonexistent.mp4"], "--video"),
        (["--condition-frames", "a,b", "--video", "/nonexistent.mp4"], "--condition-frames"),
        (["--condition-frames", "0"], "--condition-frames"),  # (without --video: dropped in silence)
        (["--condition-video-keep", "last"], "--condition-video-keep"),
        (["--guidance-interval", "400"], "--guidance-interval"),
        (["--guidance-interval", "900,400"], "--guidance-interval"),
        (["--upsample-prompt", "--tensor-parallel-size", "2"], "--upsample-prompt"),
        (["--guidance", "0"], "--guidance"),  # (it generated without the prompt; the API takes 0 as 6)
    ],
)
def test_bad_input_names_the_field(tiny_ckpt, tmp_path, args, field):
    proc = _generate(tiny_ckpt, "--prompt", "a cat", *args, "-o", tmp_path / "x.mp4", check=False)
    assert proc.returncode == 2, proc.stderr
    assert re.search(f"error: {re.escape(field)}[: ]", proc.stderr), proc.stderr  # (named once: not "-o: -o")
    assert not (tmp_path / "x.mp4").exists()


def test_the_model_s_refusals_name_flags_not_api_fields(tiny_ckpt, tmp_path):
    """A check the model makes after the load words its limits as the API's fields: the line says the flags
    (it said "raise max_sequence_length" to a user who had typed --max-sequence-length)."""
    proc = _generate(tiny_ckpt, "--prompt", "a red fox runs through the snow", "--max-sequence-length", "5",
                     *SMALL, "-o", tmp_path / "x.mp4", check=False)  # fmt: skip
    assert proc.returncode == 2 and "--max-sequence-length" in proc.stderr, proc.stderr
    assert "max_sequence_length" not in proc.stderr, proc.stderr


def test_refusals_before_the_load_word_the_flags_too(tiny_ckpt, tmp_path):
    """A bad --condition-frames index: the line names the flag and its prose does not say the API's
    `condition_frame_indexes_vision`."""
    video = tmp_path / "clip.mp4"
    video.write_bytes(mp4_bytes(frames=12))
    proc = _generate(tiny_ckpt, "--prompt", "a cat", *SMALL, "--video", video, "--condition-frames", "9",
                     "-o", tmp_path / "x.mp4", check=False)  # fmt: skip
    assert proc.returncode == 2 and "error: --condition-frames index 9 is outside" in proc.stderr, proc.stderr
    assert "condition_frame_indexes" not in proc.stderr, proc.stderr


def test_flags_said_rewrites_only_request_fields():
    from argparse import Namespace

    from worldserve.commands.generate_params import flags_said

    args = Namespace(video=None, prompt="x")
    said = flags_said("above max_sequence_length=3; extra_params.condition_frame_indexes_vision index 9; "
                      "leave upsample_prompt off; my_clip_file.mp4; see --max-sequence-length", args)  # fmt: skip
    assert said == ("above --max-sequence-length=3; --condition-frames index 9; leave --upsample-prompt off; "
                    "my_clip_file.mp4; see --max-sequence-length")  # fmt: skip


def test_prompt_files(tmp_path, monkeypatch, capsys):
    """--prompt-file: an editor's byte-order mark is dropped (it hid a JSON prompt's `{`: the prompt went in as
    text, its metadata keys not injected); `-` reads standard input; a file past 16 MiB, or one that never
    ends, is refused, as are the prompt's own errors, naming --prompt-file (they named --prompt)."""
    import io

    from worldserve.cli import build_parser, main
    from worldserve.commands.generate_params import build_params

    def params(*argv):
        return build_params(build_parser(["generate"]).parse_args(["generate", *argv, "-o", "x.mp4"]))

    (tmp_path / "bom.json").write_bytes(b'\xef\xbb\xbf{"caption": "a red fox"}')
    assert params("--prompt-file", str(tmp_path / "bom.json")).prompt == '{"caption": "a red fox"}'
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a fox from stdin")))
    assert params("--prompt-file", "-").prompt == "a fox from stdin"
    for name, body, said in (("big.txt", b"a" * ((16 << 20) + 1), "larger than 16 MiB"),
                             ("blank.txt", b"  \n", "prompt must be")):  # fmt: skip
        (tmp_path / name).write_bytes(body)
        assert main(["generate", "--prompt-file", str(tmp_path / name), "-o", str(tmp_path / "x.mp4")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("worldserve generate: error: --prompt-file") and said in err, err


def test_an_output_that_is_an_input_is_refused(tmp_path):
    """-o naming the --prompt-file / --image / --video it reads (-o in.mp4 --video in.mp4 replaced the clip the
    video was made from); refused before the model loads, the file unchanged."""
    prompt = tmp_path / "fox.mp4"
    prompt.write_text("a fox")
    proc = _generate("--prompt-file", prompt, "-o", tmp_path / "." / "fox.mp4", check=False)
    assert proc.returncode == 2 and "error: -o " in proc.stderr and "is the --prompt-file file" in proc.stderr
    assert prompt.read_text() == "a fox"


def test_read_input_bounds_files_and_streams(tmp_path, monkeypatch):
    """cli_inputs.read_input: a regular file past the limit is refused from its size (no byte read), a stream
    once past it (/dev/zero), a closed stdin by name; within the limit, the bytes."""
    from pathlib import Path

    from worldserve.commands.cli_inputs import read_input
    from worldserve.params import ParamError

    big = tmp_path / "big.bin"
    with big.open("wb") as f:
        f.truncate((64 << 30) + 1)  # (sparse: reading it would take minutes)
    for path in (big, "/dev/zero"):
        with pytest.raises(ParamError, match="is larger than 1 MiB"):
            read_input(Path(path), "image", 1 << 20)
    monkeypatch.setattr("sys.stdin", None)
    with pytest.raises(ParamError, match="standard input is closed"):
        read_input(Path("-"), "prompt_file", 1 << 20, stdin_for_dash=True)
    (tmp_path / "ok").write_bytes(os.urandom(3000))
    assert read_input(tmp_path / "ok", "image", 3000) == (tmp_path / "ok").read_bytes()


def test_missing_checkpoint_is_one_line(tmp_path):
    proc = _generate(
        "nvidia/Cosmos3-Nano-missing", "--prompt", "a cat", "-o", tmp_path / "x.mp4", check=False
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert (
        "error: nvidia/Cosmos3-Nano-missing (revision main) is not in the Hugging Face cache" in proc.stderr
    )


@pytest.mark.parametrize("where", ["a folder", "under a file", "read-only"])
def test_an_unwritable_output_fails_before_the_model_loads(tmp_path, capsys, where):
    """-o is checked with the other input (exit 2, `error: -o ...`), not after minutes of generating."""
    from worldserve.cli import main

    folder = tmp_path / "ro"
    folder.mkdir()
    output = {"a folder": folder, "under a file": tmp_path / "f.txt" / "x.mp4", "read-only": folder / "x.mp4"}
    (tmp_path / "f.txt").write_text("not a folder")
    if where == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
        folder.chmod(0o500)
    assert main(["generate", "--prompt", "a cat", "-o", str(output[where]), "--device", "cpu"]) == 2
    assert re.search("error: -o [^-]", capsys.readouterr().err)


@pytest.mark.parametrize("where", ["a folder", "under a file", "not .safetensors"])
def test_an_unwritable_latents_path_fails_before_the_model_loads(tmp_path, capsys, where):
    """--save-latents is checked with -o (it was written last, after the MP4: a traceback after the whole run)."""
    from worldserve.cli import main

    (tmp_path / "f.txt").write_text("not a folder")
    latents = {"a folder": tmp_path / "l.safetensors", "under a file": tmp_path / "f.txt" / "l.safetensors",
               "not .safetensors": tmp_path / "l.npz"}[where]  # fmt: skip
    if where == "a folder":
        latents.mkdir()
    out = tmp_path / "x.mp4"
    argv = ["generate", "--prompt", "a cat", "-o", str(out), "--save-latents", str(latents), "--device", "cpu",
            "--size", "80x48", "--num-frames", "9", "--steps", "1"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    if where == "not .safetensors":
        assert (
            err
            == "worldserve generate: error: --save-latents writes a safetensors file: name it *.safetensors\n"
        )
    else:
        assert err.startswith(f"worldserve generate: error: --save-latents {latents}")
        assert err.count("--save-latents") == 1
    assert not out.exists()


def test_text_that_is_not_utf8_is_one_line(tmp_path, capsys):
    """A prompt file that is not UTF-8 (was a UnicodeDecodeError traceback) and argv bytes that are not (lone
    surrogates: the tokenizer's TypeError traceback after the model loaded) fail before anything loads."""
    from worldserve.cli import main

    (tmp_path / "p.txt").write_bytes(b"\xff\xfe a fox")
    out = str(tmp_path / "x.mp4")
    assert main(["generate", "--prompt-file", str(tmp_path / "p.txt"), "-o", out]) == 2
    assert "error: --prompt-file: " in capsys.readouterr().err
    for argv in (["--prompt", "a \udcff fox"], ["--prompt", "a fox", "--negative-prompt", "\udcff"],
                 ["--prompt", "a fox", "--system-prompt", "\udcff"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(["generate", *argv, "-o", out])
        assert exit_.value.code == 2
        assert f"error: argument {argv[-2]}: not valid UTF-8 text" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["--device", "cuda:3"], "--device cuda:3 needs CUDA GPU 3; 0 visible"),
     (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 needs 2 CUDA GPUs; 0 visible")],
)  # fmt: skip
def test_gpus_this_machine_lacks_are_one_line_before_anything_loads(tmp_path, capsys, argv, needle):
    """A CUDA device on a machine without one (was an AssertionError traceback after the checkpoint loaded),
    and tensor parallel naming its own flag (it named --cfg-parallel-size 1)."""
    from worldserve.cli import main

    assert main(["generate", "--prompt", "a cat", "-o", str(tmp_path / "x.mp4"), *argv]) == 2
    assert needle in capsys.readouterr().err


def test_cfg_parallel_without_cfg_is_one_line_before_anything_loads(tmp_path, capsys):
    """--cfg-parallel-size 2 --guidance 1: the run has no uncond branch for the second rank, which had loaded a
    whole model to sit idle (serve keeps the layout: its requests each give their own guidance)."""
    from worldserve.cli import main

    argv = ["generate", "--prompt", "a cat", "-o", str(tmp_path / "x.mp4"), "--device", "cpu"]
    assert main([*argv, "--guidance", "1", "--cfg-parallel-size", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "worldserve generate: error: --guidance 1 runs no uncond CFG branch, so --cfg-parallel-size 2 would "
        "leave its uncond rank idle: drop --cfg-parallel-size, or give a scale above 1"
    )


def test_a_write_failing_after_the_run_is_one_line_and_keeps_the_latents(tiny_ckpt, tmp_path, monkeypatch):
    """A full disk (or a folder gone since the checks) at the end was a traceback; now one line naming -o,
    exit 1, and --save-latents written first, so the denoised state survives to decode again."""
    import errno

    from worldserve.commands import generate

    def full_disk(path, result):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(generate, "write_output", full_disk)
    out, latents = tmp_path / "x.mp4", tmp_path / "x.safetensors"
    r = _generate(tiny_ckpt, "--prompt", "a cat", *SMALL, "-o", out, "--save-latents", latents, check=False)
    assert (r.returncode, r.stderr.splitlines()[-1]) == (
        1,
        f"worldserve generate: error: -o {out}: cannot write it (No space left on device)",
    ), r.stderr
    assert latents.is_file() and not out.exists()


def test_a_peer_dying_mid_run_is_one_line(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """--cfg-parallel-size 2 on CPU, the uncond rank killed before the second step: exit 1 with one line
    naming the layout (was the exception's traceback), no output file."""
    from worldserve.cli import main
    from worldserve.runner.parallel_pipeline import ParallelPipeline

    denoise, calls = ParallelPipeline.denoise, []

    def kill_before_the_second(self, states):
        calls.append(1)
        if len(calls) == 2:
            self.process.kill()
            self.process.join(10)
        return denoise(self, states)

    monkeypatch.setattr(ParallelPipeline, "denoise", kill_before_the_second)
    out = tmp_path / "x.mp4"
    argv = ["generate", str(tiny_ckpt), "--prompt", "a cat", "--size", "80x48", "--num-frames", "9", "--steps", "3",
            "--negative-prompt", "blurry", "--cfg-parallel-size", "2", "--device", "cpu", "-o", str(out)]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: --cfg-parallel-size 2: the peer ranks are stopped after an error" in err
    assert "Traceback" not in err and not out.exists() and len(calls) == 2


def test_a_peer_dying_at_start_up_is_one_line(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """A peer rank that exits while the model loads: one error line, exit 1 (was PeerError's traceback)."""
    from worldserve.cli import main
    from worldserve.parallel.comm import PeerError
    from worldserve.runner import video_pipeline

    def dies(*args, **kwargs):
        raise PeerError("cfg-parallel rank 1 exited during start-up (exit code 3)")

    monkeypatch.setattr(video_pipeline, "load_pipeline", dies)
    argv = ["generate", str(tiny_ckpt), "--prompt", "a cat", "--size", "32x32", "--num-frames", "5", "--steps", "1",
            "--cfg-parallel-size", "2", "--device", "cpu", "-o", str(tmp_path / "x.mp4")]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        err.strip() == "worldserve generate: error: cfg-parallel rank 1 exited during start-up (exit code 3)"
    )


def test_sigterm_ends_generate_in_one_line(tiny_ckpt, tmp_path):
    """SIGTERM to `worldserve generate` mid-run: one line and rc 143, its clean-ups run and no partial output
    (it had died at once with rc -15 and nothing said)."""
    import signal
    import time

    out = tmp_path / "out.mp4"
    argv = [tiny_ckpt, "--prompt", "a cat", "--size", "320x192", "--num-frames", "33", "--steps", "200",
            "--no-sound", "--device", "cpu", "-o", out]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "worldserve.cli", "generate", *map(str, argv)],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline, seen = time.monotonic() + 120, ""
        while "Denoising" not in seen and time.monotonic() < deadline:  # (loaded, denoising)
            chunk = proc.stderr.read(64)
            if not chunk:  # (it ended before denoising: the asserts below say how)
                break
            seen = seen[-64:] + chunk
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "worldserve generate: terminated" in err and "Traceback" not in err, err
    assert not out.exists()
