"""`worldserve info [MODEL]`: the resolved checkpoint path, components, parameter counts, dtypes and defaults
(video requests', and the chat sampling defaults its generation_config.json gives `serve`), and the
transformer's memory in bf16, resident and with --enable-layerwise-offload.

Reads only configs and safetensors headers (no tensor data; the memory plan builds the model on the meta
device), so it is instant even on the 33 GB checkpoint.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worldserve.params import VideoParams, default_flow_shift
from worldserve.sampling.chat_defaults import ChatDefaults
from worldserve.weights.checkpoint import CheckpointLayout, read_layout, resolve_model

if TYPE_CHECKING:
    from worldserve.models.cosmos3.config import Cosmos3Config

COMPONENT_WEIGHTS = {
    "transformer": "diffusion_pytorch_model",
    "vae": "diffusion_pytorch_model",
    "sound_tokenizer": "diffusion_pytorch_model",
    "vision_encoder": "model",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None, help="folder or HF repo id (default: embedded tiny model)"
    )
    p.add_argument("--revision", default=None, help="HF revision (branch, tag or commit)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def describe(root: Path, layout: CheckpointLayout | None = None) -> dict:
    """The checkpoint at `root` (its `read_layout`, when the caller has it already)."""
    from worldserve.weights.loader import check_transformer_header, read_header  # (torch: not for --help)

    layout = layout if layout is not None else read_layout(root)
    components: dict[str, dict[str, Any]] = {}  # component -> its parameters, dtypes and files
    for name in layout.components:
        prefix = COMPONENT_WEIGHTS.get(name)
        if prefix is None:
            components[name] = {}
            continue
        header = read_header(root / name, prefix)
        # (the transformer's keys against the config, headers only: generate refused what info passed)
        if name == "transformer":
            check_transformer_header(root, header)
        params = sum(_numel(s) for s in header.shapes.values())
        components[name] = {
            "parameters": params,
            "dtypes": dict(Counter(header.dtypes.values())),
            "files": len(set(header.files.values())),
        }
    d = VideoParams(prompt="-")
    return {
        "path": str(root),
        "pipeline": layout.model_index.get("_class_name"),
        "components": components,
        "transformer": {
            "layers": layout.transformer_config.num_hidden_layers,
            "hidden_size": layout.transformer_config.hidden_size,
            "head_dim": layout.transformer_config.head_dim,
            "sound_gen": layout.transformer_config.sound_gen,
            "action_gen": layout.transformer_config.action_gen,
        },
        "generation_defaults": {
            "size": f"{d.width}x{d.height}",
            "num_frames": d.num_frames,
            "fps": d.fps,
            "num_inference_steps": d.num_inference_steps,
            "guidance_scale": d.guidance_scale,
            "flow_shift": default_flow_shift(d.width, d.height),
            "seed": d.seed,
            "generate_sound": layout.has_sound,
        },
        # what `serve --generation-config auto` gives chats that omit them (ValueError: a bad file)
        "chat_defaults": _chat_defaults(root),
    }


def _chat_defaults(root: Path) -> dict:
    """The chat sampling defaults of the checkpoint's generation_config.json (vLLM's neutral ones without it),
    or {"error": why} for a file serve would refuse."""
    try:
        d = ChatDefaults.load("auto", root)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "min_p": d.min_p,
            "repetition_penalty": d.repetition_penalty, "max_tokens": d.max_tokens,
            "source": d.source or "vLLM's neutral defaults: no generation_config.json"}  # fmt: skip


def memory_plan(config: Cosmos3Config) -> dict:
    """GiB of the bf16 transformer: all on the GPU, and under layerwise offload (GPU: everything but the
    layers plus two slots per tower; host: the und and gen blocks, pinned in power-of-two chunks); and the
    Reasoner's default K/V cache at the default --max-model-len (its bytes a token: kv_bytes_per_token)."""
    import torch

    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.models.layers.offload import block_layout, pinned_chunks

    with torch.device("meta"):
        model = Cosmos3Transformer(config, dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    towers = [block_layout(getattr(model.layers[0], tower))[1] for tower in ("und", "gen")]
    n = len(model.layers)
    layers = sum(n * b for b in towers)
    pinned = sum(size for b in towers for size, _ in pinned_chunks(n, b))
    from worldserve.runner.reasoner import DEFAULT_MAX_MODEL_LEN, default_kv_cache_tokens

    gib = 2**30
    per_token = model.und_kv_bytes_per_token()
    return {
        "resident_gib": total / gib,
        "offload_gpu_gib": (total - layers + 2 * sum(towers)) / gib,
        "offload_host_pinned_gib": pinned / gib,
        "kv_cache_gib": default_kv_cache_tokens(DEFAULT_MAX_MODEL_LEN) * per_token / gib,
        "kv_cache_offload_gib": default_kv_cache_tokens(DEFAULT_MAX_MODEL_LEN, layerwise_offload=True)
        * per_token
        / gib,
        "kv_bytes_per_token": per_token,
    }


def runtime(head_dim: int) -> dict:
    """What this machine would run the model with: torch, the default device, the attention kernel."""
    import torch

    from worldserve.models.layers.fa4_cluster import fa4_cluster_unavailable_reason
    from worldserve.models.layers.flash_attention import fa3_unavailable_reason
    from worldserve.runner.devices import default_device, default_dtype

    device = default_device()
    cuda, dtype = device.type == "cuda", default_dtype(device)
    reason = fa3_unavailable_reason(device, dtype, head_dim)
    if reason is not None:
        attention = f"PyTorch SDPA (FA3 not used: {reason})"
    elif (fa4 := fa4_cluster_unavailable_reason(device, dtype, head_dim)) is None:
        attention = "FlashAttention-3, the gen tower FlashAttention-4 with 2-CTA clusters"
    else:
        attention = f"FlashAttention-3 (the FA4 cluster kernel not used: {fa4})"
    return {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "attention": attention,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run(args: argparse.Namespace) -> int:
    root = resolve_model(args.model, args.revision)
    layout = read_layout(root)
    info = describe(root, layout)
    info["runtime"] = runtime(info["transformer"]["head_dim"])
    info["transformer_memory"] = memory_plan(layout.transformer_config)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"path:       {info['path']}")
    print(f"pipeline:   {info['pipeline']}")
    if args.model is None:
        print("note:       the embedded tiny checkpoint has random weights; its outputs are noise")
    for name, c in info["components"].items():
        if c:
            dtypes = ", ".join(f"{k} x{v}" for k, v in c["dtypes"].items())
            print(f"{name:16s} {c['parameters'] / 1e6:12.3f} M params  {c['files']} file(s)  {dtypes}")
        else:
            print(f"{name:16s} (configuration only)")
    print("defaults:   " + ", ".join(f"{k}={v}" for k, v in info["generation_defaults"].items()))
    chat = dict(info["chat_defaults"])
    source = chat.pop("source", None)
    print(
        "chats:      " + ", ".join(f"{k}={v}" for k, v in chat.items()) + (f" ({source})" if source else "")
    )
    per_token = info["transformer_memory"]["kv_bytes_per_token"]
    m = {
        k: (f"{v:.2f} GiB" if v >= 0.1 else f"{v * 1024:.2f} MiB")
        for k, v in info["transformer_memory"].items()
        if k != "kv_bytes_per_token"
    }
    print(
        f"memory:     transformer in bf16 {m['resident_gib']} on the GPU; with --enable-layerwise-offload "
        f"{m['offload_gpu_gib']} on the GPU + {m['offload_host_pinned_gib']} pinned host RAM"
    )
    print(
        f"K/V cache:  {per_token / 1024:.1f} KiB a token in bf16 (twice that in float32, the CPU's dtype); "
        f"Reasoner default {m['kv_cache_gib']} ({m['kv_cache_offload_gib']} under offload) at --max-model-len "
        "32768 (--kv-cache-memory-bytes)"
    )
    rt = info["runtime"]
    print(
        f"runtime:    torch {rt['torch']} on {rt['device']} ({rt['gpus']} GPU(s)); attention: {rt['attention']}"
    )
    return 0
