"""Which devices a command runs on, checked before anything loads (a checkpoint given as a Hugging Face id
would be downloaded first): `--device` (cpu, cuda, cuda:N), and for a parallel layout one GPU per rank
(cuda:0..world-1). Every refusal is a ValueError with one line naming the flags, for the commands to print."""

from __future__ import annotations

import torch

from worldserve.runner.parallel_layout import ParallelLayout


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """The model dtype when none is asked for: bf16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_device(device: str | torch.device | None) -> None:
    """ValueError for a --device this machine does not have: a CUDA device without CUDA, or past the visible
    GPUs, or no device at all."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= n:
            raise ValueError(f"--device {device} needs CUDA GPU {dev.index or 0}; {n} visible")
    elif dev.type != "cpu":
        raise ValueError(f"--device {device!r} is not supported: use cpu, cuda or cuda:N")


def rank_devices(device: str | torch.device | None, world: int, flags: str) -> list[torch.device]:
    """One device per rank: cuda:0..world-1 by default; all cpu only when asked explicitly. `flags`: the
    command-line flags that asked for `world` ranks (for the error messages)."""
    if device is not None and torch.device(device).type == "cpu":
        return [torch.device("cpu")] * world
    if device is not None and str(device) != "cuda":
        raise ValueError(f"{flags} runs on cuda:0..cuda:{world - 1}; use --device cuda, got {device}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < world:
        hint = "Use fewer GPUs" if n else "--device cpu runs the ranks on the CPU (gloo)"
        raise ValueError(f"{flags} needs {world} CUDA GPUs; {n} visible. {hint}")
    return [torch.device("cuda", r) for r in range(world)]


def check_layout_device(
    device: str | torch.device | None,
    *,
    cfg_parallel_size: int = 1,
    ulysses_degree: int = 1,
    tensor_parallel_size: int = 1,
) -> None:
    """check_device for a one-GPU layout, or the GPUs a parallel layout needs (one per rank)."""
    layout = ParallelLayout(cfg=cfg_parallel_size, ulysses=ulysses_degree, tp=tensor_parallel_size)
    if layout.world == 1:
        check_device(device)
    else:
        rank_devices(device, layout.world, layout.flags)
