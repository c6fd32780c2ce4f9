"""`worldserve bench` times the step as `serve` runs it, and says which: the summary names our kernels, the
variant in the other mode (eager beside compiled, or compiled beside `--enforce-eager`) gets its own rows, and
the context that switches the gen layers' mode gives back the functions they had.

CPU only, no timing thresholds: the report is fed hand-made results; the mode switch runs on the tiny model.
"""

from __future__ import annotations

import torch

from worldserve.bench import report
from worldserve.bench.variants import gen_layers_compiled
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.layer import finish_math, merge_attention, qkv_math
from worldserve.models.cosmos3.transformer import Cosmos3Transformer


def _timing(median: float, warmup: float = 1.0) -> dict:
    return {"step_s": {"median": median, "warmup": [warmup], "samples": [median]}, "tflops": 600.0,
            "frac_of_peak": 0.76, "peak_gib": 60.0, "standalone_peak_gib": 40.0}  # fmt: skip


def _results(variants: dict, kernels: str) -> dict:
    point = {
        "workload": "1280x720x189+audio",
        "roofline_step_s": 4.52,
        "ours": _timing(5.2, warmup=40.0) | {"prefill_s": {"median": 0.01}},
        "diffusers": _timing(6.8),
        "speedup": 6.8 / 5.2,
    }
    return {"models": {"ours_attention": kernels}, "points": [point], "variants": variants}


def _rows(results: dict) -> dict[str, tuple[str, str, str]]:
    return {what: tuple(rest) for what, *rest in report.summary_rows(results)}


def test_summary_names_the_served_kernels_and_the_eager_variant_beside():
    rows = _rows(_results({"eager": _timing(6.0)}, "fa4-cluster+compiled"))
    served = rows["1280x720x189+audio step, ours (fa4-cluster+compiled) (s)"]
    assert served == ("5.200", "<= 5.2; floor 4.52", "met")  # the target is judged on the served step
    assert rows["1280x720x189+audio step, ours eager (s)"][2] == ""  # the variant is not judged
    assert (
        rows["1280x720x189+audio speed-up ours (fa4-cluster+compiled) vs diffusers (default)"][0] == "1.308x"
    )
    assert rows["1280x720x189+audio speed-up ours eager vs diffusers (default)"][0] == "1.133x"


def test_the_compile_row_reads_eager_over_compiled_whichever_mode_was_served():
    served_compiled = _results({"eager": _timing(6.0)}, "fa3+compiled")
    served_eager = _results({"compiled": _timing(5.0, warmup=30.0)}, "fa3")
    served_eager["points"][0]["ours"] = _timing(6.0) | {"prefill_s": {"median": 0.01}}
    for results, warmup in ((served_compiled, "40 s"), (served_eager, "30 s")):
        point = results["points"][0]
        rows = report.variant_rows(results, results["variants"], point, point["ours"]["step_s"]["median"], 36)
        (row,) = [r for r in rows if r["change"].startswith("torch.compile")]
        eager, compiled = (6.0, 5.2) if results is served_compiled else (6.0, 5.0)
        assert row["measured"].startswith(f"{eager / compiled:.3f}x ({eager:.3f} s eager -> {compiled:.3f} s")
        assert f"compile warm-up {warmup}" in row["measured"]


def _env() -> dict:
    return {
        "environment": {"date": "d", "gpu": "g", "device": "cuda", "torch": "t", "cuda": "c", "cudnn": 1,
                        "diffusers": "x", "python": "p", "command": "worldserve bench"},
        "args": {"text_tokens": 300, "neg_text_tokens": 300},
    }  # fmt: skip


def test_the_markdown_names_our_kernels():
    text = report.markdown(_results({"eager": _timing(6.0)}, "fa4-cluster+compiled") | _env())
    assert "our kernels: fa4-cluster+compiled" in text
    assert "| 1280x720x189+audio step, ours eager (s) | 6.000 |" in text


def test_the_mode_switch_gives_the_layers_back_their_functions():
    model = Cosmos3Transformer(Cosmos3Config.tiny(), dtype=torch.float32)
    blocks = [layer.gen for layer in model.layers]
    model.compile_gen_layers()  # as serve leaves them on a GPU (wrapped lazily: nothing compiles here)
    served = [(b.qkv_fn, b.finish_fn, b.merge_fn) for b in blocks]
    assert served[0][0] is not qkv_math
    with gen_layers_compiled(model, False):
        assert all(
            (b.qkv_fn, b.finish_fn, b.merge_fn) == (qkv_math, finish_math, merge_attention) for b in blocks
        )
    assert [(b.qkv_fn, b.finish_fn, b.merge_fn) for b in blocks] == served
    eager = Cosmos3Transformer(Cosmos3Config.tiny(), dtype=torch.float32)
    with gen_layers_compiled(eager, True):
        assert eager.layers[0].gen.qkv_fn is not qkv_math
    assert all(layer.gen.qkv_fn is qkv_math and layer.gen.finish_fn is finish_math for layer in eager.layers)


def test_a_tiny_eager_run_times_the_variants_and_skips_a_compile_past_its_budget(tmp_path):
    """On the CPU the served step is eager (serve compiles on CUDA only), so the variant is the compiled
    step, skipped here by a budget already spent; the summary names the kernels it ran."""
    import json

    from worldserve.cli import main

    argv = ["bench", "--tiny", "--device", "cpu", "--points", "64x32x5", "--steps", "1", "--text-tokens", "7",
            "--neg-text-tokens", "5", "--phases", "transformer,variants", "--skip-diffusers",
            "--time-budget", "0.001", "--out-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (result,) = tmp_path.glob("bench-*.json")
    data = json.loads(result.read_text())
    assert "compiled" not in data["models"]["ours_attention"]
    assert data["variants"]["compiled"]["skipped"].startswith("time budget")
    assert data["variants"]["cfg_sequential"]["step_s"]["samples"]
    assert set(data["e2e_estimate"]) == {"ours"}
    text = (tmp_path / result.name.replace(".json", ".md")).read_text()
    assert f"our kernels: {data['models']['ours_attention']}" in text
