"""Attention backends on one GPU: cuDNN SDPA vs FlashAttention-3 bf16 vs FA3 fp8, kernel and whole step.

0. PyTorch's default SDPA choice at the joint shape, fresh and after our sdpa_attention calls; FA3's
   pack_gqa settings, a B=2 (both CFG items) call, and FA3 timed by CUDA events alone back to back vs right
   after a gate|up-sized GEMM each (does the step's GEMM traffic slow attention down?), with NVML clocks.
1. Kernel, at the joint gen shape (N_g queries over T + N_g keys, GQA 32/8, head dim 128; 720p x 189 + audio:
   44,357 gen tokens, T = 300 and 3,500 text tokens): ms, TFLOP/s (4 N_q N_k H d), and the rel. L2 error of
   each backend against a float32 reference on a sample of query rows. fp8 is timed with its on-device
   e4m3 quantisation of q/k/v included, as the model runs it.
2. Step: the full-size Nano transformer with random bf16 weights (worldserve/bench/models.py), gen layers
   torch.compile'd (the product default), one CFG step (cond + uncond packed, 300-token prompts) with
   `set_attention_backend` = sdpa, FLASH_ATTN; then `quantize_gen_fp8` + fp8 attention (the full fp8 mode)
   and fp8 GEMMs with bf16 FA3 attention. Seconds a step (median of --steps after a warm-up), TFLOP/s, and
   the rel. L2 of the velocities against the sdpa bf16 step at the same inputs.
Writes JSON to --out and prints a short table last.

    PYTHONPATH=. python bench/attention_backends.py --out $OUT/attention_backends.json   # H200, ~4 min
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from worldserve.bench.denoise import rel_error, snapshot

T_REF = 500


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float32 attention of the sampled query rows over all keys (math kernel, K/V heads repeated)."""
    rep = q.shape[1] // k.shape[1]
    qh = q[rows].float().transpose(0, 1).unsqueeze(0)  # [1, Hq, R, D]
    kh = k.float().repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0)  # [1, Hq, Nk, D]
    vh = v.float().repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(qh, kh, vh)
    return out.squeeze(0).transpose(0, 1)  # [R, Hq, D]


def kernel_bench(n_gen: int, n_text: int, device: torch.device, repeats: int) -> dict:
    from worldserve.bench.timing import time_region
    from worldserve.models.layers.attention import sdpa_attention
    from worldserve.models.layers.flash_attention import fa3_attention, fa3_fp8_attention, fa3_module

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n_gen, 32, 128, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(n_text + n_gen, 8, 128, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(n_text + n_gen, 8, 128, device=device, dtype=torch.bfloat16, generator=g)
    rows = torch.linspace(0, n_gen - 1, 512, device=device).long()
    ref = reference_rows(q, k, v, rows)
    flops = 4.0 * n_gen * (n_gen + n_text) * 32 * 128
    res: dict = {
        "n_gen": n_gen,
        "n_text": n_text,
        "flops": flops,
        "fa3_module": getattr(fa3_module(), "__name__", None),
    }
    cases = {"sdpa": sdpa_attention}
    if fa3_module() is not None:
        cases |= {"fa3": fa3_attention, "fa3_fp8": fa3_fp8_attention}
    for name, fn in cases.items():
        out = fn(q, k, v)
        t = time_region(lambda fn=fn: fn(q, k, v), device, warmup=1, repeats=repeats)
        res[name] = {
            "ms": t.median * 1e3,
            "tflops": flops / t.median / 1e12,
            "rel_l2_vs_fp32": rel_error(out[rows], ref),
        }
    return res


def sdpa_choice_probe(device: torch.device) -> dict:
    """PyTorch's default SDPA choice at the joint shape, fresh and after our sdpa_attention calls (whose
    `sdpa_kernel(..., set_priority=True)` context must leave the global order as it found it)."""
    from worldserve.models.layers.attention import sdpa_attention

    names = {1: "FLASH_ATTENTION", 2: "EFFICIENT_ATTENTION", 3: "CUDNN_ATTENTION"}
    q = torch.randn(1, 32, 44_357, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 44_657, 128, device=device, dtype=torch.bfloat16)

    def choice() -> str:
        c = int(torch._fused_sdp_choice(q, k, k, enable_gqa=True))
        return names.get(c, str(c))

    out = {"fresh": choice()}
    t = q[0, :, :64].transpose(0, 1)  # [64, 32, 128]
    kv = k[0, :, :96].transpose(0, 1)
    sdpa_attention(t, kv, kv)
    out["after_sdpa_attention"] = choice()
    sdpa_attention(t, kv, kv, causal=True)
    out["after_causal_sdpa_attention"] = choice()
    return out


def fa3_knobs(n_gen: int, n_text: int, device: torch.device, repeats: int) -> dict:
    """FA3 pack_gqa settings, and both CFG items in one B=2 call vs two calls."""
    from worldserve.bench.timing import time_region
    from worldserve.models.layers.flash_attention import fa3_module

    mod = fa3_module()
    q = torch.randn(1, n_gen, 32, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, n_text + n_gen, 8, 128, device=device, dtype=torch.bfloat16)
    flops = 4.0 * n_gen * (n_gen + n_text) * 32 * 128
    res = {}
    for name, kw in (
        ("pack_gqa_none", {}),
        ("pack_gqa_true", {"pack_gqa": True}),
        ("pack_gqa_false", {"pack_gqa": False}),
    ):
        t = time_region(lambda kw=kw: mod.flash_attn_func(q, k, k, **kw), device, warmup=1, repeats=repeats)
        res[name] = {"ms": t.median * 1e3, "tflops": flops / t.median / 1e12}
    res["b2_per_item"] = _b2_per_item(mod, q, k, flops, device, repeats)
    # In the compiled step FA3 runs at ~657 TF/s against ~675-681 here: is it the GEMMs between the calls
    # (power / clocks)? Time FA3 alone back to back, then each call right after a gate|up-sized GEMM.
    a = torch.randn(2 * n_gen, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(24576, 4096, device=device, dtype=torch.bfloat16)
    for name, gemm in (("back_to_back", False), ("after_gemm", True)):
        ms, clocks = _fa3_event_ms(
            lambda: mod.flash_attn_func(q, k, k), lambda: F.linear(a, w), gemm, repeats
        )
        res[name] = {"ms": ms, "tflops": flops / ms / 1e9, **clocks}
    return res


def _b2_per_item(mod, q, k, flops: float, device: torch.device, repeats: int) -> dict:
    """Both CFG items in one B=2 FA3 call: ms and TF/s per item."""
    from worldserve.bench.timing import time_region

    q2, k2 = torch.cat([q, q]), torch.cat([k, k])
    t = time_region(lambda: mod.flash_attn_func(q2, k2, k2), device, warmup=1, repeats=repeats)
    return {"ms": t.median * 1e3 / 2, "tflops": 2 * flops / t.median / 1e12}


def _fa3_event_ms(attn, gemm, with_gemm: bool, repeats: int) -> tuple[float, dict]:
    """Median ms of attn() alone (CUDA events around it only), each call preceded by gemm() if with_gemm;
    and the SM clock (MHz) and power (W) read while the queue runs (NVML, when importable)."""
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats + 2)
    ]
    for start, end in events:
        if with_gemm:
            gemm()
        start.record()
        attn()
        end.record()
    clocks: dict = {}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        clocks = {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                  "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000}  # fmt: skip
    except Exception as exc:  # no NVML here: timings only
        clocks = {"nvml": str(exc)}
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events[2:])
    return times[len(times) // 2], clocks


def step_bench(args, device: torch.device, log) -> dict:
    from worldserve.bench.denoise import OurStep, make_inputs
    from worldserve.bench.flops import TowerShape, tflops
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.timing import time_region
    from worldserve.bench.workload import Workload
    from worldserve.models.cosmos3.config import Cosmos3Config

    cfg = Cosmos3Config.nano()
    w = Workload(width=1280, height=720, num_frames=189, sound=True, cond_text=300, uncond_text=300)
    shape = TowerShape.from_config(cfg)
    model = build_our_transformer(cfg, device, torch.bfloat16, None, 0)
    model.compile_gen_layers()
    step = OurStep(model, w, make_inputs(w, cfg.vocab_size, device, 0))
    step.prefill()
    res: dict = {"workload": w.label, "gen_tokens": w.gen_tokens, "step_flops": w.step_flops(shape)}
    ref = None
    variants = [("sdpa", "TORCH_SDPA", False, False), ("fa3", "FLASH_ATTN", False, False),
                ("fp8_gemm+fa3_bf16", "FLASH_ATTN", True, False), ("fp8_gemm+fa3_fp8", "FLASH_ATTN", True, True)]  # fmt: skip
    for name, backend, fp8_gemm, fp8_attn in variants:
        if fp8_gemm and not model.layers[0].gen.fp8:
            model.quantize_gen_fp8()
        try:
            label = model.set_attention_backend(backend, fp8_attention=fp8_attn)
        except ValueError as e:
            res[name] = {"skipped": str(e)}
            continue
        log(f"step {name} ({label}): warm-up + {args.steps}")
        t = time_region(lambda: step(999), device, warmup=1, repeats=args.steps)
        snap = snapshot(step, T_REF)
        if ref is None:
            ref = snap
        res[name] = {**t.to_dict(), "step_s": t.median, "tflops": tflops(res["step_flops"], t.median),
                     "err_vs_sdpa": {k: rel_error(snap[k], ref[k]) for k in ref}}  # fmt: skip
        log(f"  {t.median:.3f} s; video err {res[name]['err_vs_sdpa']['video']}")
        if args.profile_dir is not None and name in ("fa3", "fp8_gemm+fa3_fp8"):
            from worldserve.bench.variants import profile_step

            tag = name.replace("+", "_")
            res[name]["profile"] = profile_step(
                lambda: step(999), device, args.profile_dir / f"profile_step_{tag}.txt"
            )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-step", action="store_true", help="kernel table only")
    ap.add_argument("--profile-dir", type=Path, default=None, help="torch.profiler tables of the fa3 steps")
    args = ap.parse_args()
    t0 = time.perf_counter()
    device = torch.device("cuda")

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    from worldserve.bench.report import environment

    res: dict = {"environment": environment(device), "kernel": []}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")

    res["sdpa_choice"] = sdpa_choice_probe(device)
    log(f"SDPA default choice: {res['sdpa_choice']}")
    from worldserve.models.layers.flash_attention import fa3_module

    if fa3_module() is not None:
        res["fa3_knobs"] = fa3_knobs(44_357, 300, device, args.repeats)
        log(f"FA3 knobs: {res['fa3_knobs']}")
    save()
    for n_text in (300, 3500):
        res["kernel"].append(kernel_bench(44_357, n_text, device, args.repeats))
        log(
            f"kernel T={n_text}: "
            + json.dumps({k: v for k, v in res["kernel"][-1].items() if isinstance(v, dict)})
        )
        save()
    if not args.no_step:
        res["step"] = step_bench(args, device, log)
        save()
    res["wall_s"] = time.perf_counter() - t0
    save()
    print(f"\n{'kernel (44,357 q)':<26}{'ms':>8}{'TF/s':>8}{'err vs fp32':>13}")
    for kr in res["kernel"]:
        for name in ("sdpa", "fa3", "fa3_fp8"):
            if name in kr:
                r = kr[name]
                print(
                    f"{name + ' T=' + str(kr['n_text']):<26}{r['ms']:>8.1f}{r['tflops']:>8.0f}{r['rel_l2_vs_fp32']:>13.2e}"
                )
    for name, r in res.get("step", {}).items():
        if isinstance(r, dict) and "step_s" in r:
            e = r["err_vs_sdpa"]
            print(
                f"step {name:<22}{r['step_s']:>7.3f} s {r['tflops']:>5.0f} TF/s  video err {e['video']:.3f} sound {e['sound']}"
            )
        elif isinstance(r, dict):
            print(f"step {name}: {r}")
    print(f"wall {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
