"""`worldserve serve` flags generated from the config dataclasses, env fallbacks, refusals, import layering,
and the job TTL sweep."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from serving_helpers import asgi_server, poll_job

from worldserve.cli import build_parser
from worldserve.config import TINY_SERVED_NAME, EngineConfig, ParallelConfig
from worldserve.config_server import ServerConfig

API_DIR = Path(__file__).resolve().parents[1] / "worldserve" / "api"


def parse(*argv: str) -> EngineConfig:
    args = build_parser(["serve", *argv]).parse_args(["serve", *argv])
    return EngineConfig.from_args(args)


def test_recipe_command_line_parses():
    cfg = parse(
        "nvidia/Cosmos3-Nano", "--host", "0.0.0.0", "--port", "8000", "--init-timeout", "1800", "--omni"
    )
    assert cfg.model.model == "nvidia/Cosmos3-Nano" and cfg.model.init_timeout == 1800
    assert (cfg.server.host, cfg.server.port) == ("0.0.0.0", 8000)


def test_every_flag_maps_to_a_field():
    cfg = parse("--served-model-name", "cosmos", "--api-key", "k", "--storage-dir", "/s", "--max-queued-requests", "3",
                "--max-batch-size", "4", "--sync-timeout", "12.5", "--max-upload-mb", "2", "--job-ttl", "60",
                "--device", "cuda:1", "--dtype", "bfloat16", "-tp", "1", "--ulysses-degree", "1",
                "--cfg-parallel-size", "1", "--encode-workers", "3", "--shutdown-timeout", "5")  # fmt: skip
    assert (
        cfg.model.served_model_name == "cosmos"
        and cfg.model.device == "cuda:1"
        and cfg.model.dtype == "bfloat16"
    )
    assert cfg.scheduler.max_queued_requests == 3 and cfg.scheduler.max_batch_size == 4
    assert cfg.scheduler.encode_workers == 3 and cfg.scheduler.shutdown_timeout == 5
    s, v = cfg.server, cfg.video
    assert (s.api_key, v.storage_dir, v.sync_timeout, s.max_upload_bytes, v.job_ttl) == (
        ("k",),
        "/s",
        12.5,
        2 * 2**20,
        60,
    )
    assert cfg.parallel == ParallelConfig()


def test_engine_config_parts_are_small_and_each_a_help_group():
    """design.md: one frozen dataclass per concern, about 15 fields at most; EngineConfig holds every class
    CONFIG_CLASSES lists (their flags, their --help groups and serve's `non-default args`), and no flag is in
    two of them."""
    from worldserve.config import CONFIG_CLASSES

    parts = [f.type for f in dataclasses.fields(EngineConfig)]
    assert parts == [cls.__name__ for cls in CONFIG_CLASSES]
    for cls in CONFIG_CLASSES:
        assert cls.__dataclass_params__.frozen and len(dataclasses.fields(cls)) <= 18, cls.__name__
    names = [f.name for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))


def test_warmup_shapes():
    assert parse().model.warmup_shape_list(on_gpu=True) == [(1280, 720, 189)]
    assert parse().model.warmup_shape_list(on_gpu=False) == []
    cfg = parse("--warmup-shapes", "832x480x121, 1280x720x189").model
    assert cfg.warmup_shape_list(on_gpu=False) == [(832, 480, 121), (1280, 720, 189)]
    assert parse("--warmup-shapes", "none").model.warmup_shape_list(on_gpu=True) == []
    for bad, why in (
        ("1280x720", "WIDTHxHEIGHTxFRAMES"),
        ("1281x720x189", "multiple"),
        ("1280x720x10", "4k\\+1|num_frames"),
    ):
        with pytest.raises(ValueError, match=why):
            parse("--warmup-shapes", bad)


def test_vllm_omni_memory_flags():
    cfg = parse("--vae-use-tiling", "--enable-layerwise-offload", "--no-guardrails", "--omni")
    assert cfg.model.vae_tiling and cfg.parallel.enable_layerwise_offload


@pytest.mark.parametrize(
    "argv",
    [["-tp", "0"], ["-tp", "2", "--ulysses-degree", "2"], ["--ulysses-degree", "0"], ["--cfg-parallel-size", "3"],
     ["--port", "70000"], ["--sync-timeout", "0"], ["--max-batch-size", "0"],
     # durations past what a wait can take failed mid-run (a join at SIGTERM, a timestamp, int(inf))
     ["--job-ttl", "inf"], ["--init-timeout", "1e400"], ["--shutdown-timeout", "1e20"], ["--shutdown-timeout", "nan"],
     ["--sync-timeout", "inf"], ["--max-upload-mb", "inf"], ["--max-upload-mb", "1e-9"],
     ["--device", "banana"], ["--revision", "v1"],
     # an empty key served /v1 open (`--api-key "$KEY"` with KEY unset), an empty name the default one
     ["--api-key", ""], ["--api-key", "k", ""], ["--served-model-name", ""],
     # a blank key (or one ending in blanks, which HTTP strips from the header) could never match a token
     ["--api-key", " "], ["--api-key", "k", "\t"], ["--api-key", "k "],
     # an empty folder fell back to the default one, no domain meant every host
     ["--storage-dir", ""], ["--allowed-media-domains", ""], ["--allowed-media-domains", ","]],
)  # fmt: skip
def test_unsupported_or_bad_values_are_refused(argv):
    with pytest.raises(
        ValueError,
        match="not supported|must be|runs alone|needs a MODEL|protects nothing|can never match|must not|empty path"
        "|no domain",
    ):
        parse(*argv)


def test_allowed_media_domains_that_took_the_model_folder_are_refused(tmp_path):
    """`serve --allowed-media-domains example.com ./ckpt`: the folder became a second domain and the tiny
    random model was served."""
    from worldserve.commands.serve import engine_config

    argv = ["serve", "--allowed-media-domains", "example.com", str(tmp_path)]
    with pytest.raises(ValueError, match="--allowed-media-domains took .*a folder.*put MODEL first"):
        engine_config(build_parser(argv).parse_args(argv))
    argv = ["serve", str(tmp_path), "--allowed-media-domains", "example.com"]
    assert engine_config(build_parser(argv).parse_args(argv)).model.model == str(tmp_path)
    argv = ["serve", "--allowed-media-domains", "example.com", "nvidia/Cosmos3-Nano"]  # a Hub id: no domain
    with pytest.raises(ValueError, match="--allowed-media-domains took .*a Hugging Face repo id"):
        engine_config(build_parser(argv).parse_args(argv))


@pytest.mark.parametrize("flag", ["--api-key", "--served-model-name"])
def test_a_many_valued_flag_that_took_the_model_folder_is_refused(tmp_path, flag):
    """`serve --api-key K ./ckpt`: argparse gave the folder to the flag and no MODEL was left; the tiny default
    was served and the folder's path was a second key. Now a ValueError naming the flag."""
    from worldserve.commands.serve import engine_config

    argv = ["serve", flag, "k1", str(tmp_path)]
    with pytest.raises(ValueError, match=f"{flag} took .*a folder.*put MODEL first"):
        engine_config(build_parser(argv).parse_args(argv))
    argv = ["serve", str(tmp_path), flag, "k1"]  # MODEL first: fine
    assert engine_config(build_parser(argv).parse_args(argv)).model.model == str(tmp_path)
    argv = ["serve", flag, ""]  # "" is not a folder (Path("") is "."): the empty value's own error says why
    with pytest.raises(ValueError, match="protects nothing|must not be empty"):
        engine_config(build_parser(argv).parse_args(argv))
    # a Hub repo id after the names' first: the tiny random model had been served under it; an API key may
    # be shaped so (base64), and a --config list has no order: both stay values
    argv = ["serve", flag, "k1", "nvidia/Cosmos3-Nano"]
    if flag == "--served-model-name":
        with pytest.raises(ValueError, match=f"{flag} took 'nvidia/Cosmos3-Nano', a Hugging Face repo id"):
            engine_config(build_parser(argv).parse_args(argv))
    else:
        assert engine_config(build_parser(argv).parse_args(argv)).server.api_key == (
            "k1",
            "nvidia/Cosmos3-Nano",
        )
    config_file = tmp_path / "c.yaml"
    config_file.write_text(f"{flag[2:]}: [k1, team/k2]\n")
    argv = ["serve", "--config", str(config_file)]
    assert engine_config(build_parser(argv).parse_args(argv)).model.model is None
    argv = ["serve", "nvidia/Cosmos3-Nano", flag, "k1", "org/name"]  # MODEL given: a second value is a value
    assert engine_config(build_parser(argv).parse_args(argv)).model.model == "nvidia/Cosmos3-Nano"


def test_a_lone_served_model_name_shaped_as_a_repo_id_names_the_tiny_default():
    from worldserve.commands.serve import engine_config

    argv = ["serve", "--served-model-name", "nvidia/Cosmos3-Nano"]
    config = engine_config(build_parser(argv).parse_args(argv))
    assert config.model.model is None and config.model.served_model_name == "nvidia/Cosmos3-Nano"
    # /v1/models' root names the model served (vLLM's model path), not the name it is served under
    from worldserve.commands.serve import app_settings
    from worldserve.config import TINY_SERVED_NAME

    assert app_settings(config).model_root == TINY_SERVED_NAME


@pytest.mark.parametrize(
    ("name", "value"),
    [("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", "inf"), ("VLLM_IMAGE_FETCH_TIMEOUT", "abc"), ("VLLM_VIDEO_FETCH_TIMEOUT", "0"),
     ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "-1"), ("VLLM_OMNI_SERVER_STORAGE__FILE_TTL", "-5"),
     ("VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL", "often"), ("WORLDSERVE_HTTP_HEADER_TIMEOUT", "-1")],
)  # fmt: skip
def test_malformed_timeouts_in_the_environment_stop_the_start_naming_the_variable(monkeypatch, name, value):
    """Read when the config resolves (before the model loads), not when the app is built after it."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        parse().resolve()


def test_resolve_env_fallbacks(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", "1800")
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("WORLDSERVE_STORAGE_DIR", raising=False)
    monkeypatch.delenv("VLLM_OMNI_SERVER_STORAGE__PATH", raising=False)
    monkeypatch.delenv("WORLDSERVE_API_KEY", raising=False)
    cfg = parse().resolve()
    assert cfg.video.sync_timeout == 1800 and cfg.server.api_key == ("from-env",)
    assert cfg.video.storage_dir == str(tmp_path / "worldserve" / "storage")
    assert cfg.model.served_model_name == TINY_SERVED_NAME
    assert parse("m", "--sync-timeout", "5").resolve().video.sync_timeout == 5, "the flag wins"
    assert parse("--api-key", "k1", "k2").resolve().server.api_key == ("k1", "k2"), "vLLM takes several keys"
    assert parse("some/model").resolve().model.served_model_name == "some/model"
    monkeypatch.setenv("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_OMNI_VIDEO_SYNC_TIMEOUT"):
        parse().resolve()


@pytest.mark.parametrize("name", ["WORLDSERVE_API_KEY", "VLLM_API_KEY"])
def test_a_blank_api_key_in_the_environment_is_refused_naming_it(monkeypatch, name):
    """`VLLM_API_KEY=" "` (or a key with a trailing newline) served /v1 refusing every request: HTTP strips the
    blanks ending the Authorization header. An empty one stays unset (/v1 open), as before."""
    for other in ("WORLDSERVE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(other, raising=False)
    for value in (" ", "sk-key\n"):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"environment variable {name} is .*can match"):
            parse().resolve()
    monkeypatch.setenv(name, "")
    assert parse().resolve().server.api_key is None
    monkeypatch.setenv(name, " sk-key")  # (a leading blank stays in the header's value: it can match)
    assert parse().resolve().server.api_key == (" sk-key",)


def test_vllm_omni_storage_variables(monkeypatch, tmp_path):
    """vLLM-Omni's storage variables: the deprecated path alias, the file TTL (--job-ttl's default: the flag
    wins) and the sweep interval."""
    for name in ("WORLDSERVE_STORAGE_DIR", "VLLM_OMNI_SERVER_STORAGE__PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_OMNI_STORAGE_PATH", str(tmp_path / "old"))
    monkeypatch.setenv("VLLM_OMNI_SERVER_STORAGE__FILE_TTL", "3600")
    monkeypatch.setenv("VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL", "30")
    video = parse().resolve().video
    assert (video.storage_dir, video.job_ttl, video.job_sweep_interval) == (
        str(tmp_path / "old"),
        3600,
        30,
    )
    monkeypatch.setenv("VLLM_OMNI_SERVER_STORAGE__PATH", str(tmp_path / "new"))
    assert parse("--job-ttl", "60").resolve().video.job_ttl == 60, "the flag wins"
    assert parse().resolve().video.storage_dir == str(tmp_path / "new"), "the current name wins"
    monkeypatch.setenv("VLLM_OMNI_SERVER_STORAGE__FILE_TTL", "0")
    assert parse().resolve().video.job_ttl is None, "0: no TTL"
    for name in ("VLLM_OMNI_SERVER_STORAGE__FILE_TTL", "VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL"):
        monkeypatch.delenv(name)
    assert (parse().resolve().video.job_ttl, parse().resolve().video.job_sweep_interval) == (None, None)


def test_hidden_test_flags_stay_out_of_help(capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve", "--help"]).parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert (
        "--max-batch-size" in out
        and "--omni" in out
        and "--backend" not in out
        and "--fake-step-delay" not in out
    )
    assert ServerConfig().max_upload_mb == 100


def test_api_layer_imports_only_the_engine_client_and_never_torch():
    for path in API_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("torch"), f"{path.name} imports {name}"
                if name.startswith("worldserve.engine"):
                    assert name == "worldserve.engine.client", f"{path.name} imports {name}"
    code = "import sys, worldserve.api.app, worldserve.commands.serve; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_job_ttl_removes_finished_jobs_and_files(tmp_path, anyio_backend):
    import asyncio

    # (a TTL long enough for the poll to see the finished job on a loaded host: at 0.3 s it was swept first)
    async with asgi_server(tmp_path, job_ttl_s=2.0) as http:
        job = (await http.post("/v1/videos", data={"prompt": "x", "size": "64x48", "num_frames": "5",
                                                   "num_inference_steps": "1"})).json()  # fmt: skip
        done = await poll_job(http, job["id"])
        assert done["expires_at"] is not None and done["expires_at"] >= done["completed_at"]
        assert (tmp_path / "videos" / f"{job['id']}.mp4").exists()
        for _ in range(300):
            if not (tmp_path / "videos" / f"{job['id']}.mp4").exists():
                break
            await asyncio.sleep(0.02)
        assert (await http.get(f"/v1/videos/{job['id']}")).status_code == 404
        assert not (tmp_path / "videos" / f"{job['id']}.mp4").exists()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_sweep_interval_delays_the_expiry_sweep(tmp_path, anyio_backend):
    """With VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL's 30 s, the files of a job past its 0.2 s TTL stay
    until the next sweep (without it the sweep runs every 0.1 s: the test above); the job itself is gone at
    its expires_at (it was retrieved and downloaded until the sweep)."""
    import asyncio

    async with asgi_server(tmp_path, job_ttl_s=0.2, sweep_interval_s=30) as http:
        job = (await http.post("/v1/videos", data={"prompt": "x", "size": "64x48", "num_frames": "5",
                                                   "num_inference_steps": "1"})).json()  # fmt: skip
        await poll_job(http, job["id"])
        await asyncio.sleep(0.6)
        assert (await http.get(f"/v1/videos/{job['id']}")).status_code == 404
        assert (await http.get(f"/v1/videos/{job['id']}/content")).status_code == 404
        assert (await http.get("/v1/videos")).json()["data"] == []
        assert (tmp_path / "videos" / f"{job['id']}.mp4").exists()


def test_init_timeout_bounds_model_loading(monkeypatch, caplog):
    import time as _time

    from worldserve.commands import serve_backend
    from worldserve.config import ModelConfig

    # (a load's tuple, as load_backend returns: the abandoned one's goes to release_loaded when it ends)
    monkeypatch.setattr(
        serve_backend, "load_backend", lambda cfg, parallel, sched, chat, lora: (_time.sleep(5), None)
    )
    assert serve_backend.load_backend_within(ModelConfig(init_timeout=0.05)) is None
    assert "Orchestrator did not become ready within 0.05s" in caplog.text  # (vLLM-Omni's words)
    monkeypatch.setattr(
        serve_backend, "load_backend", lambda cfg, parallel, sched, chat, lora: ("backend", None)
    )
    assert serve_backend.load_backend_within(ModelConfig()) == ("backend", None)


def test_a_static_adapter_refused_as_it_loads_names_the_flag(monkeypatch, caplog):
    """--lora-path's adapter merged at load with NaN weights: the load's one line names the flag (it named only
    the request field `lora`, which a server's operator never sent)."""
    from worldserve.commands import serve_backend
    from worldserve.config import ModelConfig
    from worldserve.params import ParamError

    def load(cfg, parallel, sched, chat, lora):
        raise ParamError("lora", "LoRA adapter '/a': module 'x': its weights ... are not all finite")

    monkeypatch.setattr(serve_backend, "load_backend", load)
    assert serve_backend.load_backend_within(ModelConfig()) is None
    assert "could not load the model: --lora-path: LoRA adapter '/a'" in caplog.text


def test_kv_cache_memory_bytes_sizes_the_chat_pool(tiny_ckpt, monkeypatch):
    """--kv-cache-memory-bytes: refused when 0, too small for --max-model-len names both flags before any
    weight loads, and otherwise the Reasoner's pool holds that many bytes' worth of tokens;
    --mm-processor-cache-gb sizes its processor cache (negative or not a number: refused)."""
    from worldserve.commands import serve_backend
    from worldserve.config import ModelConfig, ParallelConfig, ReasonerConfig, SchedulerConfig
    from worldserve.runner import video_pipeline

    with pytest.raises(ValueError, match="kv-cache-memory-bytes must be > 0"):
        parse("--kv-cache-memory-bytes", "0")
    model, sched = ModelConfig(model=str(tiny_ckpt), device="cpu", warmup_shapes="none"), SchedulerConfig()
    small = ReasonerConfig(max_model_len=4096, kv_cache_memory_bytes=1000)
    ok = ReasonerConfig(max_model_len=4096, kv_cache_memory_bytes=50_000_000)
    pipeline, _, reasoner = serve_backend.load_backend(model, ParallelConfig(), sched, ok)
    per_token = pipeline.transformer.und_kv_bytes_per_token()
    short = dataclasses.replace(small, kv_cache_memory_bytes=4096 * per_token - 1)  # one token short
    with monkeypatch.context() as m:  # (refused before the weights load)
        m.setattr(video_pipeline, "load_pipeline", lambda *a, **k: pytest.fail("weights loaded"))
        for chat, tokens in ((small, 1), (short, 4095)):
            with pytest.raises(ValueError, match=rf"holds {tokens} tokens .* fewer than --max-model-len 4096: "
                               r"raise --kv-cache-memory-bytes or lower --max-model-len"):  # fmt: skip
                serve_backend.load_backend(model, ParallelConfig(), sched, chat)
    assert reasoner.prefiller.caching  # vLLM's default: prefix caching on
    assert reasoner.media_cache.max_bytes == 4 * 2**30  # vLLM's default --mm-processor-cache-gb
    off = dataclasses.replace(  # --no-enable-prefix-caching and --mm-processor-cache-gb reach the Reasoner
        ok, enable_prefix_caching=False, mm_processor_cache_gb=0.5
    )
    off_reasoner = serve_backend.load_backend(model, ParallelConfig(), sched, off)[2]
    assert not off_reasoner.prefiller.caching and off_reasoner.media_cache.max_bytes == 2**29
    for bad in ("-1", "nan"):
        with pytest.raises(ValueError, match="--mm-processor-cache-gb must be a number >= 0"):
            parse("--mm-processor-cache-gb", bad)
    assert reasoner.pool.capacity_tokens >= 50_000_000 // per_token > 4096
    assert (
        reasoner.pool.nbytes <= 50_000_000 + 2 * reasoner.pool.block_size * per_token
    )  # + scratch, rounding


def test_http_keep_alive_timeout_from_vllm_s_variable(monkeypatch):
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE, vLLM's (default 5 s), becomes uvicorn's timeout_keep_alive."""
    from worldserve import envs

    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert envs.http_timeout_keep_alive_s() == 5.0
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "75")
    assert envs.http_timeout_keep_alive_s() == 75.0


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--max-num-seqs", "abc"],
        ["serve", "--reasoning-parser", "deepseek_r1"],
        ["info", "--bogus"],
        [],
    ],
)
def test_a_bad_flag_is_one_line_naming_it(capsys, argv):
    """argparse printed the usage of every flag first (107 lines for serve) before the error line."""
    from worldserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err, err
    assert "--help" in err
    if argv:  # the verb's parser names it (an unknown flag had been `worldserve: error: ...`)
        assert err.startswith(f"worldserve {argv[0]}: error:") and f"worldserve {argv[0]} --help" in err, err


def test_a_sigterm_dropped_in_a_finalizer_still_stops_serve(monkeypatch, tmp_path, capsys, caplog):
    """A SIGTERM that lands while Python runs a finalizer has its Terminated printed and dropped ("Exception
    ignored in ..."): just after the model load it had been lost and the server went on serving (found by a
    CLI audit: a kill 0.2-0.4 s after "model ready"). It is delivered again, and the dropped exception is not
    printed."""
    import os
    import signal
    import threading

    from worldserve.cli import main
    from worldserve.commands import serve_http

    listen = serve_http.start_listening

    class SignalsOnCollection:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)  # (its Terminated is raised inside __del__: dropped)

    def listen_then_lose_a_sigterm(*args):
        listen(*args)
        SignalsOnCollection()  # (collected at once, in the main thread)

    monkeypatch.setattr(serve_http, "start_listening", listen_then_lose_a_sigterm)
    caplog.set_level("INFO", logger="worldserve")
    rescued = []
    rescue = threading.Timer(30, lambda: rescued.append(os.kill(os.getpid(), signal.SIGTERM)))  # (if lost)
    rescue.start()
    try:
        rc = main(
            [
                "serve",
                "--backend",
                "fake",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--storage-dir",
                str(tmp_path),
            ]
        )
    finally:
        rescue.cancel()
    err = capsys.readouterr().err
    # stopped either way by the SIGTERM delivered again: before uvicorn's handlers are in ("terminated", 143)
    # or after (a graceful stop, 0)
    assert not rescued and (rc, "shutdown requested" in caplog.text or "terminated" in err) in (
        (0, True),
        (143, True),
    )
    assert "Exception ignored" not in err


def test_a_sigterm_dropped_in_a_finalizer_still_ends_any_verb(monkeypatch, capsys):
    """The Terminated Python drops (raised inside a finalizer) is delivered again at the main thread's next
    instruction: `worldserve info` (any verb but serve) ends with "terminated", rc 143 (it had run to its
    end, rc 0, once the dropped exception was no longer printed)."""
    import signal
    import time

    from worldserve.cli import main
    from worldserve.commands import info

    class SignalsOnCollection:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)

    def run(args):
        SignalsOnCollection()  # (collected at once: the handler's Terminated is raised in __del__)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # (the delivered-again SIGTERM ends this at once)
            time.sleep(0.01)
        return 0

    monkeypatch.setattr(info, "run", run)
    started = time.monotonic()
    assert main(["info"]) == 143 and time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "worldserve info: terminated" in err and "Exception ignored" not in err


def test_a_sigterm_dropped_as_a_verb_ends_is_not_sent_after_main_returns(monkeypatch, capsys):
    """A Terminated dropped in the verb's last instructions: main returns 143 ("terminated") and the SIGTERM
    it would have sent again is cancelled; sent after main had restored the caller's handler, it would have
    ended the calling program (this test run)."""
    import signal
    import time

    from worldserve.cli import main
    from worldserve.commands import info

    class SignalsOnCollection:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)

    def run(args):
        SignalsOnCollection()
        return 0  # (at once: before the SIGTERM is sent again)

    monkeypatch.setattr(info, "run", run)
    assert main(["info"]) == 143 and "worldserve info: terminated" in capsys.readouterr().err
    time.sleep(0.1)  # (a SIGTERM sent now would end this process under pytest's default handler)


def test_sigterm_during_the_model_load_ends_serve_in_one_line(monkeypatch, tmp_path, capsys):
    """SIGTERM while serve loads its model (minutes at full size): one line and rc 143, the port and the job
    store's lock are let go (it had died at once with rc -15 and nothing said, its peers with a line each)."""
    import os
    import signal
    import socket
    import threading

    from worldserve.cli import main
    from worldserve.commands import serve_backend
    from worldserve.engine.jobs import JobStore

    loading, never = threading.Event(), threading.Event()

    def slow_load(*args):
        loading.set()
        never.wait(30)  # (a daemon thread: left behind as the real loader is)
        return None, None  # (a load's tuple: the abandoned one's goes to release_loaded)

    monkeypatch.setattr(serve_backend, "load_backend", slow_load)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def terminate():
        if loading.wait(30):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate, daemon=True).start()
    try:
        rc = main(["serve", "--host", "127.0.0.1", "--port", str(port), "--storage-dir", str(tmp_path)])
    finally:
        never.set()
    assert rc == 143
    assert "worldserve serve: terminated" in capsys.readouterr().err
    JobStore(tmp_path).close()  # the storage lock was released
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))  # the listener closed


@pytest.mark.parametrize("flag", ["--version", "-v"])
def test_version_flag_prints_the_version(flag, capsys):
    """`worldserve --version` as `vllm --version` (it was a usage error: a VERB is required)."""
    from worldserve import __version__
    from worldserve.cli import main

    with pytest.raises(SystemExit) as info:
        main([flag])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == __version__


def test_help_topics_as_vllm_reads_them():
    """vLLM's `--help=TOPIC` (it was a usage error, "ignored explicit argument"): the groups listed, a group's
    flags by its title in any case, flags by a part of their name, the whole help; no match is exit 1."""
    from cli_helpers import run_cli

    groups = run_cli("serve", "--help=listgroup")
    assert (
        groups.returncode == 0
        and "  - ParallelConfig" in groups.stdout
        and "  - SchedulerConfig" in groups.stdout
    )
    parallel = run_cli("serve", "--help=parallelconfig")
    assert parallel.returncode == 0 and parallel.stdout.startswith("ParallelConfig:")
    assert "--cfg-parallel-size" in parallel.stdout and "--max-num-seqs" not in parallel.stdout
    found = run_cli("serve", "--help=MAX-NUM-SEQ")
    assert found.returncode == 0 and "--max-num-seqs" in found.stdout and "--port" not in found.stdout
    assert "--steps" in run_cli("generate", "--help=steps").stdout
    whole = run_cli("serve", "--help=page")  # (not a terminal: printed without a pager)
    assert whole.returncode == 0 and "--port" in whole.stdout and "--max-num-seqs" in whole.stdout
    missing = run_cli("serve", "--help=no-such-flag")
    assert missing.returncode == 1 and "no group or parameter matching 'no-such-flag'" in missing.stderr


def test_an_abandoned_load_leaves_the_program_at_once(monkeypatch):
    """serve's --init-timeout expiring (or a signal during the load) left the load's torch C++ state to the
    interpreter's exit, which aborted the process (SIGABRT, exit 134, "terminate called without an active
    exception"): load_backend_within marks the load abandoned and the console entry then leaves with
    os._exit and main()'s status."""
    import time

    from worldserve import cli
    from worldserve.commands import serve_backend
    from worldserve.config import ModelConfig

    monkeypatch.setattr(serve_backend, "load_backend", lambda *a: (time.sleep(2), None))
    monkeypatch.setattr(serve_backend.LOAD_ABANDONED, "_flag", False)
    assert serve_backend.load_backend_within(ModelConfig(init_timeout=0.1)) is None
    assert serve_backend.LOAD_ABANDONED.is_set()

    class Left(Exception):
        pass

    def leave(rc):
        raise Left(rc)

    monkeypatch.setattr(cli, "main", lambda: 143)
    monkeypatch.setattr(cli.os, "_exit", leave)
    with pytest.raises(Left, match="143"):
        cli.console()
    serve_backend.LOAD_ABANDONED.clear()
    with pytest.raises(SystemExit) as normal:
        cli.console()
    assert normal.value.code == 143
