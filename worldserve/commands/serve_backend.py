"""`worldserve serve`'s model loading: the video pipeline, the startup warm-up shapes, and the Reasoner sharing
its transformer (`load_backend_within` runs `load_backend` in a thread bounded by --init-timeout).

`load_backend` resolves MODEL (none: the embedded tiny random checkpoint, loudly), loads the pipeline with the
kernel, parallel and offload options, generates each --warmup-shapes shape once (one step + decode: compiles
and kernel selection before serving), and, unless tensor parallel, builds the Reasoner over the same und
tower and warms it up on a GPU (its decode step's and prefill's graphs captured), with the sampling defaults
of --generation-config (sampling/chat_defaults.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worldserve.commands.bounded_load import LoadTimeout, bounded_load
from worldserve.config import LoraConfig, ModelConfig, ParallelConfig, ReasonerConfig, SchedulerConfig
from worldserve.sampling.chat_defaults import ChatDefaults
from worldserve.weights.load_lock import model_loads

LOAD_ABANDONED = threading.Event()
"""Set when load_backend_within stops waiting for a load still running (--init-timeout, or a signal): the
interpreter's exit then aborts the process in torch's C++ teardown (SIGABRT, exit 134), so cli.console leaves
at once instead."""

if TYPE_CHECKING:
    from worldserve.params import LoraRequest
    from worldserve.runner.parallel_pipeline import ParallelPipeline
    from worldserve.runner.reasoner import Reasoner
    from worldserve.runner.video_pipeline import VideoPipeline

log = logging.getLogger("worldserve.serve")


@model_loads("the model")
def load_backend(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    scheduler: SchedulerConfig = SchedulerConfig(),
    chat: ReasonerConfig = ReasonerConfig(),
    lora: LoraConfig = LoraConfig(),
) -> tuple[Any, ...]:
    """(VideoBackend, GPU-memory reader or None[, chat backend: the Reasoner sharing the transformer, built
    with `chat`'s context, caches and sampling defaults]).
    `--cfg-parallel-size 2` and / or `--ulysses-degree N`, or `--tensor-parallel-size N` (no Reasoner then): a
    ParallelPipeline over their product of GPUs. The whole load holds the process's model-load lock (its steps
    below run inside it)."""
    if cfg.backend == "fake":
        from worldserve.engine.fake_backend import FakeBackend

        log.warning("--backend fake: serving numpy colour frames, no model (tests only)")
        return FakeBackend(step_delay=cfg.fake_step_delay), None
    from worldserve.weights.checkpoint import resolve_model

    path = resolve_model(cfg.model, cfg.revision)
    if cfg.model is None:
        _warn_tiny_default(path)
    pipeline = _load_video_pipeline(path, cfg, parallel, chat, lora)
    gpu_memory = _gpu_memory_reader(cfg)
    warm_up_shapes(pipeline, cfg.warmup_shape_list(on_gpu=pipeline.device.type == "cuda"), lora.static_lora)
    if parallel.tensor_parallel_size > 1:
        log.warning("--tensor-parallel-size %d: the Reasoner chat API is off (its und tower is sharded across "
                    "the ranks); use --ulysses-degree to keep it", parallel.tensor_parallel_size)  # fmt: skip
        return pipeline, gpu_memory
    return pipeline, gpu_memory, _load_reasoner(path, pipeline, cfg, scheduler, chat)


def _warn_tiny_default(path: Path) -> None:
    """The loud warning that no MODEL was given: the embedded tiny random checkpoint at `path` makes noise."""
    bar = "=" * 88
    log.warning(bar)
    log.warning("No MODEL given: serving the embedded TINY RANDOM Cosmos3 checkpoint at %s", path)
    log.warning(
        'Its videos and audio are NOISE. For real output: worldserve serve nvidia/Cosmos3-Nano (or Engine("nvidia/Cosmos3-Nano"))'
    )
    log.warning(bar)


def _load_video_pipeline(
    path: Path, cfg: ModelConfig, parallel: ParallelConfig, chat: ReasonerConfig, lora: LoraConfig
) -> VideoPipeline | ParallelPipeline:
    """The checkpoint at `path` loaded as the video pipeline with `cfg`'s kernel options and `parallel`'s
    degrees and offload, and --lora-path's adapter loaded (merged as LoraConfig.merged_lora says); the
    Reasoner's K/V pool size (unless tensor parallel) and the adapter's files are checked before the weights
    load."""
    import torch

    from worldserve.runner.lora_cache import check_adapter_fits
    from worldserve.runner.video_pipeline import load_pipeline

    if parallel.tensor_parallel_size == 1:  # (no Reasoner under tensor parallel)
        check_kv_cache_fits(cfg, chat, path)
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    kernels = cfg.kernel_options(enable_layerwise_offload=parallel.enable_layerwise_offload)
    if (static := lora.static_lora) is not None:
        check_adapter_fits(path, static, "--lora-path", lora.max_lora_rank)
        kernels = dataclasses.replace(kernels, merged_lora=lora.merged_lora)
    pipeline = load_pipeline(
        path, cfg_parallel_size=parallel.cfg_parallel_size, ulysses_degree=parallel.ulysses_degree,
        tensor_parallel_size=parallel.tensor_parallel_size, device=cfg.device, dtype=dtype,
        vae_tiling=cfg.vae_tiling,
        kernels=kernels, max_loras=lora.max_cpu_loras, max_lora_rank=lora.max_lora_rank,
    )  # fmt: skip
    load_static_lora(pipeline, lora)
    return pipeline


def _gpu_memory_reader(cfg: ModelConfig) -> Callable[[], float] | None:
    """The metrics' reader of the GPU memory the model's device holds allocated, in bytes (None: not on a
    GPU)."""
    import torch

    gpu_memory = None
    if torch.cuda.is_available() and (cfg.device is None or cfg.device.startswith("cuda")):
        device = torch.device(cfg.device or "cuda")
        gpu_memory = lambda: float(torch.cuda.memory_allocated(device))  # noqa: E731
    return gpu_memory


def _load_reasoner(
    path: Path, pipeline: VideoPipeline | ParallelPipeline, cfg: ModelConfig, scheduler: SchedulerConfig,
    chat: ReasonerConfig,
) -> Reasoner:  # fmt: skip
    """The Reasoner over `pipeline`'s transformer (its und tower shared, its ViT loaded from `path`), with
    `chat`'s context, caches and sampling defaults (a warning naming those that differ from vLLM's neutral
    ones), warmed up on a GPU."""
    from worldserve.runner.reasoner import Reasoner

    defaults = chat_defaults(chat, path)
    if changed := defaults.changed():  # (vLLM's warning, with the values)
        log.warning("Reasoner requests' omitted sampling fields take %s from %s (--generation-config vllm for "
                    "vLLM's neutral defaults)", ", ".join(f"{k} {v}" for k, v in changed.items()), defaults.source)  # fmt: skip
    transformer = pipeline.transformer
    on_gpu = transformer.device.type == "cuda"
    kv_tokens = None
    if chat.kv_cache_memory_bytes is not None:
        kv_tokens = chat.kv_cache_memory_bytes // transformer.und_kv_bytes_per_token()
    reasoner = Reasoner.from_pretrained(
        path, transformer, pipeline.encoder.tokenizer, max_model_len=chat.max_model_len,
        max_num_seqs=scheduler.max_num_seqs, kv_cache_tokens=kv_tokens, enforce_eager=cfg.enforce_eager,
        chat_sm_margin=chat.chat_sm_margin, enable_prefix_caching=chat.enable_prefix_caching,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        enable_chunked_prefill=scheduler.enable_chunked_prefill,
        processor_cache_bytes=int(chat.mm_processor_cache_gb * 2**30), sampling_defaults=defaults,
        chat_template=chat.chat_template_text,
    )  # fmt: skip
    log.info("Reasoner chat completions on the shared und tower (vision encoder: %s; K/V cache %d tokens, "
             "%.2f GiB)", "yes" if reasoner.vision is not None else "none: text only",
             reasoner.pool.capacity_tokens, reasoner.pool.nbytes / 2**30)  # fmt: skip
    if on_gpu:
        t0 = time.perf_counter()
        reasoner.warm_up()  # compiles and captures the decode step and the prefill now, not in the first chats
        graphed = reasoner.decoder.use_graphs  # (not under --enforce-eager, layerwise offload or TP)
        log.info("Reasoner warm-up (decode step and prefill%s) in %.1f s",
                 " compiled and CUDA-graphed" if graphed else "", time.perf_counter() - t0)  # fmt: skip
    share = reasoner.share
    log.info("chats %s", f"decode beside video steps (video leaves {share.sm_margin} SMs free while chats run)"
             if share.concurrent else f"take turns with video steps ({share.why_not or 'not warmed up'})")  # fmt: skip
    return reasoner


def load_static_lora(pipeline: VideoPipeline | ParallelPipeline, lora: LoraConfig) -> None:
    """--lora-path's adapter checked against the model and loaded now (ValueError naming the flag): a bad
    adapter stops the start, not every request. Without --enable-lora it was merged into the weights as they
    loaded (LoraConfig.merged_lora; unless rounding would erase its deltas): its unmerged und deltas are what
    is left."""
    from worldserve.params import ParamError

    if (static := lora.static_lora) is None:
        return
    try:
        # (also at scale 0, which loads nothing; its requests are not checked again)
        pipeline.loras.load_static(static)
    except ParamError as exc:
        raise ValueError(f"--lora-path: {exc.message}") from None
    how = "merged into the weights" if pipeline.transformer.merged_lora is not None else "unmerged"
    log.info("every request that names no LoRA adapter runs with --lora-path %s at scale %g (%s)", static.path,
             static.scale, how)  # fmt: skip


def check_kv_cache_fits(cfg: ModelConfig, chat: ReasonerConfig, path: Path) -> None:
    """ValueError naming both flags when --kv-cache-memory-bytes cannot hold one --max-model-len chat of the
    checkpoint at `path` (its und tower's layers and K/V heads, the dtype the model will load in: `cfg`'s
    --device / --dtype), before the weights load: a full-size load takes minutes. The Reasoner checks the pool
    it builds again."""
    if chat.kv_cache_memory_bytes is None:
        return
    import torch

    from worldserve.models.layers.paged_kv import PagedKVPool
    from worldserve.runner.devices import default_device, default_dtype
    from worldserve.weights.checkpoint import read_transformer_config

    config = read_transformer_config(path)
    device = torch.device(cfg.device) if cfg.device else default_device()
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else default_dtype(device)
    per_token = PagedKVPool.bytes_per_token(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype
    )
    if (tokens := chat.kv_cache_memory_bytes // per_token) < chat.max_model_len:
        raise ValueError(
            f"--kv-cache-memory-bytes {chat.kv_cache_memory_bytes} holds {tokens} tokens of the Reasoner's K/V "
            f"({per_token} bytes a token), fewer than --max-model-len {chat.max_model_len}: raise "
            "--kv-cache-memory-bytes or lower --max-model-len"
        )


def chat_defaults(chat: ReasonerConfig, path: Path | None) -> ChatDefaults:
    """The sampling defaults of Reasoner requests under --generation-config / --override-generation-config, for
    the checkpoint at `path` (None: not resolved yet: a folder or the override alone is checked);
    ValueError naming the file or flag of a bad value."""
    overrides = chat.override_generation_config.as_dict() if chat.override_generation_config else None
    return ChatDefaults.load(chat.generation_config, path, overrides)


def warm_up_shapes(
    pipeline: VideoPipeline | ParallelPipeline,
    shapes: list[tuple[int, int, int]],
    lora: LoraRequest | None = None,
) -> None:
    """One denoising step + decode per shape, so that compile and kernel selection happen before serving;
    `lora`: --lora-path's adapter (the requests that name none run with it: their graphs take its pairs)."""
    import torch

    from worldserve.params import VideoParams

    for width, height, frames in shapes:
        t0 = time.perf_counter()
        params = VideoParams(prompt="warm-up", width=width, height=height, num_frames=frames,
                             num_inference_steps=1, seed=0, lora=lora)  # fmt: skip
        try:
            _, state = pipeline.generate(params, request_id=f"warmup-{width}x{height}x{frames}")
        except torch.OutOfMemoryError as e:  # the user's to fix: one line, not a traceback
            raise ValueError(
                f"the startup warm-up of {width}x{height}x{frames} ran out of memory ({e}); try "
                "--enable-layerwise-offload or --vae-tiling, or --warmup-shapes none to skip it"
            ) from None
        pipeline.release(state)
        log.info(
            "warm-up %dx%dx%d (1 step + decode) in %.1f s", width, height, frames, time.perf_counter() - t0
        )
    if shapes and pipeline.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(pipeline.device)  # jobs report their peaks, not the warm-up's


def load_backend_within(
    cfg: ModelConfig,
    parallel: ParallelConfig = ParallelConfig(),
    scheduler: SchedulerConfig | None = None,
    chat: ReasonerConfig | None = None,
    lora: LoraConfig | None = None,
) -> tuple[Any, ...] | None:
    """serve_backend.load_backend in a thread, bounded by --init-timeout: its tuple, or None (after logging why)
    on failure."""
    from worldserve.weights.checkpoint import CheckpointError

    def load() -> tuple[Any, ...]:
        return load_backend(
            cfg, parallel, scheduler or SchedulerConfig(), chat or ReasonerConfig(), lora or LoraConfig()
        )

    started = time.monotonic()
    try:
        loaded = bounded_load(load, cfg.init_timeout, thread_name="worldserve-load", release=release_loaded)
    except LoadTimeout:
        LOAD_ABANDONED.set()
        log.error(
            "Orchestrator did not become ready within %gs (vLLM-Omni's words: the model did not load within "
            "--init-timeout); raise it for cold caches",
            cfg.init_timeout,
        )
        return None
    except Exception as exc:
        err: Exception = exc
        # A bad checkpoint or an unsupported option is the user's to fix, a peer rank that died at start-up
        # has its own log above: one line; anything else: traceback.
        from worldserve.parallel.comm import PeerError
        from worldserve.params import ParamError

        expected = isinstance(err, (CheckpointError, ValueError, PeerError))
        if isinstance(err, ParamError) and err.param == "lora":  # (the static adapter, merged as it loads)
            err = ValueError(f"--lora-path: {err.message}")
        log.error("could not load the model: %s", err, exc_info=None if expected else err)
        return None
    except BaseException:  # (SIGTERM / Ctrl-C during the load)
        LOAD_ABANDONED.set()
        raise
    log.info("model ready in %.1fs", time.monotonic() - started)
    return loaded


def release_loaded(loaded: tuple[Any, ...]) -> None:
    """What an abandoned load_backend returned, let go: its backend closed (a multi-GPU pipeline's peer
    processes stopped; one process has nothing to stop)."""
    backend = loaded[0]
    if hasattr(backend, "close"):
        backend.close()
