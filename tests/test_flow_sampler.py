"""L1 sampler parity: our stateless FlowSchedule / SolverState UniPC and Euler against diffusers' schedulers.

Random velocity tensors with fixed seeds stand in for the model; diffusers is driven exactly as the Cosmos3
pipeline drives it with `use_native_flow_schedule=True` (sigmas passed to `set_timesteps`, `step(v, t, x)`
with a leading batch axis). Also checks CFG combine and the cond/uncond batch layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from worldserve.sampling.flow import (
    FlowSchedule,
    SolverState,
    unipc_step,
)
from worldserve.sampling.guidance import cfg_combine, guided_at, needs_uncond

# cosmos3-model.md §5.4: the reference schedule for 35 steps at shift 10.
DOC_TIMESTEPS_35_SHIFT_10 = [
    999, 996, 993, 990, 987, 983, 979, 975, 971, 966, 961, 956, 950, 944, 937, 930, 922, 913, 904, 893,
    882, 869, 855, 838, 820, 799, 775, 747, 714, 673, 624, 563, 483, 377, 227,
]  # fmt: skip
DOC_SIGMAS_35_SHIFT_10 = [
    0.9999, 0.9970, 0.9939, 0.9906, 0.9872, 0.9835, 0.9796, 0.9755, 0.9711, 0.9664, 0.9614, 0.9560, 0.9503,
    0.9441, 0.9374, 0.9301, 0.9222, 0.9135, 0.9041, 0.8937, 0.8822, 0.8694, 0.8551, 0.8390, 0.8207, 0.7998,
    0.7756, 0.7474, 0.7140, 0.6739, 0.6247, 0.5631, 0.4836, 0.3771, 0.2271,
]  # fmt: skip


def diffusers_unipc(num_steps: int, shift: float) -> UniPCMultistepScheduler:
    sched = UniPCMultistepScheduler(
        use_flow_sigmas=True,
        use_karras_sigmas=False,
        prediction_type="flow_prediction",
        flow_shift=shift,
        solver_order=2,
        solver_type="bh2",
    )
    # Exactly the pipeline's use_native_flow_schedule=True branch.
    sigmas = np.linspace(1.0 - 1.0 / sched.config.num_train_timesteps, 0.0, num_steps + 1)[:-1]
    sched.set_timesteps(num_steps, sigmas=sigmas)
    return sched


def random_run(num_steps: int, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    return x, [torch.randn(shape, generator=gen) for _ in range(num_steps)]


def reference_trajectory(sched, x, velocities, start: int = 0) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(sched.timesteps[start:]):
        x = sched.step(velocities[i].unsqueeze(0), t, x.unsqueeze(0), return_dict=False)[0].squeeze(0)
        out.append(x)
    return out


def our_trajectory(schedule, x, velocities, start: int = 0) -> list[torch.Tensor]:
    state, out = SolverState(), []
    for i, v in enumerate(velocities):
        x, state = unipc_step(schedule, state, start + i, v, x)
        out.append(x)
    return out


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shift", [3.0, 5.0, 10.0])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 35])
def test_unipc_matches_diffusers(num_steps, shift):
    ref_sched = diffusers_unipc(num_steps, shift)
    schedule = FlowSchedule.native(num_steps, shift)
    assert torch.equal(schedule.timesteps, ref_sched.timesteps)
    assert torch.equal(schedule.sigmas.to(torch.float32), ref_sched.sigmas)
    x, velocities = random_run(num_steps, (2, 48, 3, 4, 5), seed=num_steps * 100 + int(shift))
    ours = our_trajectory(schedule, x, velocities)
    ref = reference_trajectory(ref_sched, x, velocities)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.dtype == torch.float32
        assert max_rel_err(a, b) <= 1e-6, f"step {step}"
    # Same float32 operations in the same order: in practice bit-identical on CPU.
    assert torch.equal(ours[-1], ref[-1])


@pytest.mark.parametrize(("num_steps", "shift"), [(200, 10.0), (150, 10.0), (35, 100.0), (35, 50.0)])
def test_unipc_matches_diffusers_where_the_first_timestep_repeats(num_steps, shift):
    """Long or high-shift schedules that the API accepts (steps <= 200, flow_shift <= 100) start with a
    repeated integer timestep (999, 999, ...). diffusers' UniPC then looks its first step up at index 1 (the
    pipeline never calls set_begin_index) and fails at the last step; pinned to index 0, as our schedule
    walks by index, it is the same sampler, step for step."""
    ref_sched = diffusers_unipc(num_steps, shift)
    assert ref_sched.timesteps[0] == ref_sched.timesteps[1] == 999
    ref_sched.set_begin_index(0)
    schedule = FlowSchedule.native(num_steps, shift)
    assert torch.equal(schedule.timesteps, ref_sched.timesteps)
    x, velocities = random_run(num_steps, (48, 2, 2, 3), seed=num_steps + int(shift))
    ours = our_trajectory(schedule, x, velocities)
    ref = reference_trajectory(ref_sched, x, velocities)
    assert max(max_rel_err(a, b) for a, b in zip(ours, ref, strict=True)) <= 1e-6


def test_native_schedule_is_the_reference_table():
    schedule = FlowSchedule.native(35, 10.0)
    assert schedule.timesteps.tolist() == DOC_TIMESTEPS_35_SHIFT_10
    assert [round(s, 4) for s in schedule.sigmas[:-1].tolist()] == DOC_SIGMAS_35_SHIFT_10
    assert schedule.sigmas[-1] == 0 and schedule.sigmas.dtype == torch.float64
    assert schedule.timesteps.dtype == torch.int64 and schedule.num_steps == 35
    # diffusers' native base linspace(1 - 1/1000, 0) is the reference's linspace(0.999, 0) exactly.
    for n in (1, 2, 3, 35, 50, 200):
        assert np.array_equal(np.linspace(1 - 1 / 1000, 0, n + 1), np.linspace(0.999, 0, n + 1))
    assert FlowSchedule.native(35, 10.0) is schedule  # cached: one immutable table per (steps, shift)


def test_default_flow_base_nudges_first_sigma_like_diffusers():
    ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=10.0)
    ref.set_timesteps(35)  # base linspace(1, 1/1000): first sigma is 1 -> lowered by 1e-6
    ours = FlowSchedule.from_base_sigmas(np.linspace(1, 1 / 1000, 36)[:-1], 10.0)
    assert torch.equal(ours.sigmas.to(torch.float32), ref.sigmas)
    assert torch.equal(ours.timesteps, ref.timesteps)
    assert ours.sigmas[0].item() == pytest.approx(1 - 1e-6, abs=1e-12)


def test_fresh_state_mid_schedule_matches_diffusers_begin_index():
    ref_sched = diffusers_unipc(10, 5.0)
    ref_sched.set_begin_index(4)
    x, velocities = random_run(6, (3, 7), seed=7)
    ours = our_trajectory(FlowSchedule.native(10, 5.0), x, velocities, start=4)
    ref = reference_trajectory(ref_sched, x, velocities, start=4)
    assert torch.equal(ours[-1], ref[-1])


def test_interleaved_requests_step_independently():
    sched_a, sched_b = FlowSchedule.native(6, 10.0), FlowSchedule.native(4, 3.0)
    xa, va = random_run(6, (2, 3, 4), seed=1)
    xb, vb = random_run(4, (5,), seed=2)
    alone_a, alone_b = our_trajectory(sched_a, xa, va), our_trajectory(sched_b, xb, vb)
    # Request b joins two steps later; both then advance tick by tick, interleaved (a server's view).
    state_a, state_b, ya, yb = SolverState(), SolverState(), xa, xb
    for tick in range(6):
        ya, state_a = unipc_step(sched_a, state_a, tick, va[tick], ya)
        if tick >= 2:
            yb, state_b = unipc_step(sched_b, state_b, tick - 2, vb[tick - 2], yb)
    assert torch.equal(ya, alone_a[-1]) and torch.equal(yb, alone_b[-1])


def test_step_is_pure_and_validates():
    schedule = FlowSchedule.native(3, 10.0)
    x, velocities = random_run(3, (4, 4), seed=3)
    x_copy, v_copy = x.clone(), velocities[0].clone()
    state0 = SolverState()
    y1, s1 = unipc_step(schedule, state0, 0, velocities[0], x)
    assert torch.equal(x, x_copy) and torch.equal(velocities[0], v_copy)
    assert state0.last_sample is None and state0.x0_history == () and state0.next_step is None
    y1_again, _ = unipc_step(schedule, state0, 0, velocities[0], x)
    assert torch.equal(y1, y1_again)
    assert s1.next_step == 1 and s1.last_order == 1 and len(s1.x0_history) == 1
    with pytest.raises(ValueError, match="expects step 1"):
        unipc_step(schedule, s1, 2, velocities[2], y1)
    with pytest.raises(ValueError, match="outside"):
        unipc_step(schedule, SolverState(), 3, velocities[0], x)
    with pytest.raises(ValueError, match="shape"):
        unipc_step(schedule, s1, 1, velocities[1][:2], y1)


def test_low_precision_inputs_step_in_float32():
    """bf16 samples and velocities step in float32 maths: each bf16 step is exactly the float32 step of the
    same (upcast) inputs rounded to bf16, and the solver state holds float32 tensors. (A tolerance against a
    float32 trajectory could not tell: bf16 maths stayed inside one.)"""
    schedule = FlowSchedule.native(5, 10.0)
    x, velocities = random_run(5, (8, 16), seed=4)
    x_low, state_low, state_ref = x.bfloat16(), SolverState(), SolverState()
    for i, v in enumerate(velocities):
        v_low = v.bfloat16()
        nxt, state_low = unipc_step(schedule, state_low, i, v_low, x_low)
        ref, state_ref = unipc_step(schedule, state_ref, i, v_low.float(), x_low.float())
        assert nxt.dtype == torch.bfloat16 and torch.equal(nxt, ref.bfloat16()), f"step {i}"
        assert {t.dtype for t in (*state_low.x0_history, state_low.last_sample)} == {torch.float32}
        x_low = nxt


def _euler_step(schedule: FlowSchedule, i: int, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """Flow-matching Euler on the schedule's sigmas, x + (sigma_next - sigma) * v in float32."""
    sig = schedule.sigmas[i : i + 2].to(torch.float32)
    return (sample.float() + float(sig[1] - sig[0]) * velocity.float()).to(sample.dtype)


def test_schedule_sigmas_step_as_diffusers_flow_match_euler():
    """The schedule's shifted sigmas are FlowMatchEuler's (each Euler step on them equals its step)."""
    num_steps, shift = 8, 5.0
    ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(sigmas=np.linspace(0.999, 0, num_steps + 1)[:-1].tolist())
    schedule = FlowSchedule.native(num_steps, shift)
    x, velocities = random_run(num_steps, (3, 6), seed=5)
    y = x
    for i, t in enumerate(ref.timesteps):
        x = ref.step(velocities[i], t, x, return_dict=False)[0]
        y = _euler_step(schedule, i, velocities[i], y)
    # FlowMatchEuler shifts its sigmas in float32 (a last-ulp difference from our float64 table).
    torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-6)
    sig = schedule.sigmas.to(torch.float32)
    z = _euler_step(schedule, 0, velocities[0], velocities[1])
    assert torch.equal(z, velocities[1] + float(sig[1] - sig[0]) * velocities[0])


def test_cfg_combine_and_rule():
    gen = torch.Generator().manual_seed(6)
    cond, uncond = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
    assert torch.equal(cfg_combine(cond, uncond, 6.0), uncond + 6.0 * (cond - uncond))
    assert cfg_combine(cond, None, 1.0) is cond  # diffusers skips the uncond pass at exactly 1.0
    assert needs_uncond(6.0) and needs_uncond(0.0) and needs_uncond(0.5) and not needs_uncond(1.0)
    assert torch.equal(cfg_combine(cond, uncond, 0.0), uncond)
    with pytest.raises(ValueError, match="unconditional"):
        cfg_combine(cond, None, 6.0)


def test_guidance_interval_rule():
    assert guided_at(6.0, None, 999) and guided_at(6.0, None, 1)
    assert not guided_at(1.0, None, 500) and not guided_at(1.0, (0, 1000), 500)
    assert guided_at(6.0, (400, 1000), 400) and guided_at(6.0, (400, 1000), 1000)
    assert not guided_at(6.0, (400, 1000), 399)
