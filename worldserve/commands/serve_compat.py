"""The vLLM / vLLM-Omni flags of `worldserve serve` (serving-api.md §9 and §11.1, and common vLLM flags), so that
pasted `vllm serve ... [--omni]` command lines run, each flag honoured, accepted or refused, never ignored.

COMPAT_FLAGS is the one table: a flag whose values all leave worldserve's behaviour as the operator asked is
accepted with one startup log line saying why it has no effect; a flag with an `ok` test is accepted only at
its default / no-op values, and `check_compat_flags` (called by `serve.engine_config`, so before the model
loads) refuses any other value with one line naming the flag and why (exit 2, like argparse's errors).
Malformed values are argparse errors. The rows' vocabulary (CompatFlag, argparse types) is compat_flag.py's.
Honoured outside the table: `--model`, `--stage-init-timeout`, `--disable-mm-preprocessor-cache` (folded into
MODEL / --init-timeout / --mm-processor-cache-gb 0 by serve.engine_config), `--log-file` (serve_logging.py)
and vLLM's HTTP-server flags (serve_http.py). Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from typing import Any

from worldserve import envs
from worldserve.commands.compat_flag import (
    EMPTY,
    FLOAT,
    JSON,
    NEVER,
    ON,
    POSITIVE_INT,
    SWITCH,
    CompatFlag,
    checked,
    level_or_json,
)
from worldserve.config import EngineConfig, FlagValueError

log = logging.getLogger("worldserve.serve")


GUARDRAIL_KEYS = {"guardrails", "offload_guardrail_models"}


def _guardrails_off_only(overrides: dict[str, Any]) -> bool:
    """--stage-overrides that only turn the guardrails off (`{"0": {"model_config": {"guardrails": false}}}`)."""
    for stage in overrides.values():
        model_config = stage.get("model_config", {}) if isinstance(stage, dict) else None
        if (
            not isinstance(model_config, dict)
            or set(stage) - {"model_config"}
            or set(model_config) - GUARDRAIL_KEYS
        ):
            return False
        if model_config.get("guardrails", False) is not False:
            return False
    return True


C = CompatFlag
DEPLOY = (
    "worldserve reads no stage YAML: one process serves every stage, set up by flags (no guardrail models)"
)
NO_DLO = "it applies only with --enable-distributed-layerwise-offload, which worldserve refuses"
WEIGHT_LOAD = "worldserve streams the tensors one at a time from memory-mapped safetensors shards"
REASONER_GRAPHS = ("the Reasoner captures its own buckets (decode: 1, 2, 4, ... up to --max-num-seqs; "
                   "prefill: 16 to 2,048 tokens)")  # fmt: skip
ADAPTERS_BY_PATH = ("video and image requests give an adapter by its path (with --enable-lora), or every "
                    "request runs one static adapter (--lora-path)")  # fmt: skip
COMPILES = "worldserve compiles its own layers on GPU (--enforce-eager turns it off)"
STRUCTURED = "structured outputs run on llguidance, vLLM's guidance backend"
STRUCTURED_ONLY = ("worldserve's structured outputs run on llguidance (vLLM's guidance backend) with no "
                   "server-wide options: give them per request (structured_outputs' disable_any_whitespace...)")  # fmt: skip
HSDP = ("worldserve has no HSDP weight sharding: --tensor-parallel-size splits the weights, "
        "--enable-layerwise-offload keeps them in host memory")  # fmt: skip
COMPAT_FLAGS: tuple[CompatFlag, ...] = (
    # vLLM-Omni basics
    C("--omni", "worldserve always serves the omni video API, beside the Reasoner's chat API", ON),
    C("--no-guardrails", "worldserve loads no guardrail models", ON),
    C("--trust-remote-code", "worldserve runs its own Cosmos3 code, never code shipped with a checkpoint", SWITCH),
    C("--model-class-name", "worldserve has one Cosmos3 pipeline, its own, for every task", {"metavar": "NAME"}),
    C("--deploy-config", DEPLOY, {"metavar": "PATH"}),  # (recipes name vLLM-Omni's own files: not opened)
    C("--stage-configs-path", DEPLOY + "; vLLM-Omni deprecates this flag", {"metavar": "PATH"}),
    C("--stage-overrides", "worldserve loads no guardrail models", JSON, _guardrails_off_only,
      "as {} or turning guardrails off", "worldserve has no stages to override: use the matching worldserve "
      "flags (--help); only guardrail overrides turning them off are accepted"),
    # parallelism and memory
    C("--num-gpus", "the GPUs used follow from --cfg-parallel-size x --ulysses-degree x --tensor-parallel-size{gpus}",
      {"type": POSITIVE_INT}),
    C("--ulysses-mode", "worldserve's Ulysses split pads uneven sequence lengths in every mode; --ulysses-degree "
      "must still divide the heads (1, 2, 4, 8)", {"choices": ("strict", "advanced_uaa")}),
    C("--ring-degree", "1 is no ring attention", {"type": POSITIVE_INT}, lambda v: v == 1, "only at 1",
      "worldserve has no ring attention: use --ulysses-degree (and --cfg-parallel-size) for more GPUs",
      aliases=("--ring",)),
    C("--vae-patch-parallel-size", "worldserve decodes the VAE on one GPU", {"type": POSITIVE_INT},
      lambda v: v == 1, "only at 1", "worldserve decodes the VAE on one GPU; --vae-tiling lowers its memory"),
    C("--vae-parallel-mode", "it applies only with --vae-patch-parallel-size > 1, which worldserve refuses",
      {"metavar": "MODE"}),
    C("--use-hsdp", "", ON, NEVER, "never", HSDP),
    C("--hsdp-shard-size", "-1 (vLLM-Omni's default) shards nothing without --use-hsdp", {"type": int},
      lambda v: v == -1, "only at -1", HSDP),
    C("--hsdp-replicate-size", "1 replicates nothing", {"type": POSITIVE_INT}, lambda v: v == 1, "only at 1", HSDP),
    C("--layerwise-num-gpu-layers", "--enable-layerwise-offload streams each block into one of two GPU slots per "
      "tower", {"type": POSITIVE_INT}, lambda v: v == 1, "only at 1", "worldserve's --enable-layerwise-offload "
      "keeps a fixed two blocks per tower on the GPU (double buffered)"),
    C("--enable-distributed-layerwise-offload", "", ON, NEVER, "never",
      "worldserve has no distributed (sharded) layerwise offload: use --enable-layerwise-offload"),
    C("--dlo-resident-layers", NO_DLO, {"type": checked(int, lambda v: v >= 0, "an integer >= 0")}),
    C("--dlo-use-allgather", NO_DLO, {"action": argparse.BooleanOptionalAction}),
    C("--dlo-no-use-allgather", NO_DLO, ON),  # (vLLM-Omni's own spelling of --no-dlo-use-allgather)
    C("--enable-cpu-offload", "", ON, NEVER, "never", "CPU offloading of the whole Cosmos3 pipeline is not "
      "supported (as in vLLM-Omni): use --enable-layerwise-offload instead"),
    C("--vae-use-slicing", "worldserve's VAE memory lever is --vae-use-tiling (--vae-tiling)", ON),
    # kernels, caching and quantisation
    C("--cache-backend", "none is no step caching", {"metavar": "NAME"}, lambda v: v.lower() == "none", "only at "
      "none", "worldserve has no lossy step caching (cache-dit, TeaCache...): every step runs the full model"),
    C("--cache-config", "there is no step cache to configure", JSON, EMPTY, "only as {}",
      "worldserve has no step cache to configure (see --cache-backend)"),
    C("--enable-cache-dit-summary", "there is no step cache, so no cache statistics", ON),
    C("--diffusion-attention-config", "an empty object is the default", JSON, EMPTY, "only as {}", "worldserve uses one attention "
      "backend for every role: pick it with --diffusion-attention-backend (--fp8-attention for e4m3)",
      aliases=("-dac",)),
    C("--quantization-config", "an empty object is the default", JSON, EMPTY, "only as {}",
      "worldserve's --quantization fp8 has no options (row-wise e4m3 scales on the gen tower's GEMMs)"),
    C("--force-cutlass-fp8", "", ON, NEVER, "never",
      "worldserve's fp8 GEMMs have one kernel (torch._scaled_mm with row-wise scales)"),
    C("--diffusion-kv-cache-dtype", "auto is the model's dtype", {"metavar": "DTYPE"}, lambda v: v == "auto",
      "only at auto", "worldserve has no separate diffusion K/V dtype: --fp8-attention runs the gen attention in e4m3"),
    C("--kv-cache-dtype", "auto is the model's dtype", {"metavar": "DTYPE"}, lambda v: v == "auto", "only at auto",
      "the Reasoner's K/V cache is in the model's dtype (--dtype); size it with --kv-cache-memory-bytes"),
    # sampling, execution and observability
    C("--diffusion-batch-size", "same-shape requests denoise together up to --max-batch-size{max_batch_size}",
      {"type": POSITIVE_INT}),
    C("--boundary-ratio", "", {"type": FLOAT}, NEVER, "never",
      "it is Wan2.2's switch between two expert transformers; Cosmos3 has one"),
    C("--step-execution", "worldserve always runs one scheduled denoising step at a time; an abort takes effect at "
      "the next step", ON),
    C("--num-weight-load-threads", WEIGHT_LOAD, {"type": POSITIVE_INT}),
    C("--disable-multithread-weight-load", WEIGHT_LOAD, ON),
    C("--max-generated-image-size", "", {"type": POSITIVE_INT}, NEVER, "never",
      "worldserve has no server-wide cap on the generated image size"),
    C("--log-stats", "the stats line is logged unless --disable-log-stats (and /metrics serves the figures)", ON),
    C("--enable-diffusion-pipeline-profiler", "per-stage wall times are always on /metrics "
      "(worldserve:stage_duration_seconds)", ON),
    C("--worker-backend", "worldserve spawns its own worker processes", {"choices": ("multi_process", "ray")},
      lambda v: v == "multi_process", "only at multi_process",
      "worldserve spawns its own worker processes (torch.distributed); it has no Ray worker backend"),
    C("--ray-address", "", {"metavar": "ADDRESS"}, NEVER, "never", "worldserve has no Ray worker backend"),
    C("--api-server-count", "one API server process is worldserve's only mode", {"type": POSITIVE_INT},
      lambda v: v == 1, "only at 1", "worldserve runs one API server process beside its engine", aliases=("-asc",)),
    C("--omni-lb-policy", "", {"metavar": "POLICY"}, NEVER, "never", "worldserve is one replica with no "
      "built-in load balancer: route between replicas (each with its own --storage-dir) with an external one"),
    # the Reasoner (vLLM)
    C("--hf-overrides", "the Reasoner chat API is served from the same checkpoint without an architecture "
      "override", JSON, lambda v: set(v) <= {"architectures"}, "only with the architectures key (the Reasoner "
      "recipe's)", "worldserve uses the checkpoint's own config: overrides other than architectures would be "
      "ignored"),
    C("--mm-encoder-tp-mode", "the Reasoner's vision encoder is never sharded (tensor parallelism turns the chat "
      "API off)", {"choices": ("weights", "data")}),
    C("--max-num-partial-prefills", "one chunked prompt prefills at a time; new chats are admitted in their "
      "own pass every step, so short prompts never wait behind a long one", {"type": POSITIVE_INT}),
    C("--max-long-partial-prefills", "one chunked prompt prefills at a time (--max-num-partial-prefills)",
      {"type": POSITIVE_INT}),
    C("--long-prefill-token-threshold", "prompts longer than --max-num-batched-tokens are the ones chunked",
      {"type": checked(int, lambda v: v >= 0, "an integer >= 0")}),
    C("--scheduling-policy", "chats are admitted first come, first served", {"choices": ("fcfs", "priority")},
      lambda v: v == "fcfs", "only as fcfs", "worldserve admits chats in arrival order (no request priorities)"),
    C("--cuda-graph-sizes", REASONER_GRAPHS, {"nargs": "+", "type": POSITIVE_INT},
      aliases=("--cudagraph-capture-sizes",)),  # (vLLM's newer name; --cuda-graph-sizes is deprecated there)
    C("--max-cudagraph-capture-size", REASONER_GRAPHS, {"type": POSITIVE_INT}),
    C("--disable-chunked-mm-input", "an image cut by a chunk's end is encoded once (the encoder cache serves "
      "its second part)", {"action": argparse.BooleanOptionalAction}),
    C("--async-scheduling", "worldserve has one scheduling mode (the video engine and the chat worker each "
      "schedule in their own thread)", {"action": argparse.BooleanOptionalAction}),
    C("--enable-auto-tool-choice", "tool_choice auto (the default with tools) is always available: the "
      "model's <tool_call> blocks are parsed as vLLM's hermes parser parses them", SWITCH),
    C("--trust-request-chat-template", "", SWITCH, NEVER, "never", "worldserve renders only the checkpoint's chat "
      "template: a request's chat_template is a 400"),
    C("--tool-call-parser", "tool calls are parsed in Qwen's hermes format (<tool_call> JSON blocks), the one "
      "this checkpoint's chat template asks for", {"metavar": "NAME"}, lambda v: v == "hermes", "only as hermes",
      "worldserve parses the hermes format, the one Qwen3-VL's chat template writes"),
    C("--gpu-memory-utilization", "the Reasoner's K/V cache is sized by --kv-cache-memory-bytes (default: 2 x "
      "--max-model-len tokens), not by a fraction of GPU memory",
      {"type": checked(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")}),
    # common vLLM flags
    C("--disable-log-requests", "request contents are logged only with --enable-log-requests (off by default), "
      "as in vLLM, which deprecates this flag", SWITCH),
    C("--chat-template-content-format", "the chat template is handed each message as it expects",
      {"choices": ("auto", "string", "openai")}, lambda v: v == "auto", "only at auto",
      "worldserve renders message content the way the checkpoint's chat template expects it"),
    C("--compilation-config", COMPILES, {"type": level_or_json, "metavar": "LEVEL|JSON"}, aliases=("-O",)),
    C("--optimization-level", COMPILES, {"metavar": "LEVEL"}),  # (newest vLLM's -O3 / -Odecode: vllm_argv)
    C("--tokenizer", "", {"metavar": "NAME"}, NEVER, "never", "worldserve uses the checkpoint's text_tokenizer/"),
    C("--tokenizer-mode", "auto is the checkpoint's tokenizer", {"metavar": "MODE"}, lambda v: v == "auto",
      "only at auto", "worldserve uses the checkpoint's own (fast) tokenizer"),
    C("--block-size", "the Reasoner's K/V pool has 64-token blocks", {"type": POSITIVE_INT}),
    C("--swap-space", "preempted chats are recomputed, not swapped",
      {"type": checked(float, lambda v: math.isfinite(v) and v >= 0, "a number of GiB >= 0")}),
    C("--max-seq-len-to-capture", "the decode step is captured for every context length", {"type": POSITIVE_INT}),
    C("--disable-custom-all-reduce", "worldserve's collectives are torch.distributed's", SWITCH),
    C("--data-parallel-size", "1 is one replica", {"type": POSITIVE_INT}, lambda v: v == 1, "only at 1",
      "worldserve is one replica: run several servers (each with its own --storage-dir) behind a load balancer",
      aliases=("-dp",)),
    C("--pipeline-parallel-size", "1 is no pipeline parallelism", {"type": POSITIVE_INT}, lambda v: v == 1,
      "only at 1", "worldserve has no pipeline parallelism: use --ulysses-degree / --tensor-parallel-size",
      aliases=("-pp",)),
    C("--load-format", "auto reads the checkpoint's safetensors", {"metavar": "FORMAT"},
      lambda v: v in ("auto", "safetensors"), "only at auto or safetensors",
      "worldserve loads the checkpoint's safetensors only"),
    C("--download-dir", "", {"metavar": "PATH"}, NEVER, "never", "worldserve downloads into the Hugging Face "
      "cache: set HF_HOME (or HF_HUB_CACHE) instead"),
    C("--lora-modules", "", {"metavar": "SPEC", "nargs": "+"}, NEVER, "never",
      f"worldserve registers no adapter names: {ADAPTERS_BY_PATH}"),
    C("--default-mm-loras", "", JSON, NEVER, "never",
      f"worldserve applies no adapter by modality: {ADAPTERS_BY_PATH}"),
    C("--max-loras", "vLLM's bound on the adapters of one batch; here one forward runs one adapter: requests "
      "batch by adapter, as by video shape (--max-cpu-loras bounds the adapters kept read)", {"type": POSITIVE_INT}),
    C("--enable-sleep-mode", "", SWITCH, NEVER, "never", "worldserve has no sleep mode (no /sleep, /wake_up routes)"),
    C("--max-logprobs", "requests may ask for up to 20 logprobs a token, vLLM's default", {"type": int},
      lambda v: v == 20, "only at 20", "worldserve caps logprobs, top_logprobs and prompt_logprobs at 20"),
    C("--distributed-executor-backend", "worldserve spawns its own worker processes for a parallel layout (one "
      "process on one GPU)", {"metavar": "BACKEND"}, lambda v: v in ("mp", "uni"), "only as mp or uni",
      "worldserve spawns its own worker processes (torch.distributed): no Ray, no per-rank launcher"),
    C("--hf-token", "downloads use the token of `hf auth login` (or $HF_TOKEN), huggingface_hub's default",
      {"nargs": "?", "const": True, "metavar": "TOKEN"}, lambda v: v is True, "only as the bare flag (the "
      "stored login)", "give the token as the environment variable HF_TOKEN (huggingface_hub reads it)",
      shown=False),
    C("--code-revision", "worldserve runs its own Cosmos3 code, never code from the checkpoint's repository",
      {"metavar": "REV"}),
    C("--tokenizer-revision", "the tokenizer is the checkpoint's text_tokenizer/, read at --revision",
      {"metavar": "REV"}, lambda v: True, "only at --revision's value",
      "the tokenizer is the checkpoint's text_tokenizer/, read at MODEL's --revision: give that one"),
    C("--max-parallel-loading-workers", WEIGHT_LOAD, {"type": POSITIVE_INT}),
    C("--cpu-offload-gb", "0 offloads nothing", {"type": checked(float, lambda v: math.isfinite(v) and v >= 0,
      "a number of GiB >= 0")}, lambda v: v == 0, "only at 0", "worldserve offloads whole blocks, not a number "
      "of GiB: use --enable-layerwise-offload"),
    C("--speculative-config", "", JSON, EMPTY, "only as {}", "worldserve has no speculative decoding"),
    C("--structured-outputs-config", STRUCTURED, JSON, lambda v: set(v) <= {"backend"} and v.get("backend",
      "auto") in ("auto", "guidance"), "only as {} or with backend auto / guidance", STRUCTURED_ONLY),
    C("--guided-decoding-backend", STRUCTURED, {"metavar": "NAME"}, lambda v: v in ("auto", "guidance"),
      "only as auto or guidance", STRUCTURED_ONLY),
    C("--model-impl", "worldserve runs its own Cosmos3 implementation", {"metavar": "IMPL"},
      lambda v: v in ("auto", "vllm"), "only as auto or vllm", "worldserve runs its own Cosmos3 implementation, "
      "not transformers' or another"),
    C("--skip-tokenizer-init", "", SWITCH, NEVER, "never", "worldserve renders prompts and decodes tokens with "
      "the checkpoint's tokenizer itself"),
    C("--otlp-traces-endpoint", "", {"metavar": "URL"}, NEVER, "never", "worldserve exports no OpenTelemetry "
      "traces: /metrics serves Prometheus metrics"),
    # vLLM's OpenAI-server flags (the HTTP-server ones worldserve honours are serve_http.py's)
    C("--enable-ssl-refresh", "", SWITCH, NEVER, "never", "worldserve loads the certificate files once, at "
      "startup: restart it to serve renewed ones"),
    C("--log-error-stack", "an unhandled error's 500 is logged with its stack trace always; a request's error "
      "(4xx) is answered with its reason", SWITCH),
    C("--enable-log-outputs", "", SWITCH, NEVER, "never", "worldserve logs requests (--enable-log-requests), "
      "not what they generate"),
    C("--enable-log-deltas", "it applies only with --enable-log-outputs, which worldserve refuses", SWITCH),
    C("--enable-tokenizer-info-endpoint", "", SWITCH, NEVER, "never", "worldserve serves no /tokenizer_info "
      "(/tokenize and /detokenize are served)"),
    C("--enable-offline-docs", "", SWITCH, NEVER, "never", "worldserve's /docs loads Swagger UI's files from "
      "their CDN (it bundles none); /openapi.json is served either way"),
    C("--tokens-only", "", SWITCH, NEVER, "never", "worldserve has no tokens-only mode: it serves its whole API"),
    C("--headless", "", ON, NEVER, "never", "worldserve has no headless (engine-only) mode: each server runs its "
      "own engine and API"),
    C("--enable-per-request-metrics", "", SWITCH, NEVER, "never", "worldserve's answers carry no per-request "
      "timings: /metrics serves them as histograms"),
    C("--exclude-tools-when-tool-choice-none", "", SWITCH, NEVER, "never", "worldserve renders a request's tools "
      "into the prompt whatever its tool_choice (vLLM's default): send no tools to leave them out"),
    C("--tool-parser-plugin", "none is the default", {"metavar": "PATH"}, lambda v: v == "", "only as ''",
      "worldserve loads no tool parser plugins: it parses the hermes format (--tool-call-parser hermes)"),
    C("--tool-server", "", {"metavar": "ADDRESSES"}, NEVER, "never", "worldserve runs no built-in or MCP tool "
      "servers: tool calls go back to the client"),
    C("--disable-frontend-multiprocessing", "worldserve's API server and engine share one process already (the "
      "engine in its own thread, GPU ranks in worker processes)", ON),
)  # fmt: skip
"""vLLM / vLLM-Omni flags of pasted command lines, in serving-api.md §9 / §11.1 order. (--flow-shift, --dtype,
--vae-use-tiling, -tp, --usp, the CORS flags, --enable-lora, --lora-path / --lora-scale, --max-cpu-loras,
--max-lora-rank... are real worldserve flags, in config.py and config_lora.py.)"""


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """The "vLLM / vLLM-Omni compatibility" group of `serve --help`: the honoured aliases, then COMPAT_FLAGS."""
    group = parser.add_argument_group(
        "vLLM / vLLM-Omni compatibility",
        "Flags of pasted vLLM / vLLM-Omni command lines. Those accepted with no effect log one line saying why; "
        "values worldserve cannot honour stop the start with an error naming the flag.",
    )
    group.add_argument("--model", dest="model_option", metavar="MODEL",
                       help="Deprecated (as in vLLM): the model; pass it as the positional MODEL.")  # fmt: skip
    group.add_argument("--stage-init-timeout", metavar="SECONDS",
                       type=checked(float, lambda v: math.isfinite(v) and v > 0, "a number of seconds > 0"),
                       help="vLLM-Omni's per-stage init timeout; worldserve loads one stage, so the model load "
                       "is bounded by the larger of it and --init-timeout.")  # fmt: skip
    group.add_argument("--log-file", metavar="PATH",
                       help="Also append worldserve's and uvicorn's log lines to PATH.")  # fmt: skip
    group.add_argument("--disable-mm-preprocessor-cache", action=argparse.BooleanOptionalAction,
                       help="vLLM's deprecated spelling of --mm-processor-cache-gb 0 (no cache of processed "
                       "chat media; it wins over that flag, as in vLLM).")  # fmt: skip
    for c in COMPAT_FLAGS:
        kwargs = c.kwargs if "metavar" in c.kwargs or "type" not in c.kwargs else {**c.kwargs, "metavar": "N"}
        why = c.why.format(gpus="", max_batch_size="")
        if c.ok is None:
            text = f"Accepted, no effect: {why}."
        elif c.ok is NEVER and c.kwargs is SWITCH:
            text = f"Refused (--no-{c.flag[2:]}, the default, is accepted: no effect): {c.refusal}."
        elif c.ok is NEVER:
            text = f"Refused: {c.refusal}."
        else:
            text = f"Accepted {c.accepts} (no effect); refused otherwise: {c.refusal}."
        group.add_argument(
            c.flag, *c.aliases, dest=c.dest, default=None, help=text.replace("%", "%%"), **kwargs
        )


def _shown(value: Any) -> str:
    """The value as the log / error line shows it after the flag ("" for a plain switch)."""
    if value is True:
        return ""
    return " " + (json.dumps(value) if isinstance(value, (dict, list)) else str(value))


def check_compat_flags(args: argparse.Namespace) -> None:
    """FlagValueError (a ValueError) naming the first flag given at a value worldserve cannot honour, and why
    (--tokenizer-revision: another revision than --revision's)."""
    for c in COMPAT_FLAGS:
        value = getattr(args, c.dest, None)
        # (a SWITCH's --no- form, False, is its default: it asks for nothing worldserve lacks)
        refused = value is not None and value is not False and c.ok is not None and not c.ok(value)
        other_revision = c.dest == "tokenizer_revision" and value not in (
            None,
            getattr(args, "revision", None),
        )
        if refused or other_revision:
            raise FlagValueError(f"{c.flag}{_shown(value) if c.shown else ''}: {c.refusal}")
    backend = envs.cache_backend()  # --cache-backend's environment fallback: refused as the flag would be
    if getattr(args, "cache_backend", None) is None and backend is not None and backend[1].lower() != "none":
        raise FlagValueError(f"environment variable {backend[0]}={backend[1]}: worldserve has no lossy "
                             "step caching (cache-dit, TeaCache...): every step runs the full model; unset it")  # fmt: skip


def log_compat(args: argparse.Namespace, config: EngineConfig) -> None:
    """The deprecation of `--model`, and one line per accepted-without-effect flag given, saying why."""
    if getattr(args, "model_option", None) is not None:
        log.warning("--model is deprecated (as in vLLM): pass the model as the positional MODEL")
    if config.model.served_model_aliases:
        log.info("--served-model-name: requests may name %s; answers and metrics carry %r (vLLM's first name)",
                 " or ".join(repr(n) for n in (config.model.served_model_name, *config.model.served_model_aliases)),
                 config.model.served_model_name)  # fmt: skip
    if getattr(getattr(args, "max_model_len", None), "auto", False):
        log.info("--max-model-len auto: %d tokens, worldserve's default", config.reasoner.max_model_len)
    par = config.parallel
    context = {"gpus": f" ({par.cfg_parallel_size * par.ulysses_degree * par.tensor_parallel_size} here)",
               "max_batch_size": f" ({config.scheduler.max_batch_size} here)"}  # fmt: skip
    for c in COMPAT_FLAGS:
        value = getattr(args, c.dest, None)
        if value is not None:
            why = c.why.format(**context) or "off is worldserve's only mode"  # (a refused SWITCH's --no-)
            given = f"--no-{c.flag[2:]}" if value is False else c.flag + _shown(value)
            log.log(c.level, "%s: accepted, no effect: %s", given, why)
