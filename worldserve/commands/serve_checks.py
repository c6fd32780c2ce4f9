"""`worldserve serve`'s checks before anything binds, loads or downloads: of the model's device and checkpoint
(`check_device_and_checkpoint`, called by serve.run for every backend but `--backend fake`), and that no
many-valued flag took the MODEL as one of its values (`check_model_not_taken`, called by serve.engine_config).

Inputs: a resolved EngineConfig (the flags' values, for the second). Outputs: nothing, or the refusal:
ValueError for a flag value the device or the checkpoint cannot take, or for a MODEL taken by a flag (serve's exit 2), CheckpointError for a checkpoint on disk that cannot be read
(exit 1). The checkpoint is read only when it is on disk (a local folder or the embedded tiny one); a Hub name
is checked as it loads. Separate from commands/serve.py, which parses the flags and runs the server.
"""

from __future__ import annotations

import re
from pathlib import Path

from worldserve.commands import serve_backend
from worldserve.commands.serve_config_file import GIVEN
from worldserve.config import EngineConfig


def check_device_and_checkpoint(config: EngineConfig) -> None:
    """The flags the checkpoint bounds, --device against the parallel layout, and the kernels the flags ask
    for on that device, in that order."""
    from worldserve.runner.devices import check_layout_device

    par = config.parallel
    _check_against_checkpoint(config)
    check_layout_device(
        config.model.device,
        cfg_parallel_size=par.cfg_parallel_size,
        ulysses_degree=par.ulysses_degree,
        tensor_parallel_size=par.tensor_parallel_size,
    )
    _check_kernels(config)


def _check_kernels(config: EngineConfig) -> None:
    """--quantization fp8 / --fp8-attention / FLASH_ATTN where they cannot run: ValueError before the model
    loads (as generate; serve found it after loading, exit 1). Nano's head_dim: FA3's support does not vary
    with the checkpoint's size otherwise."""
    import torch

    from worldserve.runner.devices import default_device, default_dtype

    device = torch.device(config.model.device) if config.model.device else default_device()
    dtype = getattr(torch, config.model.dtype) if config.model.dtype else default_dtype(device)
    config.model.kernel_options(enable_layerwise_offload=config.parallel.enable_layerwise_offload).check(
        device, dtype
    )


def _check_against_checkpoint(config: EngineConfig) -> None:
    """The flags that a checkpoint's config.json bounds (the parallel degrees' head and MLP splits, the
    context against its positions, the K/V pool against one context), checked before the model loads when the
    checkpoint is on disk (a local folder or the embedded tiny one; a Hub name is checked as it loads)."""
    from worldserve.runner.parallel_pipeline import check_checkpoint_layout
    from worldserve.runner.reasoner import check_context
    from worldserve.weights.checkpoint import read_transformer_config, resolve_model

    model = config.model.model
    if model is not None and not Path(model).expanduser().is_dir():
        return
    root = resolve_model(model)
    par = config.parallel
    # (read as the loader reads it: a broken checkpoint is a CheckpointError naming the file, exit 1)
    check_checkpoint_layout(read_transformer_config(root), ulysses=par.ulysses_degree,
                            tp=par.tensor_parallel_size)  # fmt: skip
    if par.tensor_parallel_size == 1:  # (no Reasoner under tensor parallel: no context to check)
        check_context(root, config.reasoner.max_model_len)
        # (the load checks it again, for a Hub name; here a bad value is exit 2 before the port binds)
        serve_backend.check_kv_cache_fits(config.model, config.reasoner, root)
    if (static := config.lora.static_lora) is not None:  # (its files against the transformer's shapes)
        from worldserve.runner.lora_cache import check_adapter_fits

        check_adapter_fits(root, static, "--lora-path", config.lora.max_lora_rank)


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
"""A Hugging Face repo id's shape (owner/name)."""


def check_model_not_taken(values: dict) -> None:
    """No MODEL was parsed: ValueError when a many-valued flag took a checkpoint folder as one of its values
    (`serve --api-key K ./ckpt`: the folder became a second key and the tiny default was served; a second
    domain of --allowed-media-domains likewise), or a Hub
    repo id as a --served-model-name value after its first on the command line (`serve --served-model-name foo
    nvidia/Cosmos3-Nano`: the tiny random model was served under both names; vLLM refuses that order too). A
    lone `--served-model-name org/name` without MODEL stays the tiny default's name."""
    given_here = values.get(GIVEN, ())  # the flags the command line gave (not --config's)
    for flag in ("api_key", "served_model_name", "allowed_media_domains"):
        given = values.get(flag)
        for i, value in enumerate([given] if isinstance(given, str) else given or ()):
            if value and Path(value).is_dir():  # ("" is the current folder to Path: left to the flag's check)
                what = "a folder"
            elif HUB_ID.fullmatch(value or "") and (
                flag == "allowed_media_domains"
                or (flag == "served_model_name" and i > 0 and flag in given_here)
            ):  # (a domain has no "/": a repo id there is the MODEL, wherever it stands)
                what = "a Hugging Face repo id"  # (an API key may be shaped so; a --config list has no order)
            else:
                continue
            raise ValueError(f"--{flag.replace('_', '-')} took {value!r}, {what}, as one of its values, so no "
                             "MODEL was given: put MODEL first (serve MODEL --options)")  # fmt: skip
