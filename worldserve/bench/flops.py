"""The FLOP model of performance.md §1 for one Cosmos3 gen-tower forward, and the bf16 roofline.

`F_fwd = L * [2 * N_g * P + 4 * N_g * (N_g + T) * H * d_h]` with `P` the linear parameters of one layer of
one tower (`D*H*d_h + 2*D*H_kv*d_h + H*d_h*D + 3*D*I` = 192.9e6 for Nano), N_g the gen tokens (video +
audio) and T the cached text tokens the gen queries also attend to. Norms, RoPE, softmax, embeddings and
heads (< 1 %) are not counted, nor the und text prefill (run once per CFG branch). A denoising step with
CFG is two forwards (cond and uncond, each with its own T). Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worldserve.models.cosmos3.config import Cosmos3Config

PEAK_BF16_TFLOPS = 790.0
"""Measured dense bf16 GEMM rate of one H200 on random data (performance.md §2); the roofline used here."""


@dataclass(frozen=True, slots=True)
class TowerShape:
    """The numbers the FLOP model needs from a Cosmos3Config."""

    layers: int = 36
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288

    @classmethod
    def from_config(cls, config: Cosmos3Config) -> TowerShape:
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
        )

    @property
    def linear_params_per_layer(self) -> int:
        """P: q, k, v, o and gate/up/down weights of one layer of one tower."""
        d, hd = self.hidden, self.head_dim
        return (
            d * self.heads * hd + 2 * d * self.kv_heads * hd + self.heads * hd * d + 3 * d * self.intermediate
        )


NANO = TowerShape()


def forward_flops_split(n_gen: int, n_text: int, shape: TowerShape = NANO) -> tuple[float, float]:
    """(linear, attention) FLOPs of one gen forward over `n_gen` tokens with `n_text` cached text keys."""
    linear = shape.layers * 2.0 * n_gen * shape.linear_params_per_layer
    attention = shape.layers * 4.0 * n_gen * (n_gen + n_text) * shape.heads * shape.head_dim
    return linear, attention


def forward_flops(n_gen: int, n_text: int, shape: TowerShape = NANO) -> float:
    """F_fwd of one CFG branch."""
    linear, attention = forward_flops_split(n_gen, n_text, shape)
    return linear + attention


def step_flops(n_gen: int, text_tokens: tuple[int, ...], shape: TowerShape = NANO) -> float:
    """One denoising step: one forward per CFG branch (`text_tokens` = (T_cond, T_uncond) for CFG)."""
    return sum(forward_flops(n_gen, t, shape) for t in text_tokens)


def tflops(flops: float, seconds: float) -> float:
    """Achieved model TFLOP/s."""
    return flops / seconds / 1e12


def roofline_seconds(flops: float, peak_tflops: float = PEAK_BF16_TFLOPS) -> float:
    """The physical floor: all FLOPs at the measured bf16 GEMM peak."""
    return flops / (peak_tflops * 1e12)
