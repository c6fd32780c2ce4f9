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
