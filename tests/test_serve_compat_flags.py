"""Pasted vLLM / vLLM-Omni `serve` command lines: the recipe lines parse, `--model` / `--stage-init-timeout`
fold into worldserve's flags, every flag of serving-api.md §9 / §11.1 (and common vLLM flags) parses, the
accepted-without-effect ones are logged, values worldserve cannot honour are refused before the model loads
(naming the flag, exit 2), `--log-file` writes the log, and the CORS and request-id flags reach the app
(preflight answered, headers sent), built as `serve` builds it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import subprocess
import sys
from collections.abc import AsyncIterator

import httpx
import pytest
from serving_helpers import make_client

from worldserve.api.app import build_app
from worldserve.cli import build_parser
from worldserve.commands import serve, serve_compat, serve_logging
from worldserve.config import EngineConfig

pytestmark = pytest.mark.anyio
GENERATOR = ["nvidia/Cosmos3-Nano", "--host", "0.0.0.0", "--port", "8000", "--init-timeout", "1800", "--omni"]
GENERATOR_EXTRAS = [
    "--stage-init-timeout", "300", "--model-class-name", "Cosmos3OmniDiffusersPipeline",
    "--deploy-config", "vllm_omni/deploy/cosmos3.yaml", "--num-gpus", "1", "--diffusion-batch-size", "1",
    "--vae-use-tiling", "--vae-use-slicing", "--flow-shift", "10", "--trust-remote-code", "--log-stats",
    "--default-sampling-params", '{"0": {"num_inference_steps": 35}}', "--gpu-memory-utilization", "0.9",
    "--enable-request-id-headers", "--allowed-origins", '["https://app.example"]', "--allow-credentials",
]  # fmt: skip
REASONER = [
    "nvidia/Cosmos3-Nano", "--hf-overrides", '{"architectures": ["Cosmos3ReasonerForConditionalGeneration"]}',
    "--tensor-parallel-size", "1", "--mm-encoder-tp-mode", "data", "--async-scheduling",
    "--allowed-local-media-path", "/", "--media-io-kwargs", '{"video": {"num_frames": -1}}', "--port", "8000",
    "--max-model-len", "16384", "--gpu-memory-utilization", "0.85", "--disable-log-stats",
]  # fmt: skip


def parse_args(*argv: str):
    """`worldserve serve ARGV` parsed as the console script parses it."""
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


def flag_of(record: logging.LogRecord) -> str:
    """The flag a compatibility log line starts with."""
    return re.match(r"--[a-z-]+", record.getMessage()).group(0)


def config(*argv: str) -> EngineConfig:
    """The EngineConfig `worldserve serve ARGV` would run with (before the environment is resolved)."""
    return serve.engine_config(parse_args(*argv))


def test_generator_recipe_line_with_vllm_omni_flags(caplog):
    """The vLLM-Omni generator recipe line plus the other vLLM-Omni flags parses; each no-op flag logs one line."""
    args = parse_args(*GENERATOR, *GENERATOR_EXTRAS)
    cfg = serve.engine_config(args)
    assert cfg.model.model == "nvidia/Cosmos3-Nano" and cfg.model.vae_tiling
    assert cfg.model.init_timeout == 1800, "a shorter per-stage timeout does not shorten --init-timeout"
    assert (cfg.server.host, cfg.server.port) == ("0.0.0.0", 8000)
    assert cfg.server.allowed_origins == ("https://app.example",) and cfg.server.allow_credentials
    assert cfg.server.enable_request_id_headers
    with caplog.at_level(logging.INFO, logger="worldserve.serve"):
        serve_compat.log_compat(args, cfg)
    for flag in ("--omni", "--model-class-name", "--deploy-config", "--num-gpus", "--diffusion-batch-size",
                 "--vae-use-slicing", "--trust-remote-code", "--log-stats",
                 "--gpu-memory-utilization"):  # fmt: skip
        lines = [r.getMessage() for r in caplog.records if flag_of(r) == flag]
        assert len(lines) == 1 and "accepted, no effect: " in lines[0], flag
    assert cfg.video.flow_shift == 10.0 and not any(flag_of(r) == "--flow-shift" for r in caplog.records)
    assert cfg.video.video_defaults == {"flow_shift": 10.0, "num_inference_steps": 35}  # both honoured
    assert "(1 here)" in next(r.getMessage() for r in caplog.records if flag_of(r) == "--num-gpus")
    assert not any(flag_of(r) in ("--hf-overrides", "--media-io-kwargs") for r in caplog.records)


def test_reasoner_recipe_line(caplog):
    """The vLLM Reasoner recipe line parses, its JSON flags parsed, and each no-op flag is logged."""
    args = parse_args(*REASONER)
    cfg = serve.engine_config(args)
    assert cfg.model.model == "nvidia/Cosmos3-Nano" and cfg.reasoner.max_model_len == 16384
    assert cfg.parallel.tensor_parallel_size == 1 and cfg.media.allowed_local_media_path == "/"
    assert args.hf_overrides == {"architectures": ["Cosmos3ReasonerForConditionalGeneration"]}
    assert (
        cfg.media.media_io_kwargs.as_dict() == {"video": {"num_frames": -1}}
        and args.mm_encoder_tp_mode == "data"
    )
    assert serve.app_settings(cfg).media_defaults.media_io == {"video": {"num_frames": -1}}  # honoured
    with caplog.at_level(logging.INFO, logger="worldserve.serve"):
        serve_compat.log_compat(args, cfg)
    given = {flag_of(r) for r in caplog.records}
    assert {
        "--hf-overrides",
        "--mm-encoder-tp-mode",
        "--async-scheduling",
        "--gpu-memory-utilization",
    } <= given
    assert cfg.server.disable_log_stats and serve.app_settings(cfg).stats_interval_s is None  # honoured


def test_model_option_is_a_deprecated_alias(caplog, tmp_path, monkeypatch):
    """`--model M` is MODEL (with a deprecation warning); two different models are refused (exit code 2)."""
    assert config("--model", "some/model").model.model == "some/model"
    assert config("some/model", "--model", "some/model").model.model == "some/model"
    with pytest.raises(ValueError, match="given twice"):
        config("some/model", "--model", "other/model")
    args = parse_args("--model", "some/model")
    with caplog.at_level(logging.WARNING, logger="worldserve.serve"):
        serve_compat.log_compat(args, serve.engine_config(args))
    assert "--model is deprecated" in caplog.text
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert serve.run(parse_args("a/model", "--model", "b/model")) == 2, "refused before anything loads"


def test_stage_init_timeout_sets_the_load_bound():
    """`--stage-init-timeout` raises the load bound, never lowers --init-timeout."""
    assert config("--stage-init-timeout", "1800").model.init_timeout == 1800
    assert config("--init-timeout", "1800", "--stage-init-timeout", "300").model.init_timeout == 1800
    assert config("--init-timeout", "900", "--stage-init-timeout", "1200").model.init_timeout == 1200
    assert config().model.init_timeout == 600


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--allowed-origins", "*"), ("--allowed-origins", '"*"'), ("--allowed-methods", "[1]"),
     ("--allowed-headers", "{bad"), ("--hf-overrides", "{bad"), ("--hf-overrides", '["x"]'),
     ("--media-io-kwargs", "num_frames=-1"), ("--default-sampling-params", "3"), ("--gpu-memory-utilization", "0"),
     ("--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization", "most"), ("--num-gpus", "0"),
     ("--diffusion-batch-size", "two"), ("--flow-shift", "fast"),
     ("--stage-init-timeout", "-1"), ("--mm-encoder-tp-mode", "pipeline"), ("--ulysses-mode", "loose"),
     ("--ring", "two"), ("--ring-degree", "0"), ("--worker-backend", "k8s"), ("--cache-config", "[1]"),
     ("--diffusion-attention-config", "{bad"), ("--hsdp-shard-size", "all"), ("--api-server-count", "0"),
     ("--limit-mm-per-prompt", "image=2"), ("--seed", "x"), ("--boundary-ratio", "inf"),
     ("--compilation-config", "{bad"), ("--compilation-config", "[3]")],
)  # fmt: skip
def test_bad_values_are_argparse_errors_naming_the_flag(flag, value, capsys):
    """Malformed JSON, out-of-range numbers and unknown choices: argparse errors (exit 2) naming the flag."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flag, value)
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_bad_json_exits_2_from_the_console_script():
    """The console script itself exits 2 on bad JSON, saying which flag."""
    done = subprocess.run([sys.executable, "-m", "worldserve.cli", "serve", "--hf-overrides", "{architectures"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "argument --hf-overrides: not valid JSON" in done.stderr


@contextlib.asynccontextmanager
async def serving(tmp_path, monkeypatch, *argv: str, **client_kw) -> AsyncIterator[httpx.AsyncClient]:
    """The app `worldserve serve ARGV` builds (its flags through engine_config and app_options) on the fake
    backend (`client_kw`: make_client's options), over httpx.ASGITransport with its lifespan entered."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in (
        "WORLDSERVE_API_KEY",
        "VLLM_API_KEY",
        "WORLDSERVE_STORAGE_DIR",
        "VLLM_OMNI_SERVER_STORAGE__PATH",
    ):
        monkeypatch.delenv(name, raising=False)
    cfg = config("--storage-dir", str(tmp_path / "store"), "--shutdown-timeout", "0.3", *argv).resolve()
    app = build_app(make_client(tmp_path / "store", **client_kw), serve.app_settings(cfg))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            yield http


PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip


async def test_cors_preflight_and_headers(tmp_path, monkeypatch):
    """CORS flags: preflight answered (no API key needed), allowed origin echoed, others refused; vLLM defaults."""
    origin = ["--allowed-origins", '["https://app.example"]', "--allow-credentials", "--api-key", "k"]
    async with serving(tmp_path, monkeypatch, *origin) as http:
        pre = await http.options("/v1/videos", headers=PREFLIGHT)  # no key: OPTIONS is never checked
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        assert pre.headers["access-control-allow-credentials"] == "true"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        ok = await http.get(
            "/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"}
        )
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        other = await http.options("/v1/videos", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    async with serving(tmp_path, monkeypatch) as http:  # vLLM's defaults: any origin, no credentials
        r = await http.get("/health", headers={"Origin": "https://anywhere.example"})
        assert r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in r.headers
        assert (await http.options("/v1/chat/completions", headers=PREFLIGHT)).status_code == 200


async def test_allowed_origins_refuse_other_pages_requests_not_only_their_reading(tmp_path, monkeypatch):
    """--allowed-origins keeps another site's page from using the server, not only from reading its answers:
    a form POST (sent cross-site with no preflight) had created a job; now a 403 naming the origin, and no
    job. An allowed origin, the server's own page (its /docs) and clients that send no Origin pass; the
    default ["*"] lets every origin through (vLLM's)."""
    small = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "1"}
    async with serving(tmp_path, monkeypatch, "--allowed-origins", '["https://app.example"]') as http:
        evil = await http.post("/v1/videos", data=small, headers={"Origin": "https://evil.example"})
        assert evil.status_code == 403, evil.text
        assert "'https://evil.example' is not allowed (--allowed-origins)" in evil.json()["error"]["message"]
        assert (await http.get("/v1/videos")).json()["data"] == [], "no job was made"
        for origin in ("https://app.example", "http://127.0.0.1:8000", None):  # allowed; own page; no browser
            headers = {"Origin": origin, "Host": "127.0.0.1:8000"} if origin else {}
            assert (await http.post("/v1/videos", data=small, headers=headers)).status_code == 200, origin
        for host in ("[::1]:8000", "localhost:8000"):
            own = {"Origin": f"http://{host}", "Host": host}
            assert (await http.post("/v1/videos", data=small, headers=own)).status_code == 200, host
        # DNS rebinding: another site's name resolving to this server sends its own Origin and Host, alike
        rebound = {"Origin": "http://evil.example:8000", "Host": "evil.example:8000"}
        assert (await http.post("/v1/videos", data=small, headers=rebound)).status_code == 403
        pre = await http.options("/v1/videos", headers=PREFLIGHT)  # the preflight stays CORS's
        assert pre.status_code == 200
    async with serving(tmp_path, monkeypatch) as http:
        r = await http.post("/v1/videos", data=small, headers={"Origin": "https://anywhere.example"})
        assert r.status_code == 200


def test_allowed_origins_refuse_another_sites_websocket(tmp_path):
    """A WebSocket handshake carries its page's Origin, which CORS never checks: with --allowed-origins,
    another site's is refused (HTTP 403) before the session starts; an allowed one is served."""
    import asyncio

    import websockets
    from serving_helpers import serve_app

    from worldserve.api.settings import AppSettings

    settings = AppSettings(allowed_origins=("https://app.example",))
    app = build_app(make_client(tmp_path / "store"), settings)

    async def handshake(url: str, origin: str) -> str:
        try:
            async with websockets.connect(url, origin=origin) as ws:
                await ws.send('{"type": "ping"}')
                return "open"
        except websockets.exceptions.InvalidStatus as e:
            return str(e.response.status_code)

    with serve_app(app, name="test-origin-ws") as url:
        ws_url = url.replace("http", "ws", 1) + "/v1/realtime/video"
        assert asyncio.run(handshake(ws_url, "https://evil.example")) == "403"
        assert asyncio.run(handshake(ws_url, "https://app.example")) == "open"


async def test_request_id_headers_flag(tmp_path, monkeypatch):
    """X-Request-Id echoed or generated with the flag, absent without it; the sync route keeps its own id."""
    small = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "1"}
    async with serving(tmp_path, monkeypatch, "--enable-request-id-headers") as http:
        assert (await http.get("/v1/models", headers={"X-Request-Id": "abc"})).headers[
            "x-request-id"
        ] == "abc"
        assert re.fullmatch(r"[0-9a-f]{32}", (await http.get("/health")).headers["x-request-id"])
        sync = await http.post("/v1/videos/sync", data=small, headers={"X-Request-Id": "mine"})
        assert re.fullmatch(r"video_sync-[0-9a-f]{32}", sync.headers["x-request-id"]), (
            "the route's own id wins"
        )
    async with serving(tmp_path, monkeypatch, "--no-enable-request-id-headers") as http:
        assert "x-request-id" not in (await http.get("/v1/models", headers={"X-Request-Id": "abc"})).headers
        sync = await http.post("/v1/videos/sync", data=small)
        assert sync.status_code == 200 and sync.headers["x-request-id"].startswith("video_sync-")


@pytest.mark.parametrize("value", ["0", "nan", "101", "1e-12"])
def test_flow_shift_out_of_range_is_refused(value):
    """--flow-shift is a real server default: [0.001, 100] like a request's flow_shift."""
    with pytest.raises(ValueError, match="--flow-shift"):
        config("--flow-shift", value)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_flow_shift_is_the_default_of_requests_without_one(anyio_backend):
    """Video and image requests that send no flow_shift get --flow-shift; their own value wins."""
    from worldserve.api.images_protocol import ImageGenerationRequest, build_params
    from worldserve.api.video_inputs import build_inputs

    fields = {"prompt": "x", "size": "64x48", "num_frames": "5"}
    defaults = config("--flow-shift", "7").video.video_defaults
    got = await build_inputs(dict(fields), served_model="m", has_sound=False, defaults=defaults)
    assert got.params.flow_shift == 7.0
    own = await build_inputs(
        {**fields, "flow_shift": "3"}, served_model="m", has_sound=False, defaults=defaults
    )
    assert own.params.flow_shift == 3.0
    plain = await build_inputs(dict(fields), served_model="m", has_sound=False)
    assert plain.params.flow_shift is None  # Cosmos3's per-resolution default applies later
    image = ImageGenerationRequest.model_validate({"prompt": "x", "size": "64x64"})
    assert build_params(image, 7.0)[0].flow_shift == 7.0 and build_params(image)[0].flow_shift == 3.0


def test_dtype_auto_is_the_default_dtype():
    """vLLM's --dtype auto (its default, often pasted) means the device's default dtype here."""
    assert (
        config("--dtype", "auto").model.dtype is None
        and config("--dtype", "float32").model.dtype == "float32"
    )


# Every flag of serving-api.md §9 / §11.1 and the common vLLM flags not already real worldserve flags, at values
# worldserve accepts (defaults, no-op values, or values it cannot be asked to honour).
ACCEPTED = [
    "--stage-configs-path", "legacy.yaml", "--stage-overrides", '{"0": {"model_config": {"guardrails": false}}}',
    "--ulysses-mode", "strict", "--ring", "1", "--vae-patch-parallel-size", "1", "--vae-parallel-mode", "tile",
    "--hsdp-shard-size", "-1", "--hsdp-replicate-size", "1", "--layerwise-num-gpu-layers", "1",
    "--dlo-resident-layers", "12", "--no-dlo-use-allgather", "--cache-backend", "none", "--cache-config", "{}",
    "--enable-cache-dit-summary", "-dac", "{}", "--quantization-config", "{}", "--diffusion-kv-cache-dtype", "auto",
    "--step-execution", "--num-weight-load-threads", "8", "--disable-multithread-weight-load",
    "--enable-diffusion-pipeline-profiler", "--worker-backend", "multi_process",
    "--api-server-count", "1", "--allowed-media-domains", "example.com", "cdn.example.com",
    "--disable-log-requests",
    "--limit-mm-per-prompt", "{}", "--kv-cache-dtype", "auto", "--max-num-partial-prefills", "1",
    "--max-long-partial-prefills", "1", "--long-prefill-token-threshold", "0", "--scheduling-policy", "fcfs",
    "--cuda-graph-sizes", "1", "2", "--max-cudagraph-capture-size", "64", "--disable-chunked-mm-input", "--max-loras", "2", "--max-lora-rank", "64",
    "-asc", "1", "--dlo-no-use-allgather",  # (vLLM's alias, vLLM-Omni's own spelling)
]  # fmt: skip
REAL_FLAGS = [  # §9 flags that are worldserve's own (config.py): honoured, never logged as compat lines
    "--served-model-name", "cosmos", "--api-key", "k", "--no-guardrails", "-tp", "1", "--usp", "1",
    "--cfg-parallel-size", "1", "--enable-layerwise-offload", "--diffusion-attention-backend", "TORCH_SDPA",
    "--quantization", "fp8", "--enforce-eager", "--allowed-local-media-path", "/data", "--no-enable-prefix-caching",
    "--max-num-batched-tokens", "4096", "--no-enable-chunked-prefill", "--generation-config", "vllm",
    "--override-generation-config", '{"temperature": 0.5}', "--seed", "0", "--enable-lora", "--max-cpu-loras", "3",
]  # fmt: skip


def test_every_reference_flag_parses_and_accepted_ones_log_why(caplog):
    """The whole §9 / §11.1 flag set on one line: it parses, passes the check, and each compat flag given logs
    exactly one 'accepted, no effect' line; the real flags take effect."""
    args = parse_args(*GENERATOR, *GENERATOR_EXTRAS, *REASONER[1:], *ACCEPTED, *REAL_FLAGS)
    cfg = serve.engine_config(args)
    assert (
        cfg.model.served_model_name == "cosmos"
        and cfg.model.quantization == "fp8"
        and cfg.model.enforce_eager
        and not cfg.reasoner.enable_prefix_caching
        and cfg.scheduler.max_num_batched_tokens == 4096
        and not cfg.scheduler.enable_chunked_prefill
        and cfg.reasoner.generation_config == "vllm"
        and cfg.chat.seed == 0
        and cfg.reasoner.override_generation_config.as_dict() == {"temperature": 0.5}
        and cfg.lora.enable_lora
        and cfg.lora.max_cpu_loras == 3
    )
    assert cfg.parallel.enable_layerwise_offload and cfg.media.allowed_local_media_path == "/data"
    assert args.ring_degree == 1 and args.diffusion_attention_config == {} and args.dlo_use_allgather is False
    assert cfg.media.allowed_media_domains == [
        "example.com",
        "cdn.example.com",
    ]  # honoured: api/media_urls.py
    assert serve.app_settings(cfg).allowed_media_domains == ("example.com", "cdn.example.com")
    with caplog.at_level(logging.INFO, logger="worldserve.serve"):
        serve_compat.log_compat(args, cfg)
    logged = [flag_of(r) for r in caplog.records]
    given = [f"--no-{c.flag[2:]}" if getattr(args, c.dest) is False else c.flag
             for c in serve_compat.COMPAT_FLAGS if getattr(args, c.dest) is not None]  # fmt: skip
    assert sorted(logged) == sorted(given) and len(given) >= 43
    assert dict(cfg.media.limit_mm_per_prompt) == {} and serve.app_settings(cfg).mm_limits == {}
    assert all("accepted, no effect: " in r.getMessage() for r in caplog.records)
    assert (
        "--ring-degree 1: accepted, no effect" in caplog.text
        and "--worker-backend multi_process:" in caplog.text
    )


def test_help_lists_the_compat_flags_in_their_group():
    """`serve --help` lists every compat flag (aliases too) under "vLLM / vLLM-Omni compatibility"."""
    (sub,) = [a for a in build_parser(["serve"])._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    text = sub.choices["serve"].format_help()
    group = text[text.index("vLLM / vLLM-Omni compatibility:") :]
    for c in serve_compat.COMPAT_FLAGS:
        for name in (c.flag, *c.aliases):
            assert re.search(rf"(^|[ ,\[]){re.escape(name)}\b", group, re.M), name
    assert "--log-file PATH" in group and "Refused: worldserve has no Ray worker backend" in group


REFUSED = [
    (["--stage-overrides", '{"0": {"model_config": {"num_gpus": 2}}}'], "--stage-overrides", "no stages"),
    (["--stage-overrides", '{"0": {"model_config": {"guardrails": true}}}'], "--stage-overrides", "guardrail"),
    (["--ring", "2"], "--ring-degree 2", "no ring attention"),
    (["--vae-patch-parallel-size", "2"], "--vae-patch-parallel-size 2", "one GPU"),
    (["--use-hsdp"], "--use-hsdp", "HSDP"),
    (["--hsdp-shard-size", "4"], "--hsdp-shard-size 4", "HSDP"),
    (["--hsdp-replicate-size", "2"], "--hsdp-replicate-size 2", "HSDP"),
    (["--layerwise-num-gpu-layers", "4"], "--layerwise-num-gpu-layers 4", "two blocks"),
    (["--enable-distributed-layerwise-offload"], "--enable-distributed-layerwise-offload", "--enable-layerwise"),
    (["--cache-backend", "cache_dit"], "--cache-backend cache_dit", "no lossy step caching"),
    (["--cache-config", '{"rel_l1_thresh": 0.2}'], "--cache-config", "no step cache"),
    (["-dac", '{"self": "SAGE_ATTN"}'], "--diffusion-attention-config", "--diffusion-attention-backend"),
    (["--quantization-config", '{"activation_scheme": "static"}'], "--quantization-config", "no options"),
    (["--force-cutlass-fp8"], "--force-cutlass-fp8", "one kernel"),
    (["--diffusion-kv-cache-dtype", "fp8"], "--diffusion-kv-cache-dtype fp8", "--fp8-attention"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3", "model's dtype"),
    (["--boundary-ratio", "0.875"], "--boundary-ratio 0.875", "Wan2.2"),
    (["--lora-modules", "a=/loras/a"], "--lora-modules", "--enable-lora"),
    (["--default-mm-loras", '{"image": "/loras/a"}'], "--default-mm-loras", "no adapter by modality"),
    (["--max-generated-image-size", "1048576"], "--max-generated-image-size", "cap"),
    (["--worker-backend", "ray"], "--worker-backend ray", "no Ray"),
    (["--ray-address", "auto"], "--ray-address auto", "no Ray"),
    (["--api-server-count", "4"], "--api-server-count 4", "one API server"),
    (["--enable-cpu-offload"], "--enable-cpu-offload", "use --enable-layerwise-offload instead"),
    (["--omni-lb-policy", "cost-aware"], "--omni-lb-policy cost-aware", "load balancer"),
    (["--trust-request-chat-template"], "--trust-request-chat-template", "chat_template is a 400"),
    (["--hf-overrides", '{"rope_scaling": {"factor": 2}}'], "--hf-overrides", "own config"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "named", "why"), REFUSED, ids=[r[1].split()[0] + "-" + str(i) for i, r in
                                                                  enumerate(REFUSED)])  # fmt: skip
def test_values_worldserve_cannot_honour_are_refused_naming_the_flag(argv, named, why):
    """A vLLM flag at a value worldserve cannot honour: one-line ValueError starting with the flag (and value)."""
    with pytest.raises(ValueError) as error:
        config(*GENERATOR, *argv)
    message = str(error.value)
    assert message.startswith(f"{named}") and why in message and "\n" not in message


def test_log_file_receives_the_log(tmp_path, monkeypatch):
    """--log-file is honoured: the startup lines (here: a refusal) are appended to the file; an unwritable path
    is an error naming the flag (exit 2)."""
    path = tmp_path / "serve.log"
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        assert serve.run(parse_args("--log-file", str(path), "--worker-backend", "ray")) == 2
    finally:
        for handler in set(root.handlers) - set(before):
            root.removeHandler(handler)
            handler.close()
    assert "--worker-backend ray: worldserve spawns its own worker processes" in path.read_text()
    with pytest.raises(ValueError, match="--log-file .*: cannot open it"):
        serve_logging.log_to_file(str(tmp_path / "missing" / "serve.log"), serve.LOG_FORMAT)
    assert serve.run(parse_args("--log-file", str(tmp_path / "missing" / "x.log"))) == 2


def test_a_log_file_that_cannot_be_written_is_said_once_in_one_line(capsys):
    """--log-file on a full disk (/dev/full): one stderr line, not logging's traceback for every line."""
    import os
    import stat

    from worldserve.commands import serve, serve_logging

    if not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)):
        pytest.skip("no /dev/full device here")
    handler = serve_logging.log_to_file("/dev/full", serve.LOG_FORMAT)
    try:
        for i in range(3):
            logging.getLogger("worldserve.test").warning("line %d", i)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    err = capsys.readouterr().err
    assert err.count("--log-file /dev/full: cannot write to it") == 1 and "Traceback" not in err, err


def test_a_log_line_that_does_not_format_is_not_taken_for_a_full_disk(tmp_path, capsys):
    """A bad format in a log call is logging's own report; the file still takes lines, and a later write
    failure would still be said."""
    from worldserve.commands import serve, serve_logging

    path = tmp_path / "serve.log"
    handler = serve_logging.log_to_file(str(path), serve.LOG_FORMAT)
    try:  # (straight to the handler: pytest's own capture handler raises on the bad line)
        for msg, args in (("bad %d", ("str",)), ("fine", ())):
            handler.handle(logging.makeLogRecord({"msg": msg, "args": args, "levelno": logging.WARNING}))
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert "cannot write to it" not in capsys.readouterr().err and "fine" in path.read_text()


def test_every_config_flag_has_its_own_help():
    """Each flag of the config classes is documented by the string right below its field (a field inserted
    between another and its docstring took that help and left the other flag without any)."""
    import dataclasses

    from worldserve.config import CONFIG_CLASSES
    from worldserve.config_flags import attribute_docs

    for cls in CONFIG_CLASSES:
        docs = attribute_docs(cls)
        flags = [
            f.name
            for f in dataclasses.fields(cls)
            if not f.metadata.get("no_flag") and not f.metadata.get("hidden")
        ]
        assert [name for name in flags if not docs.get(name, "").strip()] == [], cls.__name__


def test_diffusion_cache_backend_in_the_environment_is_checked_as_the_flag(monkeypatch):
    """vLLM-Omni's DIFFUSION_CACHE_BACKEND, --cache-backend's fallback: cache_dit there had been ignored in
    silence while the flag at that value is refused; none passes, and the flag given wins."""
    monkeypatch.setenv("DIFFUSION_CACHE_BACKEND", "cache_dit")
    with pytest.raises(
        ValueError, match="^environment variable DIFFUSION_CACHE_BACKEND=cache_dit: worldserve has"
    ):
        config(*GENERATOR)
    assert config(*GENERATOR, "--cache-backend", "none") is not None
    monkeypatch.setenv("DIFFUSION_CACHE_BACKEND", "None")
    assert config(*GENERATOR) is not None
    monkeypatch.delenv("DIFFUSION_CACHE_BACKEND")
    monkeypatch.setenv("DIFFUSION_CACHE_ADAPTER", "tea_cache")  # (its older name)
    with pytest.raises(ValueError, match="^environment variable DIFFUSION_CACHE_ADAPTER=tea_cache: "):
        config(*GENERATOR)


def test_vllms_bool_flags_take_their_no_form(caplog):
    """vLLM's bool fields are `--flag` / `--no-flag` pairs (arg_utils get_kwargs: BooleanOptionalAction), so a
    pasted `--no-enforce-eager` or `--no-enable-lora` parses, to the default, last one winning as in vLLM; a
    refused switch's --no- form is its default and is accepted; vLLM's store_true --disable-log-stats and
    vLLM-Omni's store_true flags stay without one."""
    no_forms = ["--no-enforce-eager", "--no-enable-lora", "--no-enable-log-requests", "--no-allow-credentials",
                "--no-enable-server-load-tracking", "--no-enable-prompt-tokens-details",
                "--no-return-tokens-as-token-ids", "--no-enable-force-include-usage", "--no-disable-fastapi-docs",
                "--no-disable-uvicorn-access-log", "--no-trust-remote-code", "--no-enable-auto-tool-choice",
                "--no-disable-custom-all-reduce", "--no-trust-request-chat-template", "--no-enable-sleep-mode",
                "--no-disable-log-requests"]  # fmt: skip
    args = parse_args(*GENERATOR, "--enforce-eager", "--enable-lora", *no_forms)
    assert not (args.disable_fastapi_docs or args.disable_uvicorn_access_log)
    with caplog.at_level(logging.INFO, logger="worldserve.serve"):
        cfg = serve.engine_config(args)
        serve_compat.log_compat(args, cfg)
    assert not (cfg.model.enforce_eager or cfg.lora.enable_lora or cfg.server.enable_log_requests)
    assert not (cfg.server.allow_credentials or cfg.chat.return_tokens_as_token_ids)
    assert "--no-enable-sleep-mode: accepted, no effect: off is worldserve's only mode" in caplog.text
    assert "--no-disable-log-requests: accepted, no effect: request contents are logged only" in caplog.text
    assert config(*GENERATOR, "--no-enforce-eager", "--enforce-eager").model.enforce_eager  # (the last wins)
    with pytest.raises(ValueError, match="^--enable-sleep-mode: "):
        config(*GENERATOR, "--no-enable-sleep-mode", "--enable-sleep-mode")
    for store_true in ("--no-disable-log-stats", "--no-enable-layerwise-offload", "--no-vae-use-tiling"):
        with pytest.raises(SystemExit):
            parse_args(*GENERATOR, store_true)


def test_vllms_none_reads_as_an_optional_flags_default():
    """vLLM reads "None" as None for a field that may be None (arg_utils optional_type): `--seed None`,
    `--max-log-len None`, `--revision None` (which here had named a revision "None"), `--dtype None` (choices:
    None among them); a field that may not be None still refuses it, and a bad value still names the type.
    (vLLM reads "" so too; here an empty path stays refused: test_api_cli, test_lora_flags.)"""
    cfg = config(*GENERATOR, "--seed", "None", "--max-log-len", "None", "--revision", "None", "--dtype", "None",
                 "--sync-timeout", "None", "--mm-processor-kwargs", "None")  # fmt: skip
    assert cfg.chat.seed is None and cfg.server.max_log_len is None and cfg.model.revision is None
    assert cfg.model.dtype is None and cfg.video.sync_timeout is None
    assert cfg.media.mm_processor_kwargs is None
    assert config(*GENERATOR, "--seed", "7", "--revision", "main").chat.seed == 7
    with pytest.raises(SystemExit):
        parse_args(*GENERATOR, "--max-num-seqs", "None")  # (an int field with no None)
    assert parse_args(*GENERATOR, "--max-log-len", "None", "--max-log-len", "40").max_log_len == 40


def test_an_invalid_optional_int_still_names_its_type(capsys):
    with pytest.raises(SystemExit):
        parse_args(*GENERATOR, "--max-log-len", "many")
    assert "argument --max-log-len: invalid int value: 'many'" in capsys.readouterr().err


def test_vllms_short_quantization_flag():
    """vLLM's `-q` is --quantization (arg_utils: add_argument("--quantization", "-q", ...)); it was an
    unrecognized argument here."""
    assert config(*GENERATOR, "-q", "fp8").model.quantization == "fp8"
    assert config(*GENERATOR, "-q=fp8").model.quantization == "fp8"


def test_vllms_newer_cuda_graph_sizes_name(caplog):
    """vLLM renamed --cuda-graph-sizes --cudagraph-capture-sizes (the old name deprecated): both parse, to the
    same accepted-without-effect flag."""
    args = parse_args(*GENERATOR, "--cudagraph-capture-sizes", "1", "2", "4")
    assert args.cuda_graph_sizes == [1, 2, 4]
    with caplog.at_level(logging.INFO, logger="worldserve.serve"):
        serve_compat.log_compat(args, serve.engine_config(args))
    assert "--cuda-graph-sizes [1, 2, 4]: accepted, no effect" in caplog.text
