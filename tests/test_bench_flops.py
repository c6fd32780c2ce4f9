"""The benchmark's FLOP model (performance.md §1, cosmos3-model.md §9) and the `worldserve bench` CLI.

CPU only; no timing thresholds. One tiny smoke run of the whole harness on the CPU checks that every phase
produces its fields (numbers meaningless at that size).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from worldserve.bench.flops import (
    NANO,
    PEAK_BF16_TFLOPS,
    TowerShape,
    forward_flops,
    forward_flops_split,
    roofline_seconds,
)
from worldserve.bench.workload import Workload, parse_point
from worldserve.models.cosmos3.config import Cosmos3Config


def test_linear_params_per_layer_is_192_9M():
    assert NANO.linear_params_per_layer == 192_937_984
    assert TowerShape.from_config(Cosmos3Config.nano()) == NANO


def test_720p_189_frame_tokens():
    w = Workload()
    assert w.latent_shape == (1, 48, 48, 45, 80)
    assert w.patch_grid == (48, 23, 40)
    assert w.video_tokens == 44_160
    assert w.audio_frames == 197
    assert w.gen_tokens == 44_357


def test_480p_121_frame_tokens():
    w = parse_point("832x480x121")
    assert w.latent_shape == (1, 48, 31, 30, 52)
    assert w.video_tokens == 31 * 15 * 26
    assert w.audio_frames == 127  # ceil(242000 / 1920)


def test_forward_flops_720p_1k_text():
    linear, attention = forward_flops_split(44_357, 1024)
    assert linear == pytest.approx(0.616e15, rel=5e-3)
    assert attention == pytest.approx(1.187e15, rel=5e-3)
    assert linear + attention == pytest.approx(1.80e15, rel=5e-3)
    assert attention / (linear + attention) == pytest.approx(0.66, abs=0.01)


@pytest.mark.parametrize(
    ("n_gen", "n_text", "expected"),
    [(44_160, 300, 1.77e15), (44_357, 300, 1.79e15), (44_357, 3500, 1.87e15)],  # cosmos3-model.md §9 table
)
def test_forward_flops_table(n_gen, n_text, expected):
    assert forward_flops(n_gen, n_text) == pytest.approx(expected, rel=5e-3)


def test_request_flops_and_roofline():
    per_request = 70 * forward_flops(44_357, 1024)  # 35 steps x CFG 2
    assert per_request == pytest.approx(126.2e15, rel=2e-3)
    assert 70 * forward_flops(44_357, 0) == pytest.approx(124.4e15, rel=2e-3)
    assert 70 * forward_flops(44_357, 4096) == pytest.approx(131.9e15, rel=2e-3)
    assert PEAK_BF16_TFLOPS == 790.0
    assert roofline_seconds(per_request) == pytest.approx(160, rel=0.01)  # performance.md §2
    assert roofline_seconds(per_request) / 35 == pytest.approx(4.57, rel=0.01)


def test_step_is_two_forwards_with_own_text_lengths():
    w = Workload(cond_text=300, uncond_text=1200)
    assert w.step_flops() == pytest.approx(forward_flops(44_357, 300) + forward_flops(44_357, 1200))


def test_workload_rejects_bad_sizes():
    with pytest.raises(ValueError):
        Workload(width=1000)
    with pytest.raises(ValueError):
        Workload(num_frames=190)
    with pytest.raises(ValueError):
        parse_point("1280x720")


def test_bench_help():
    out = subprocess.run(
        [sys.executable, "-m", "worldserve.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in ("--points", "--steps", "--phases", "--skip-diffusers", "--tiny"):
        assert flag in out


def test_bench_tiny_cpu_smoke(tmp_path):
    from worldserve.cli import main

    rc = main(
        [
            "bench",
            "--tiny",
            "--device",
            "cpu",
            "--points",
            "64x32x5",
            "--steps",
            "1",
            "--text-tokens",
            "7",
            "--neg-text-tokens",
            "5",
            "--phases",
            "transformer,decode",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    (result,) = tmp_path.glob("bench-*.json")
    data = json.loads(result.read_text())
    point = data["points"][0]
    assert point["gen_tokens"] == 2 * 1 * 2 + 6  # 2 latent frames of 1x2 patches + ceil(10000 / 1920) audio
    assert point["ours"]["step_s"]["samples"] and point["diffusers"]["step_s"]["samples"]
    assert all(v < 0.05 for v in point["parity"].values())  # same weights, bf16
    assert data["decode"]["vae_decode_s"]["samples"] and data["decode"]["mux_synthetic_bytes"] > 0
    assert data["decode"]["decode_mux_same_bytes"] and data["decode"]["decode_mux_overlapped_s"] > 0
    assert data["e2e_estimate"]["ours"]["steps"] == 35
    # the phases' clock readings: none on the CPU (no nvidia-smi is read), but the phases are named
    assert data["clocks"]["phases"] == {"transformer 64x32x5+audio": None, "decode": None}


def test_profile_helpers_trace_copies_to_python_and_name_fused_kernels():
    """host_call_stacks finds the Python line that issued an op under the profiler; inductor's fused
    kernels (whose names list "copy", "cat", ...) count as fused elementwise, not as copies."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from worldserve.bench.variants import _kernel_category, host_call_stacks
    from worldserve.models.layers.norm import rms_norm

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        rms_norm(torch.randn(8, 16, dtype=torch.float64), torch.ones(16, dtype=torch.float64), 1e-6)
    assert "layers/norm.py" in host_call_stacks(prof.events(), names=("aten::copy_",))
    assert _kernel_category("triton_red_fused__to_copy_add_cat_mean_mul") == "fused elementwise (triton)"
    assert _kernel_category("Memcpy DtoD (Device -> Device)") == "copy/cat/index"
    assert _kernel_category("nvjet_sm90_tst_256x160_64x4_1x2_h_badd_coopA_TNT") == "gemm"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--points", "1280x720"], "--points: '1280x720' is not WIDTHxHEIGHTxFRAMES"),
        (
            ["--points", "1281x720x189"],
            "--points: 1281x720: width and height must be positive multiples of 16",
        ),
        (["--points", "0x0x5"], "positive multiples of 16"),
        (["--points", ","], "--points names no WIDTHxHEIGHTxFRAMES point"),
        (["--phases", "foo"], "--phases: unknown ['foo']"),
        (["--phases", ","], "--phases names no phase"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--e2e-steps", "0"], "--e2e-steps must be >= 1"),
        (["--text-tokens", "0"], "--text-tokens must be >= 1"),
        (["--neg-text-tokens", "99999999"], "--neg-text-tokens must be <= 131072"),  # (it ran out of memory)
        (["--fps", "0"], "--fps must be in [1, 120]"),
        (["--fps", "1e-300"], "--fps must be in [1, 120]"),  # (a point's audio of 10^302 frames)
        (["--time-budget", "-1"], "--time-budget must be > 0"),
        (["--device", "foo"], "--device 'foo' is not a device"),
        (["--attention-backend", "FLASH_ATTN"], "--attention-backend FLASH_ATTN: FlashAttention-3 needs"),
        (["--out-dir", "{file}"], "is not a directory"),
        (["--out-dir", "{file}/under"], "is not a directory"),
        (
            ["--out-dir", "/proc/worldserve-bench"],
            "--out-dir /proc/worldserve-bench",
        ),  # (root passes os.access)
    ],
)
def test_bench_bad_arguments_are_one_line_before_any_work(tmp_path, capsys, argv, needle):
    """Each was a traceback (a bad point, an unknown device, FLASH_ATTN off Hopper, an --out-dir under a file:
    after the timing had run), a report of NaNs (--steps 0) or an empty report (--phases ,); and the
    argument errors left with exit 1, not argparse's 2."""
    from worldserve.cli import main

    (tmp_path / "file").write_text("x")
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    assert main(["bench", "--tiny", "--device", "cpu", "--out-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("worldserve bench: error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_bench_decode_phase_without_pyav_is_exit_2_before_any_work(tmp_path, capsys, monkeypatch):
    """The decode phase muxes its clip: without PyAV (a device kit without it) the run failed with a traceback
    after the transformer phase's minutes; now the argument check names the phase, and a run without decode
    needs no PyAV."""
    import importlib.util

    from worldserve.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "av" else real(name, *a)
    )
    out = tmp_path / "out"
    assert (
        main(["bench", "--tiny", "--device", "cpu", "--out-dir", str(out), "--phases", "transformer,decode"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("worldserve bench: error: --phases decode") and "PyAV" in err, err
    assert not out.exists()
    from worldserve.cli import build_parser
    from worldserve.commands.bench import options

    argv = ["bench", "--tiny", "--device", "cpu", "--out-dir", str(out), "--phases", "transformer"]
    args = build_parser(argv).parse_args(argv)
    assert options(args).phases == frozenset({"transformer"})
    # --tiny without --points: a small point (the full-size ones took the tiny CPU decode past ten minutes)
    assert [(p.width, p.height, p.num_frames) for p in options(args).points] == [(64, 48, 9)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "--device cuda: worldserve bench needs a CUDA GPU"),
        (["--device", "cpu"], "use --tiny with --device cpu"),
    ],
)
def test_bench_without_a_gpu_is_exit_2(tmp_path, capsys, argv, needle):
    from worldserve.cli import main

    assert main(["bench", "--out-dir", str(tmp_path), *argv]) == 2
    assert needle in capsys.readouterr().err
