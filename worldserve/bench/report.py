"""Results of one `worldserve bench` run: environment capture, the JSON file and the markdown summary.

`environment()` records date, GPU, torch / CUDA / cuDNN / diffusers versions and the exact command line.
`write(results, out_dir)` writes `bench-<stamp>.json` and `bench-<stamp>.md` and returns the markdown (the
short table the run prints last).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from worldserve.bench.flops import PEAK_BF16_TFLOPS

# Written down before the first GPU run (METHOD.md): what each change should buy on the 720p step.
PREDICTED = {
    "text_kv_cache": "~0.3 % (und FLOPs at T=300 are 0.24 % of a forward)",
    "fused_gemms": "1-3 % of the GEMM time (~30 % of a step): < 1 % of a step",
    "cfg_batched": "~0 (compute-bound; performance.md §6: B=2 166 ms vs 2x80 ms a layer)",
    "cudnn_bhnd": "0-5 % of attention if the strided views cost a copy; else 0",
    "compile": "~5 % (performance.md §3.3: 84.1 -> 79.9 ms a layer)",
    "overall": "1.15-1.25x (cuDNN in both; ours saves the text recompute, fused GEMMs, CFG batch)",
    # Added after run 1 showed diffusers' default SDPA choosing FA2 (flash_fwd_kernel, ~357 TF/s) on this box:
    "diffusers_cudnn": "diffusers ~6.6-6.8 s a step (attention 6.68 -> ~4.1 s), so ours eager ~0.98-1.02x of it",
    "attention_b2": "~+3 % attention throughput (performance.md §3.1: cuDNN B=1 595 vs CFG-batched B=2 616 TF/s)",
}

TARGETS = {"step_s": 5.2, "speedup_vs_diffusers": 1.3, "vae_decode_s": 4.0}


def environment(device: torch.device) -> dict:
    env = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "worldserve " + shlex.join(sys.argv[1:])
        if sys.argv and "worldserve" in sys.argv[0]
        else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "commit": _commit(),
    }
    try:
        import diffusers

        env["diffusers"] = diffusers.__version__
    except ImportError:
        env["diffusers"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    return env


def _commit() -> str | None:
    """The code's git commit: $WORLDSERVE_COMMIT (set it where the tree travels without .git, as to the GPU
    machine), else `git rev-parse` with "+dirty" for uncommitted changes, else None."""
    import subprocess

    from worldserve import envs

    if commit := envs.bench_commit():
        return commit
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _step_rows(label: str, name: str, r: dict, floor: float, target: bool) -> list[tuple[str, str, str, str]]:
    t = r["step_s"]["median"]
    verdict = ("met" if t <= TARGETS["step_s"] else "missed") if target else ""
    return [
        (
            f"{label} step, {name} (s)",
            _f(t),
            (f"<= {TARGETS['step_s']}; " if target else "") + f"floor {floor:.2f}",
            verdict,
        ),
        (
            f"{label} {name} TFLOP/s",
            f"{r['tflops']:.0f}",
            f"{r['frac_of_peak']:.2f} of {PEAK_BF16_TFLOPS:.0f}",
            "",
        ),
    ]


def summary_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(what, measured, target / limit, verdict) rows for the short table."""
    rows = []
    var = results.get("variants", {})
    kernels = results.get("models", {}).get("ours_attention")
    for i, point in enumerate(results.get("points", [])):
        runs = _point_runs(point, var, kernels, first=i == 0)
        for _, name, r, target in runs:
            if r:
                rows += _step_rows(point["workload"], name, r, point["roofline_step_s"], target)
        rows += _speedup_rows(point, runs)
    dec = results.get("decode")
    if dec:
        rows += _decode_rows(dec)
    for name, e2e in results.get("e2e_estimate", {}).items():
        rows.append(
            (f"E2E estimate, {name} (s)", f"{e2e['total_s']:.1f}", f"{e2e['steps']} steps + fixed", "")
        )
    return rows


def _point_runs(
    point: dict, var: dict, kernels: str | None, *, first: bool
) -> list[tuple[str, str, dict | None, bool]]:
    """(key, name, result, judged against the step target) of each step timed at `point`: ours as served,
    at the `first` point also the variant in the other mode (from `var`, the variants phase's results),
    then diffusers with its default SDPA and with cuDNN first. Only ours at 720p is judged."""
    is_720 = point["workload"].startswith("1280x720x189")
    runs = [("ours", f"ours ({kernels})" if kernels else "ours", point.get("ours"), is_720)]
    for mode in ("eager", "compiled"):  # the variant in the other mode (first point only)
        if first and "step_s" in var.get(mode, {}):
            runs.append((f"ours_{mode}", f"ours {mode}", var[mode], False))
    runs += [
        ("diffusers", "diffusers (default SDPA)", point.get("diffusers"), False),
        ("diffusers_cudnn", "diffusers (cuDNN SDPA)", point.get("diffusers_cudnn"), False),
    ]
    return runs


def _speedup_rows(
    point: dict, runs: list[tuple[str, str, dict | None, bool]]
) -> list[tuple[str, str, str, str]]:
    """Each of our runs against each diffusers run at `point` (default SDPA first), judged on the target."""
    label = point["workload"]
    rows = []
    ours_runs = [(n, r) for k, n, r, _ in runs if k.startswith("ours") and r]
    for ref_key, ref_name in (("diffusers", "default"), ("diffusers_cudnn", "cuDNN")):
        ref = point.get(ref_key)
        if not ref:
            continue
        for name, r in ours_runs:
            sp = ref["step_s"]["median"] / r["step_s"]["median"]
            rows.append(
                (
                    f"{label} speed-up {name} vs diffusers ({ref_name})",
                    f"{sp:.3f}x",
                    f">= {TARGETS['speedup_vs_diffusers']}x",
                    "met" if sp >= TARGETS["speedup_vs_diffusers"] else "missed",
                )
            )
    return rows


def _decode_rows(dec: dict) -> list[tuple[str, str, str, str]]:
    """The decode phase's rows: the VAE decode (judged), audio decode, uint8 + copy, the mux, and the decode
    and mux one after the other against overlapped where that was measured."""
    v = dec["vae_decode_s"]["median"]
    rows = [
        (
            f"VAE decode {dec['workload']} (s)",
            _f(v),
            f"<= {TARGETS['vae_decode_s']}",
            "met" if v <= TARGETS["vae_decode_s"] else "missed",
        )
    ]
    if "audio_decode_s" in dec:
        rows.append(("audio decode (s)", _f(dec["audio_decode_s"]["median"]), "", ""))
    rows.append(("uint8 + copy to host (s)", _f(dec["postprocess_d2h_s"]["median"]), "", ""))
    rows.append(
        (
            "mux synthetic / decoded (s)",
            f"{dec['mux_synthetic_s']:.2f} / {dec['mux_decoded_s']:.2f}",
            "",
            "",
        )
    )
    if "decode_mux_overlapped_s" in dec:
        rows.append(
            (
                "decode + mux, one after the other / overlapped (s)",
                f"{dec['decode_mux_sequential_s']:.2f} / {dec['decode_mux_overlapped_s']:.2f}",
                "",
                "",
            )
        )
    return rows


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        f"# worldserve bench — {env['date']}",
        "",
        f"- GPU: {env.get('gpu', env['device'])}; torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']});"
        f" diffusers {env['diffusers']}; python {env['python']}",
        f"- command: `{env['command']}`; our kernels: {results.get('models', {}).get('ours_attention', '-')}",
        f"- random bf16 weights (meta init, in-place N(0, 0.02)); CFG 2 forwards a step; "
        f"text tokens cond/uncond {results['args']['text_tokens']}/{results['args']['neg_text_tokens']}; "
        f"FLOP model performance.md §1; peak {PEAK_BF16_TFLOPS:.0f} TFLOP/s",
        "",
        "| what | measured | target / limit | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in summary_rows(results)]
    for point in results.get("points", []):
        mem = [
            f"{k}: peak {v['peak_gib']:.1f} GiB (standalone est. {v['standalone_peak_gib']:.1f})"
            for k, v in ((k, point.get(k)) for k in ("ours", "diffusers"))
            if v
        ]
        if mem:
            lines += ["", f"Memory {point['workload']}: " + "; ".join(mem)]
        if point.get("parity"):
            lines.append(f"Parity ours vs diffusers (same weights/inputs, bf16, rel. L2): {point['parity']}")
    prof = dict(results.get("profile", {}))
    if "vae_profile" in results.get("decode", {}):
        prof["VAE decode"] = results["decode"]["vae_profile"]
    for name, pr in prof.items():
        cats = ", ".join(f"{k} {v / 1e3:.2f} s" for k, v in pr["by_category_ms"].items())
        top = pr["top_kernels"][0]
        lines.append(
            f"Kernel time, {name}: {pr['kernel_ms_total'] / 1e3:.2f} s = {cats}; top: {top['name'][:70]}"
        )
    num = results.get("variants", {}).get("layer_numerics")
    if num:
        lines.append(
            f"One gen layer ({num['tokens']} tokens) vs a float32 copy, rel. L2 of the output: eager "
            f"{num['eager_vs_fp32']:.2e}, compiled {num['compiled_vs_fp32']:.2e}"
        )
    clocks = [(name, c) for name, c in results.get("clocks", {}).get("phases", {}).items() if c]
    if clocks:
        lines.append("Clocks (nvidia-smi, median): " + "; ".join(
            f"{name} {c['sm_mhz']:.0f} MHz, {c['power_w']:.0f} W{' (power-capped)' if 'sw_power_cap' in c['reasons'] else ''}"
            for name, c in clocks))  # fmt: skip
    var = results.get("variants", {}).get("table")
    if var:
        lines += ["", "| change | predicted gain | measured gain |", "|---|---|---|"]
        lines += [f"| {r['change']} | {r['predicted']} | {r['measured']} |" for r in var]
    return "\n".join(lines) + "\n"


def write(results: dict, out_dir: Path, stamp: str) -> str:
    """Write (or overwrite, as phases complete) bench-<stamp>.json / .md; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    (out_dir / f"bench-{stamp}.json").write_text(json.dumps(results, indent=2, default=str))
    (out_dir / f"bench-{stamp}.md").write_text(text)
    return text


CFG_BRANCHES = 2
"""Forwards a step (cond and uncond): scales a per-layer micro-benchmark to a step, with the layer count."""


def variant_rows(results: dict, var: dict, point: dict, base: float, n_layers: int) -> list[dict]:
    """The variants phase's table, one {change, predicted, measured} row a change in a fixed order: `var` is
    that phase's results, `point` the first point's, `base` our step there (median, s) and `n_layers` the
    gen layers a forward (the micro-benchmarks time one layer); `results` is not read."""
    ref = point.get("diffusers")
    pre = point["ours"]["prefill_s"]["median"]
    rows = [
        _variant_row(
            "text K/V once per branch (diffusers recomputes each forward)",
            "text_kv_cache",
            f"prefill of both prompts {pre * 1e3:.1f} ms = {100 * pre / base:.2f} % of a step",
        )
    ]
    g = var.get("gemm")
    if g:
        rows.append(_fused_gemm_row(g, base, n_layers))
    rows += _attention_rows(var.get("attention"), base, n_layers)
    s = var.get("cfg_sequential")
    if s:
        rows.append(
            _variant_row(
                "CFG batched in one GenBatch vs two forwards",
                "cfg_batched",
                f"{s['step_s']['median'] / base:.3f}x (sequential {s['step_s']['median']:.3f} s)",
            )
        )
    compiled, eager = var.get("compiled", {}), var.get("eager", {})
    if "step_s" in compiled or "step_s" in eager:  # ours ran in one mode, the variant in the other
        rows.append(_compile_row(compiled, eager, point, base))
    dcu = point.get("diffusers_cudnn")
    if ref and dcu:
        rows.append(
            _variant_row(
                "diffusers with cuDNN-first SDPA (its default picks FA2 here) vs diffusers default",
                "diffusers_cudnn",
                f"{ref['step_s']['median']:.3f} -> {dcu['step_s']['median']:.3f} s a step; ours "
                f"= {point['speedup_vs_diffusers_cudnn']:.3f}x of it",
            )
        )
    if ref:
        rows.append(
            _variant_row(
                "ours (all of the above, as served) vs diffusers", "overall", f"{point['speedup']:.3f}x"
            )
        )
    return rows


def _variant_row(change: str, predicted: str, measured: str) -> dict:
    """One row of the variants table; `predicted` is its key in PREDICTED."""
    return {"change": change, "predicted": PREDICTED[predicted], "measured": measured}


def _fused_gemm_row(g: dict, base: float, n_layers: int) -> dict:
    """What the fused q|k|v and gate|up GEMMs save a step, from the one-layer GEMM micro-benchmark `g`."""
    saved = (
        (
            (g["qkv_separate"]["ms"] - g["qkv_fused"]["ms"])
            + (g["gate_up_separate"]["ms"] - g["gate_up_fused"]["ms"])
        )
        * n_layers
        * CFG_BRANCHES
        / 1e3
    )
    return _variant_row(
        "fused q|k|v and gate|up GEMMs",
        "fused_gemms",
        f"{saved * 1e3:.0f} ms a step = {100 * saved / base:.2f} %",
    )


def _attention_rows(a: dict | None, base: float, n_layers: int) -> list[dict]:
    """From the one-layer attention micro-benchmark `a`: cuDNN on contiguous [B,H,N,D] against our strided
    views, then both CFG items at once against one at a time; each row only where both of its timings ran."""
    rows = []
    if a and "ms" in a.get("ours_token_major", {}) and "ms" in a.get("bhnd_cudnn_forced", {}):
        d = (a["ours_token_major"]["ms"] - a["bhnd_cudnn_forced"]["ms"]) * n_layers * CFG_BRANCHES / 1e3
        rows.append(
            _variant_row(
                "cuDNN SDPA on contiguous [B,H,N,D] vs our strided token-major views",
                "cudnn_bhnd",
                f"{a['ours_token_major']['tflops']:.0f} vs {a['bhnd_cudnn_forced']['tflops']:.0f}"
                f" TF/s; {d * 1e3:+.0f} ms a step ({100 * d / base:+.2f} %)",
            )
        )
    if a and "ms" in a.get("bhnd_cudnn_b2_per_item", {}) and "ms" in a.get("bhnd_cudnn_forced", {}):
        d = (a["bhnd_cudnn_forced"]["ms"] - a["bhnd_cudnn_b2_per_item"]["ms"]) * n_layers * CFG_BRANCHES / 1e3
        rows.append(
            _variant_row(
                "cuDNN attention over both CFG items at once (B=2) vs one item at a time",
                "attention_b2",
                f"{a['bhnd_cudnn_b2_per_item']['tflops']:.0f} vs {a['bhnd_cudnn_forced']['tflops']:.0f}"
                f" TF/s; {d * 1e3:+.0f} ms a step saved ({100 * d / base:+.2f} %)",
            )
        )
    return rows


def _compile_row(compiled: dict, eager: dict, point: dict, base: float) -> dict:
    """Eager over compiled whichever mode was served (`base` stands for the served one, the variants phase's
    `compiled` / `eager` for the other) and the compile warm-up (the first compiled step)."""
    c_s = compiled["step_s"]["median"] if "step_s" in compiled else base
    e_s = eager["step_s"]["median"] if "step_s" in eager else base
    first = (compiled if "step_s" in compiled else point["ours"])["step_s"]["warmup"]
    return _variant_row(
        "torch.compile of the gen layer (default mode)",
        "compile",
        f"{e_s / c_s:.3f}x ({e_s:.3f} s eager -> {c_s:.3f} s compiled a step; "
        f"compile warm-up {first[0]:.0f} s)",
    )


def run_script(
    args: argparse.Namespace, run: Callable[..., dict], table: Callable[[dict], str], prefix: str
) -> int:
    """The `main` of a bench/ script: `args.out` is a .json file or a folder (then `<prefix>-<stamp>.json`);
    `run(args, log=, save=)` logs to stderr and saves the partial results after each phase, so a run cut
    short keeps what it measured; `table(results)` is printed last."""
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / f"{prefix}-{_dt.datetime.now(_dt.UTC).strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(res: dict) -> None:
        out.write_text(json.dumps(res, indent=1, default=str))

    res = run(args, log=lambda m: print(m, file=sys.stderr, flush=True), save=save)
    save(res)
    print(table(res))
    print(f"wrote {out}")
    return 0
