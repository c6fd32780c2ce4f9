"""The FA4 tile-search wrapper (worldserve/bench/fa4.py): config specs and where it refuses to run."""

from __future__ import annotations

import pytest
import torch

from worldserve.bench import fa4


@pytest.mark.parametrize("spec", ["128x176-rs-ovl-gqaauto", "192x112-ss-noovl-gqaoff", "64x64-rs-ovl-gqaon"])
def test_config_specs_round_trip(spec):
    cfg = fa4.Fa4Config.parse(spec)
    assert cfg.spec == spec
    assert cfg.num_threads == 128 * (1 + cfg.tile_m // 64)  # one producer + one consumer group per 64 rows


def test_config_spec_fields():
    cfg = fa4.Fa4Config.parse(" 192X128-SS-ovl-gqaon ")
    assert (cfg.tile_m, cfg.tile_n, cfg.mma_pv_is_rs, cfg.intra_wg_overlap, cfg.pack_gqa) == (
        192, 128, False, True, True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    ["128x176", "128x176-rs-ovl", "128x176-xx-ovl-gqaauto", "128x176-rs-ovl-gqamaybe", "axb-rs-ovl-gqaon"],
)
def test_malformed_specs_name_the_form(spec):
    with pytest.raises(ValueError, match="must look like 128x176-rs-ovl-gqaauto"):
        fa4.Fa4Config.parse(spec)


@pytest.mark.parametrize(
    "spec", ["100x128-rs-ovl-gqaauto", "256x128-rs-ovl-gqaauto", "128x120-rs-ovl-gqaauto"]
)
def test_impossible_tiles_are_refused(spec):
    with pytest.raises(ValueError, match="FA4 tile must be"):
        fa4.Fa4Config.parse(spec)


def test_off_hopper_the_reason_names_the_device():
    reason = fa4.fa4_unavailable_reason(torch.device("cpu"), torch.bfloat16, 128)
    assert reason is not None and "Hopper" in reason and "cpu" in reason


def test_a_forward_without_fa4_names_the_install():
    """fa4_forward where flash-attn-4 is not importable (`bench/step_levers.py --variants fa4` calls it without
    asking fa4_unavailable_reason first): the module and the install hint, not an AttributeError on None."""
    if fa4.fa4_module() is not None:
        pytest.skip("flash-attn-4 is importable here")
    q = torch.zeros(4, 2, 8)  # [N, H, D]
    with pytest.raises(RuntimeError, match=r"flash_attn\.cute\.interface is not importable: pip install"):
        fa4.fa4_forward(q, q, q)


def _fa4_export():
    """bench/fa4_export.py as a module (its top level imports the standard library only)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "fa4_export.py"
    spec = importlib.util.spec_from_file_location("fa4_export", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fa4_export"] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("spec", "fields", "name"),
    [
        ("128x176-c2", (128, 176, 2, False, False, 0), "fa4_sm90_128x176_c2"),
        (" 192X112-c2-ss ", (192, 112, 2, True, False, 0), "fa4_sm90_192x112_c2_ss"),
        ("128x176-c2-gqa-p", (128, 176, 2, False, True, 132), "fa4_sm90_128x176_c2_gqa_p132"),
        ("128x176-c1-p128", (128, 176, 1, False, False, 128), "fa4_sm90_128x176_c1_p128"),
        ("128x128-c4", (128, 128, 4, False, False, 0), "fa4_sm90_128x128_c4"),
        ("128x144-c2-v3", (128, 144, 2, False, False, 0, 2, 3), "fa4_sm90_128x144_c2_v3"),
        ("128x128-c2-k3-v3", (128, 128, 2, False, False, 0, 3, 0), "fa4_sm90_128x128_c2_k3"),
        ("128x128-c2-v2", (128, 128, 2, False, False, 0, 2, 0), "fa4_sm90_128x128_c2"),
        ("128x128-c2-rs", (128, 128, 2, False, False, 0, 2, 0, True), "fa4_sm90_128x128_c2_rs"),
        ("128x144-c2-rs-v3", (128, 144, 2, False, False, 0, 2, 3, True), "fa4_sm90_128x144_c2_rs_v3"),
    ],
)
def test_export_specs_name_their_kernels(spec, fields, name):
    """The ahead-of-time kernels' specs (the product's gen kernel is fa4_sm90_128x176_c2); stages of K and V
    default to 2 and K's, and V's own count is kept only where it differs from K's."""
    ks = _fa4_export().KernelSpec.parse(spec)
    got = (
        ks.tile_m,
        ks.tile_n,
        ks.cluster_m,
        ks.p_in_smem,
        ks.pack_gqa,
        ks.persistent_sms,
        ks.stages_k,
        ks.stages_v,
        ks.q_in_regs,
    )
    assert got[: len(fields)] == fields
    assert ks.name == name


@pytest.mark.parametrize(
    "spec",
    [
        "128x176",
        "128x176-2",
        "128x176-c2-xx",
        "128x176-c2-p-p8",
        "axb-c2",
        "128x176-cz",
        "128x176-c2-v3-v3",
        "128x176-c2-kx",
        "128x176-c2-rs-rs",
    ],
)
def test_malformed_export_specs_name_the_form(spec):
    with pytest.raises(ValueError, match=r"must look like 128x176-c2\[-ss\]\[-rs\]\[-gqa\]\[-pN\]"):
        _fa4_export().KernelSpec.parse(spec)


@pytest.mark.parametrize("spec", ["100x176-c2", "128x300-c2", "128x176-c3"])
def test_export_specs_out_of_range(spec):
    with pytest.raises(ValueError, match="tile 64-192 rows"):
        _fa4_export().KernelSpec.parse(spec)


@pytest.mark.parametrize("spec", ["128x128-c2-k0", "128x128-c2-v5"])
def test_export_stage_counts_out_of_range(spec):
    with pytest.raises(ValueError, match="1-4 stages of K"):
        _fa4_export().KernelSpec.parse(spec)
