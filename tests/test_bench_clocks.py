"""The clock / power log of the benchmarks (worldserve/bench/clocks.py) and bench/sustained_rate.py on CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from worldserve.bench import clocks


def test_parse_reading_of_nvidia_smi_lines():
    r = clocks.parse_reading("1755, 698.52, 61, 0x0000000000000004\n", 12.5)
    assert r == clocks.Reading(12.5, 1755.0, 698.52, 61.0, 4)
    for junk in ("", "clocks.sm [MHz], power.draw [W]", "1980, [N/A], 40, 0x0", "No devices were found"):
        assert clocks.parse_reading(junk, 0.0) is None


def test_decode_reasons_names_bits_and_keeps_unknown_ones():
    assert clocks.decode_reasons(0) == []
    assert clocks.decode_reasons(0x4 | 0x20) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert clocks.decode_reasons(0x1 | 0x1000) == ["gpu_idle", "0x1000"]


def test_summarize_takes_only_the_phase_readings():
    readings = [
        clocks.Reading(0.5, 345, 80, 30, 0x1),  # idle before the phase
        clocks.Reading(1.0, 1980, 500, 40, 0x0),
        clocks.Reading(1.1, 1800, 690, 45, 0x4),
        clocks.Reading(1.2, 1700, 700, 47, 0x4),
        clocks.Reading(3.0, 345, 90, 44, 0x1),  # after it
    ]
    s = clocks.summarize(readings, 1.0, 1.2)
    assert s == {
        "readings": 3, "sm_mhz": 1800, "sm_mhz_min": 1700, "power_w": 690, "power_w_max": 700,
        "temp_c_max": 47, "reasons": ["sw_power_cap"],
    }  # fmt: skip
    assert clocks.summarize(readings, 1.5, 2.5) is None


def test_clock_log_phases_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    with clocks.ClockLog() as log:
        assert not log.available
        with log.phase("work"):
            pass
    assert log.summary() == {"work": None}
    assert clocks.board_limits() is None


def _load_script():
    path = Path(__file__).resolve().parents[1] / "bench" / "sustained_rate.py"
    spec = importlib.util.spec_from_file_location("sustained_rate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sustained_rate_script_runs_on_cpu(tmp_path, capsys):
    mod = _load_script()
    out = tmp_path / "s.json"
    assert mod.main(["--tiny", "--device", "cpu", "--seconds", "0.05", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["phases"]) == {"gemm-burst", "gemm", "gemm-zeros", "gate_up", "attention"}
    for name, r in res["phases"].items():
        assert r["tflops"] > 0 and r["ms_per_call"] > 0, name
    assert res["phases"]["gemm"]["calls"] >= 2 * res["phases"]["gemm"]["batch"]
    assert "gemm-zeros" in capsys.readouterr().out


@pytest.mark.parametrize("seconds", [0.0, 0.02])
def test_sustained_times_at_least_two_batches(seconds):
    import torch

    mod = _load_script()
    calls = []
    r = mod.sustained(lambda: calls.append(1), 1e6, seconds, torch.device("cpu"))
    assert r["calls"] == len(calls) - 2  # the warm-up and the probe are not counted
    assert r["calls"] >= 2 * r["batch"]


def test_the_bench_report_states_the_clocks():
    import torch

    from worldserve.bench import report

    results = {
        "environment": report.environment(torch.device("cpu")), "args": {"text_tokens": 300, "neg_text_tokens": 300},
        "clocks": {"board": None, "phases": {"decode": None, "transformer 1280x720x189+audio": {
            "readings": 50, "sm_mhz": 1530.0, "sm_mhz_min": 1425.0, "power_w": 690.0, "power_w_max": 701.0,
            "temp_c_max": 59.0, "reasons": ["sw_power_cap"]}}},
    }  # fmt: skip
    text = report.markdown(results)
    assert (
        "Clocks (nvidia-smi, median): transformer 1280x720x189+audio 1530 MHz, 690 W (power-capped)" in text
    )
