"""Stateless flow-matching samplers: an immutable `FlowSchedule` plus per-request `SolverState`.

Inputs per step: the schedule, the request's solver state, the step index, the (CFG-combined) velocity
`v = noise - x0` and the current sample `x_t`. Output: the next sample and a new state; nothing is
mutated, so a server can step many requests that sit at different steps (or use different schedules)
in one batch, each with its own `SolverState` (design.md §3.4 anti-pattern 5).

Maths: flow UniPC (order 2, bh2, data prediction `x0 = x_t - sigma * v`, corrector from step 1, order 1
on the last step), exactly as diffusers' `UniPCMultistepScheduler` computes it. Step
coefficients are derived once per schedule with float32 0-d tensor arithmetic in diffusers' order of
operations and kept as Python floats. All updates run in float32 (the sampling state is fp32, as in the
Cosmos3 pipeline, which upcasts velocities with `.float()`): float32 trajectories match diffusers bit for
bit; other input dtypes are upcast and the result is cast back to the sample's dtype (diffusers would
instead round its coefficients to bf16, so only float32 is a parity guarantee).
Invariant: the state keeps references to the tensors it is given; callers must not modify a tensor in
place after passing it in (the returned sample is always a fresh tensor and is safe to edit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

SOLVER_ORDER = 2
"""UniPC order used by the Cosmos3 reference (cosmos-framework and diffusers: solver_order=2)."""


@dataclass(frozen=True, slots=True)
class _Coeffs:
    """Float32-exact scalars of one UniPC update from sigma `s0` to sigma `t` (diffusers' names)."""

    ratio: float
    """sigma_t / sigma_s0: weight of the sample."""
    x0_weight: float
    """alpha_t * h_phi_1: weight of the newest x0 prediction (subtracted)."""
    res_weight: float
    """alpha_t * B_h: weight of the higher-order residual (subtracted)."""
    rk: float
    """(lambda_prev - lambda_s0) / h: divides the x0 difference (order 2 only, else nan)."""
    rho: tuple[float, ...]
    """Corrector: rhos_c for this order (order 1: (0.5,)); predictor order 2: (0.5,)."""


def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
    # lambda = log(alpha) - log(sigma) with alpha = 1 - sigma (flow sigmas), float32 0-d as diffusers.
    return torch.log(1 - sigma) - torch.log(sigma)


def _coeffs(sig: torch.Tensor, s0: int, t: int, prev: int, order: int, corrector: bool) -> _Coeffs:
    """Mirror of diffusers' multistep_uni_{p,c}_bh_update scalar maths (predict_x0, bh2)."""
    sigma_t, sigma_s0 = sig[t], sig[s0]
    alpha_t = 1 - sigma_t
    lambda_t, lambda_s0 = _log_snr(sigma_t), _log_snr(sigma_s0)
    h = lambda_t - lambda_s0
    hh = -h
    h_phi_1 = torch.expm1(hh)
    b_h = torch.expm1(hh)  # bh2
    rks = []
    if order == 2:
        rks.append((_log_snr(sig[prev]) - lambda_s0) / h)
    rks.append(torch.ones((), dtype=torch.float32))
    rks_t = torch.stack(rks)
    rho: tuple[float, ...] = (0.5,)
    if corrector and order == 2:
        h_phi_k = h_phi_1 / hh - 1
        factorial_i = 1
        r_rows, b = [], []
        for i in range(1, order + 1):
            r_rows.append(torch.pow(rks_t, i - 1))
            b.append(h_phi_k * factorial_i / b_h)
            factorial_i *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial_i
        rho = tuple(float(r) for r in torch.linalg.solve(torch.stack(r_rows), torch.stack(b)))
    return _Coeffs(
        ratio=float(sigma_t / sigma_s0),
        x0_weight=float(alpha_t * h_phi_1),
        res_weight=float(alpha_t * b_h),
        rk=float(rks_t[0]) if order == 2 else float("nan"),
        rho=rho,
    )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class FlowSchedule:
    """Immutable flow-matching sigma schedule of N steps plus its precomputed UniPC coefficients.

    Shared between requests (`native` is cached): never modify `sigmas` / `timesteps` in place.
    """

    sigmas: torch.Tensor
    """float64 (N+1,): decreasing, sigmas[:N] in (0, 1), sigmas[N] == 0. The solver uses float32 copies."""
    timesteps: torch.Tensor
    """int64 (N,): int(sigma * num_train_timesteps), truncated; the network gets timesteps[i] * 0.001."""
    shift: float
    """Flow shift that produced `sigmas` (informational)."""
    num_train_timesteps: int = 1000
    """Training timestep count (1000 for Cosmos3)."""
    _predictor: tuple[tuple[_Coeffs, ...], ...] = field(init=False, repr=False)
    _corrector: tuple[tuple[_Coeffs, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        s, t = self.sigmas, self.timesteps
        if s.dtype != torch.float64 or s.ndim != 1 or len(s) < 2:
            raise ValueError("sigmas must be a 1-D float64 tensor of N+1 >= 2 values")
        if t.dtype != torch.int64 or t.shape != (len(s) - 1,):
            raise ValueError(
                f"timesteps must be int64 of shape ({len(s) - 1},), got {t.dtype} {tuple(t.shape)}"
            )
        if s[-1] != 0 or not bool(((s[:-1] > 0) & (s[:-1] < 1)).all()) or not bool((s[1:] <= s[:-1]).all()):
            raise ValueError("sigmas must decrease, lie in (0, 1) and end in exactly 0")
        sig = s.to(torch.float32)  # diffusers stores float32 sigmas; all solver maths uses them
        # Predictor i moves sigma[i] -> sigma[i+1] (order 2 also uses sigma[i-1]); the corrector at step i
        # refines the previous move sigma[i-1] -> sigma[i] (order 2 also uses sigma[i-2]). Tables are indexed
        # [step][order - 1] and hold every order a state can ask for there.
        pred, corr = [], []
        for i in range(len(t)):
            pred.append(tuple(_coeffs(sig, i, i + 1, i - 1, o, False) for o in range(1, min(i + 1, 2) + 1)))
            corr.append(tuple(_coeffs(sig, i - 1, i, i - 2, o, True) for o in range(1, min(i, 2) + 1)))
        object.__setattr__(self, "_predictor", tuple(pred))
        object.__setattr__(self, "_corrector", tuple(corr))

    @classmethod
    def from_base_sigmas(
        cls, base: Sequence[float] | np.ndarray, shift: float, num_train_timesteps: int = 1000
    ) -> FlowSchedule:
        """diffusers' `use_flow_sigmas` path: shift the N base sigmas, nudge a first sigma within 1e-6 of 1
        down by 1e-6 (keeps log(alpha) finite), truncate sigma*T to int64 timesteps, append a final 0."""
        if not (np.isfinite(shift) and shift > 0):
            raise ValueError(f"flow shift must be a positive number, got {shift}")
        s = np.asarray(base, dtype=np.float64).copy()
        if s.ndim != 1 or len(s) < 1:
            raise ValueError("base sigmas must be a non-empty 1-D sequence")
        s = shift * s / (1 + (shift - 1) * s)
        if np.fabs(s[0] - 1) < 1e-6:
            s[0] -= 1e-6
        timesteps = torch.from_numpy(s * num_train_timesteps).to(torch.int64)
        sigmas = torch.from_numpy(np.concatenate([s, [0.0]]))
        return cls(
            sigmas=sigmas, timesteps=timesteps, shift=float(shift), num_train_timesteps=num_train_timesteps
        )

    @classmethod
    def native(cls, num_steps: int, shift: float, num_train_timesteps: int = 1000) -> FlowSchedule:
        """The cosmos-framework (reference) schedule: base linspace(1 - 1/T, 0, N+1)[:-1], i.e. 0.999 .. 0.

        1 - 1/1000 == 0.999 exactly in float64, so this is the reference's linspace(0.999, 0, N+1)[:-1]
        and what diffusers' Cosmos3 pipeline passes with use_native_flow_schedule=True.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        return _native_schedule(int(num_steps), float(shift), int(num_train_timesteps))

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def sigma(self, step_index: int) -> float:
        """The float32 sigma the solver uses at `step_index` (as a Python float)."""
        return float(self.sigmas[step_index].to(torch.float32))


def _native_base(num_steps: int, num_train_timesteps: int) -> np.ndarray:
    return np.linspace(1.0 - 1.0 / num_train_timesteps, 0.0, num_steps + 1)[:-1]


@lru_cache(maxsize=128)
def _native_schedule(num_steps: int, shift: float, num_train_timesteps: int) -> FlowSchedule:
    # Immutable, so requests with the same (steps, shift) share one schedule and its coefficient table.
    return FlowSchedule.from_base_sigmas(
        _native_base(num_steps, num_train_timesteps), shift, num_train_timesteps
    )


@dataclass(frozen=True, slots=True, eq=False)
class SolverState:
    """One request's UniPC history. Start with `SolverState()`; every step returns a new one."""

    x0_history: tuple[torch.Tensor, ...] = ()
    """The last <= 2 data predictions (x0 form), oldest first."""
    last_sample: torch.Tensor | None = None
    """The (corrected) sample the previous predictor started from; None before the first step."""
    last_order: int = 0
    """Order of the previous predictor (the corrector reuses it); 0 before the first step."""
    lower_order_nums: int = 0
    """Warm-up counter: steps taken, capped at the solver order."""
    next_step: int | None = None
    """The step index this state expects next; None for a fresh state (may start at any step)."""


def _check_step(
    schedule: FlowSchedule, step_index: int, velocity: torch.Tensor, sample: torch.Tensor
) -> None:
    if not 0 <= step_index < schedule.num_steps:
        raise ValueError(f"step_index {step_index} is outside [0, {schedule.num_steps})")
    if velocity.shape != sample.shape:
        raise ValueError(f"velocity shape {tuple(velocity.shape)} != sample shape {tuple(sample.shape)}")


def unipc_step(
    schedule: FlowSchedule, state: SolverState, step_index: int, velocity: torch.Tensor, sample: torch.Tensor
) -> tuple[torch.Tensor, SolverState]:
    """One flow-UniPC step (corrector, then predictor) of any-shaped `sample`; returns (x_next, new state).

    `velocity` is the model output at (`sample`, sigmas[step_index]); maths in float32, the result has
    sample's dtype and the new state holds float32 tensors.
    """
    _check_step(schedule, step_index, velocity, sample)
    out_dtype = sample.dtype
    sample, velocity = sample.float(), velocity.float()
    if state.next_step is not None and state.next_step != step_index:
        raise ValueError(f"solver state expects step {state.next_step}, got step_index {step_index}")
    x0 = sample - schedule.sigma(step_index) * velocity
    if step_index > 0 and state.last_sample is not None:
        c = schedule._corrector[step_index][state.last_order - 1]
        m0, x = state.x0_history[-1], state.last_sample
        corrected = c.ratio * x - c.x0_weight * m0
        update = c.rho[-1] * (x0 - m0)
        if state.last_order == 2:
            update = c.rho[0] * ((state.x0_history[-2] - m0) / c.rk) + update
        sample = corrected - c.res_weight * update
    history = (*state.x0_history, x0)[-SOLVER_ORDER:]
    # lower_order_final: order 1 on the last step; warm-up: order <= steps taken + 1.
    order = min(SOLVER_ORDER, schedule.num_steps - step_index, state.lower_order_nums + 1)
    p = schedule._predictor[step_index][order - 1]
    m0 = history[-1]
    x_next = p.ratio * sample - p.x0_weight * m0
    if order == 2:
        x_next = x_next - p.res_weight * (p.rho[0] * ((history[-2] - m0) / p.rk))
    new_state = SolverState(
        x0_history=history,
        last_sample=sample,
        last_order=order,
        lower_order_nums=min(state.lower_order_nums + 1, SOLVER_ORDER),
        next_step=step_index + 1,
    )
    return x_next.to(out_dtype), new_state
