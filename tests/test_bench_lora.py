"""bench/lora_step.py on the CPU at a tiny size: it times the step without and with an adapter read through the
served path (weights/lora_adapter.py), and the adapter changes the velocities; merged into the weights it gives
the unmerged adapter's velocities (the GPU run is the measurement)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def test_lora_step_script_runs_on_cpu(tmp_path, capsys):
    path = Path(__file__).resolve().parents[1] / "bench" / "lora_step.py"
    spec = importlib.util.spec_from_file_location("lora_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "l.json"
    argv = ["--tiny", "--device", "cpu", "--size", "64x48", "--frames", "5", "--steps", "1", "--ranks", "2,4",
            "--text-tokens", "20", "--forms", "addmm,addmm_", "--out", str(out)]  # fmt: skip
    assert mod.main(argv) == 0
    res = json.loads(out.read_text())
    assert list(res["variants"]) == [
        "base",
        "rank 2",
        "rank 4",
        "rank 4 addmm",
        "rank 4 addmm_",
        "rank 4 merged",
    ]
    for form in ("addmm", "addmm_"):  # (the same velocities, the delta added another way)
        got, want = (
            res["variants"][f"rank 4 {form}"]["rel_l2_vs_base"],
            res["variants"]["rank 4"]["rel_l2_vs_base"],
        )
        assert abs(got - want) < 1e-5 * want, form
    for name in ("rank 2", "rank 4"):
        row = res["variants"][name]
        assert row["rel_l2_vs_base"] > 1e-3 and row["step_s"] > 0 and row["adapter_gib"] > 0, name
        assert 0 < row["lora_flops_share"] < 1
    assert res["variants"]["rank 4"]["lora_flops_share"] > res["variants"]["rank 2"]["lora_flops_share"]
    merged = res["variants"]["rank 4 merged"]  # (float32 here: merged and unmerged agree to rounding)
    assert merged["rel_l2_vs_unmerged"] < 1e-5 and merged["rel_l2_vs_base"] > 1e-3
    assert "rank 4 merged" in capsys.readouterr().out
