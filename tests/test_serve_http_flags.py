"""vLLM's `serve` flags beyond the recipe's, as a pasted `vllm serve` line uses them: the HTTP-server ones
honoured on a real `worldserve serve` (HTTPS, --root-path with the API key still checked, --middleware,
--disable-fastapi-docs, --config YAML with the command line winning), vLLM's value spellings (--max-model-len
32k / 32K / auto, --dtype half / float, several --served-model-name), the others accepted with one log line or
refused before the model loads (exit 2, naming the flag); /v1/models carries the chat context length.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from chat_fakes import ScriptedChatBackend
from serving_helpers import SMALL_FORM, asgi_server, make_client, served_port, wait_healthy

from worldserve.api.app import build_app
from worldserve.cli import build_parser
from worldserve.commands import serve, serve_backend, serve_compat, serve_http
from worldserve.commands.vllm_argv import vllm_argv

TESTS = Path(__file__).parent


def parse_args(*argv: str):
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


@pytest.mark.parametrize("text, tokens", [("32768", 32768), ("32k", 32000), ("32K", 32768), ("25.6k", 25600),
                                          ("1m", 1_000_000), ("auto", 32768), ("-1", 32768)])  # fmt: skip
def test_max_model_len_takes_vllms_human_readable_numbers(text, tokens):
    assert serve.engine_config(parse_args("--max-model-len", text)).reasoner.max_model_len == tokens


@pytest.mark.parametrize("text", ["1.5K", "32kb", "x", "-2"])
def test_a_malformed_max_model_len_is_an_argparse_error(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args("--max-model-len", text)
    assert exit_.value.code == 2 and "--max-model-len" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "text", "value"), [
    ("--max-num-batched-tokens", "16k", 16000), ("--max-num-batched-tokens", "16K", 16384),
    ("--max-num-batched-tokens", "8192", 8192), ("--kv-cache-memory-bytes", "1G", 2**30),
    ("--kv-cache-memory-bytes", "512M", 512 * 2**20), ("--kv-cache-memory-bytes", "2.5g", 2_500_000_000),
])  # fmt: skip
def test_vllms_human_readable_token_and_byte_counts(flag, text, value, capsys):
    """vLLM types --max-num-batched-tokens and --kv-cache-memory-bytes human-readable (as --max-model-len):
    16k, 1G pasted from a vLLM command line were an argparse error here."""
    cfg = serve.engine_config(parse_args(flag, text))
    got = cfg.scheduler.max_num_batched_tokens if "batched" in flag else cfg.reasoner.kv_cache_memory_bytes
    assert got == value
    for bad in ("1.5K", "auto", "x"):  # (no auto here: those flags have no model-derived value)
        with pytest.raises(SystemExit) as exit_:
            parse_args(flag, bad)
        assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_vllms_underscore_flag_names(tmp_path, monkeypatch):
    """vLLM's parser takes `--max_model_len 16384` and `--tensor_parallel_size=1`; they were unrecognized
    arguments here. Values keep their underscores."""
    from worldserve.cli import main

    argv = vllm_argv(["serve", "--max_model_len", "16k", "--served_model_name=my_model", "--api_key", "k_1"])
    assert argv == ["serve", "--max-model-len", "16k", "--served-model-name=my_model", "--api-key", "k_1"]
    cfg = serve.engine_config(build_parser(argv).parse_args(argv))
    assert (cfg.reasoner.max_model_len, cfg.model.served_model_name) == (16000, "my_model")
    seen = []
    monkeypatch.setattr(serve, "run", lambda args: seen.append(args.tensor_parallel_size) or 0)
    assert main(["serve", "--tensor_parallel_size=1", "--storage-dir", str(tmp_path)]) == 0 and seen == [1]


def test_vllms_dotted_json_keys():
    """vLLM's `--json-flag.key value`: the keys of one flag merged into its JSON object (they were unrecognized
    arguments); a value is JSON where it parses, `key+ a,b` a list; keys keep their underscores."""

    argv = vllm_argv(["serve", "--media-io-kwargs.video.num_frames", "-1", "--media_io_kwargs.video.fps=2.5",
                      "--mm-processor-kwargs.max_pixels", "1000000", "--limit-mm-per-prompt.image", "2",
                      "--override-generation-config.stop+", "a,b", "--port", "8001"])  # fmt: skip
    assert argv[:3] == ["serve", "--port", "8001"]
    objects = {argv[i]: json.loads(argv[i + 1]) for i in range(3, len(argv), 2)}
    assert objects == {
        "--media-io-kwargs": {"video": {"num_frames": -1, "fps": 2.5}},
        "--mm-processor-kwargs": {"max_pixels": 1000000},
        "--limit-mm-per-prompt": {"image": 2},
        "--override-generation-config": {"stop": ["a", "b"]},
    }
    cfg = serve.engine_config(build_parser(argv).parse_args(argv))
    assert dict(cfg.media.media_io_kwargs) == {"video": {"num_frames": -1, "fps": 2.5}}
    assert vllm_argv(["serve", "--x.y=text", "--z.k"]) == ["serve", "--z.k", "--x", '{"y": "text"}']
    assert vllm_argv(["serve", "-O.level", "3"]) == ["serve", "--compilation-config", '{"level": 3}']
    # newest vLLM's optimization levels (FlexibleArgumentParser: -O<level> is --optimization-level <level>)
    assert vllm_argv(["-O3", "-O=2", "-Odecode", "-O", "1"]) == [
        "--optimization-level", "3", "--optimization-level", "2", "--optimization-level", "decode",
        "--optimization-level", "1"]  # fmt: skip
    assert vllm_argv(["-O", '{"level": 3}', "-O{}"]) == ["-O", '{"level": 3}', "-O{}"]


def test_vllms_dotted_keys_merge_as_vllm_merges_them():
    """vLLM's FlexibleArgumentParser (recursive_dict_update) concatenates a list key given twice, `--flag.key+
    a --flag.key+ b,c` being ["a", "b", "c"] (its own --help tip), merges an object given after keys below it,
    and reads a value that is no JSON as a human-readable integer where it is one (1M, 80g)."""

    def objects(*argv: str) -> dict:
        out = vllm_argv(["serve", *argv])
        return {out[i]: json.loads(out[i + 1]) for i in range(1, len(out), 2)}

    assert objects("--override-generation-config.stop+", "a", "--override-generation-config.stop+=b,c") == {
        "--override-generation-config": {"stop": ["a", "b", "c"]}
    }
    assert objects("--media-io-kwargs.video.num_frames", "16", "--media-io-kwargs.video", '{"fps": 2}') == {
        "--media-io-kwargs": {"video": {"num_frames": 16, "fps": 2}}
    }
    assert objects("--media-io-kwargs.video", "1", "--media-io-kwargs.video.fps", "2") == {
        "--media-io-kwargs": {"video": {"fps": 2}}
    }
    assert objects("--mm-processor-kwargs.max_pixels", "1M", "--mm-processor-kwargs.size", "1.5K") == {
        "--mm-processor-kwargs": {"max_pixels": 2**20, "size": "1.5K"}  # (no decimals with K: the text)
    }
    argv = vllm_argv(["serve", "--mm-processor-kwargs.max_pixels", "1M"])
    cfg = serve.engine_config(build_parser(argv).parse_args(argv))
    assert dict(cfg.media.mm_processor_kwargs) == {"max_pixels": 1048576}


def test_vllm_dtype_spellings_and_several_served_names(caplog):
    assert serve.engine_config(parse_args("--dtype", "half")).model.dtype == "float16"
    assert serve.engine_config(parse_args("--dtype", "float")).model.dtype == "float32"
    args = parse_args("nvidia/Cosmos3-Nano", "--served-model-name", "cosmos", "c3")
    cfg = serve.engine_config(args)
    assert (cfg.model.model, cfg.model.served_model_name) == ("nvidia/Cosmos3-Nano", "cosmos")
    assert cfg.model.served_model_aliases == ("c3",) and cfg.resolve().model.served_model_aliases == ("c3",)
    with caplog.at_level(logging.INFO, logger="worldserve.serve"):
        serve_compat.log_compat(args, cfg)
    assert "requests may name 'cosmos' or 'c3'" in caplog.text


@pytest.mark.anyio
async def test_every_served_name_is_accepted(tmp_path, anyio_backend):
    """vLLM's several --served-model-name: /v1/models lists each, a request may name any, the job carries the
    first; another name is still refused."""
    async with asgi_server(tmp_path, app_kw={"model_aliases": ("c3",)}) as http:
        models = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["test-model", "c3"]
        for name, status in (("c3", 200), ("test-model", 200), ("c4", 400)):
            r = await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "a cat", "model": name})
            assert r.status_code == status, (name, r.text)
            if status == 200:
                assert r.json()["model"] == "test-model"
            else:
                assert r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("argv", [
    ["-O", "3"], ["-O3"], ["-Odecode"], ["-O=2"], ["--compilation-config", '{"level": 3}'], ["-O", '{"level": 3}'],
    ["--block-size", "16"], ["--swap-space", "4"], ["-pp", "1"], ["--data-parallel-size", "1"],
    ["--load-format", "safetensors"], ["--tokenizer-mode", "auto"], ["--chat-template-content-format", "auto"],
])  # fmt: skip
def test_accepted_flags_log_why_they_change_nothing(argv, caplog):
    args = parse_args(*vllm_argv(argv))  # (as main() reads a command line)
    with caplog.at_level(logging.INFO, logger="worldserve.serve"):
        serve_compat.log_compat(args, serve.engine_config(args))
    assert "accepted, no effect: " in caplog.text


@pytest.mark.parametrize("argv, named", [
    (["--chat-template", "t.jinja"], "--chat-template"), (["--response-role", " "], "--response-role"),
    (["--mm-processor-kwargs", '{"fps": "x"}'], "--mm-processor-kwargs"),
    (["--media-io-kwargs", '{"audio": {}}'], "--media-io-kwargs"), (["--tokenizer", "x"], "--tokenizer"),
    (["-dp", "2"], "--data-parallel-size"), (["--download-dir", "/tmp"], "--download-dir"),
    (["--enable-sleep-mode"], "--enable-sleep-mode"), (["--middleware", "no_such_module.thing"], "--middleware"),
    (["--ssl-keyfile", "/nonexistent.pem", "--ssl-certfile", "/nonexistent.pem"], "--ssl-certfile"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile"), (["--config", "/nonexistent.yaml"], "--config"),
    # unused without HTTPS (they were dropped in silence), a mode ssl lacks, a folder that is not there
    (["--ssl-ca-certs", "/nonexistent.ca"], "--ssl-ca-certs"), (["--ssl-cert-reqs", "5"], "--ssl-cert-reqs"),
    (["--ssl-ciphers", "ECDHE-RSA-AES128-GCM-SHA256"], "--ssl-ciphers"),
    (["--disable-access-log-for-endpoints", "/health,metrics"], "--disable-access-log-for-endpoints"),
    (["--log-config-file", "/nonexistent.json"], "--log-config-file"), (["--uds", ""], "--uds"),
    (["--allowed-local-media-path", "/nonexistent/dir"], "--allowed-local-media-path"),
])  # fmt: skip
def test_values_worldserve_cannot_honour_stop_the_start_before_the_load(
    argv, named, tmp_path, caplog, monkeypatch
):
    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        assert serve.run(parse_args(*argv, "--storage-dir", str(tmp_path / "s"), "--port", "0")) == 2
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert named in record.getMessage() and record.exc_info is None and not loads


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a Hopper GPU")
@pytest.mark.parametrize("flag", [["--quantization", "fp8"], ["--fp8-attention"]])
def test_fp8_kernels_this_machine_lacks_stop_the_start_before_the_load(flag, tmp_path, caplog, monkeypatch):
    """(serve found them after loading the model, exit 1; generate refused them before, exit 2)"""
    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        assert serve.run(parse_args(*flag, "--storage-dir", str(tmp_path / "s"), "--port", "0")) == 2
    assert flag[0] in caplog.text and not loads


def test_config_file_fills_what_the_command_line_left(tmp_path):
    (tmp_path / "c.yaml").write_text("model: some/model\nmax_model_len: 16k\nmax-num-seqs: 8\nenforce-eager: true\n"
                                     "allowed-origins: '[\"https://a.example\"]'\nport: 9000\n")  # fmt: skip
    cfg = serve.engine_config(parse_args("--config", str(tmp_path / "c.yaml"), "--port", "8001"))
    assert (cfg.model.model, cfg.reasoner.max_model_len, cfg.scheduler.max_num_seqs) == (
        "some/model",
        16000,
        8,
    )
    assert cfg.model.enforce_eager and cfg.server.allowed_origins == ("https://a.example",)
    assert cfg.server.port == 8001, "the command line wins"
    (tmp_path / "bad.yaml").write_text("max-num-seqs: lots\n")
    with pytest.raises(ValueError, match="--config .*bad.yaml.*--max-num-seqs"):
        serve.engine_config(parse_args("--config", str(tmp_path / "bad.yaml")))


def test_config_file_values_as_vllm_spells_them(tmp_path):
    """vLLM's --config rules: a flag on the command line wins even at its default value, false is the flag's
    --no- form, a list for a repeatable flag repeats it (it spilled into MODEL: `middleware: [a.b, c.d]` made
    c.d the model); a list for a one-value flag is an error naming it."""
    (tmp_path / "c.yaml").write_text("port: 9000\nenable-request-id-headers: false\nmiddleware: [a.b, c.d]\n")
    args = parse_args("--config", str(tmp_path / "c.yaml"), "--port", "8000")
    cfg = serve.engine_config(args)
    assert cfg.server.port == 8000, "the command line wins, even at the default value"
    assert cfg.server.enable_request_id_headers is False
    assert (cfg.model.model, args.middleware) == (None, ["a.b", "c.d"])
    (tmp_path / "bad.yaml").write_text("port: [8001, 8002]\n")
    with pytest.raises(ValueError, match="--config .*bad.yaml.*--port takes one value"):
        serve.engine_config(parse_args("--config", str(tmp_path / "bad.yaml")))
    (tmp_path / "cut.yaml").write_text("port: [unclosed\n")  # YAML's parse error spans 4 lines: one here
    with pytest.raises(ValueError, match="--config .*cut.yaml: cannot read it") as error:
        serve.engine_config(parse_args("--config", str(tmp_path / "cut.yaml")))
    assert "\n" not in str(error.value)
    (tmp_path / "bin.yaml").write_bytes(
        b"\xff\xfe\x00"
    )  # not UTF-8: named as the file's, not a bare codec error
    with pytest.raises(ValueError, match="--config .*bin.yaml: cannot read it \\(not UTF-8 text"):
        serve.engine_config(parse_args("--config", str(tmp_path / "bin.yaml")))


def test_config_file_log_file_gets_the_log(tmp_path):
    """`log-file:` in the --config file is honoured (it was read before the file was applied: no log)."""
    (tmp_path / "c.yaml").write_text(f"log-file: {tmp_path / 'serve.log'}\nworker-backend: ray\n")
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        assert serve.run(parse_args("--config", str(tmp_path / "c.yaml"))) == 2
    finally:
        for handler in set(root.handlers) - set(before):
            root.removeHandler(handler)
            handler.close()
    assert "--worker-backend ray: worldserve spawns" in (tmp_path / "serve.log").read_text()


@pytest.mark.anyio
async def test_a_doubled_root_path_does_not_skip_the_api_key(tmp_path, anyio_backend):
    """--root-path /api: /api/api/v1/models reached /v1/models (the prefix middleware stripped one /api, the
    router the other) while the key check saw /api/v1/models and let it through; it is a 404 now, as plain
    FastAPI with that root path answers it."""
    from worldserve.commands.serve_http import install

    app = build_app(make_client(tmp_path), api_keys=["sk-test"])
    install(app, root_path="/api", middlewares=[])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for path in ("/v1/models", "/api/v1/models", "/api/api/v1/models", "/api/api/api/v1/models"):
            assert (await http.get(path)).status_code in (401, 404), path
        keyed = await http.get("/api/v1/models", headers={"Authorization": "Bearer sk-test"})
        assert keyed.status_code == 200


def _idle_connection_closes_after(port: int, keep_alive_s: float) -> None:
    """A TLS keep-alive connection idle past `keep_alive_s` is closed by the server (uvicorn's default, 5 s,
    would keep it open: the read then times out)."""
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port)) as raw, ctx.wrap_socket(raw) as tls:
        tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"healthy" not in answer:  # (headers and body may come in two records)
            answer += tls.recv(65536)
        assert b" 200 " in answer
        time.sleep(keep_alive_s + 1.5)
        tls.settimeout(2.0)
        try:
            assert tls.recv(65536) == b""  # the server closed it
        except (ssl.SSLEOFError, ConnectionResetError):
            pass


def _silent_connection_gets_408(port: int, header_timeout_s: float) -> None:
    """A TLS connection that sends no request is answered 408 and closed at the header deadline
    (api/http_protocol.py; uvicorn alone keeps it open). The read's timeout, 6x the deadline set here and far
    under the 60 s default, is the guard: a deadline left at its default fails the read (a TimeoutError)."""
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port)) as raw, ctx.wrap_socket(raw) as tls:
        answer = b""
        tls.settimeout(header_timeout_s + 5)
        try:
            while chunk := tls.recv(65536):
                answer += chunk
        except (ssl.SSLEOFError, ConnectionResetError):
            pass
        assert answer.startswith(b"HTTP/1.1 408 ")


def test_a_bad_ca_file_beside_a_good_certificate_is_blamed_on_itself(tmp_path):
    """(the certificate and key were blamed for a missing --ssl-ca-certs)"""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "1", "-subj", "/CN=localhost"], cwd=tmp_path, check=True,
                   capture_output=True)  # fmt: skip
    good = ["--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "cert.pem")]
    with pytest.raises(ValueError, match="^--ssl-ca-certs /nonexistent.ca: cannot load it"):
        serve_http.check_http_arguments(parse_args(*good, "--ssl-ca-certs", "/nonexistent.ca"))
    serve_http.check_http_arguments(
        parse_args(*good, "--ssl-ca-certs", str(tmp_path / "cert.pem"), "--ssl-cert-reqs", "2")
    )


def test_a_root_path_without_its_slash_is_refused():
    """--root-path api (no leading slash) had been taken and then matched no request path: every prefixed
    request a 404 while /openapi.json advertised the prefix."""
    with pytest.raises(ValueError, match="^--root-path 'api' must start with '/'"):
        serve_http.check_http_arguments(parse_args("--root-path", "api"))
    serve_http.check_http_arguments(parse_args("--root-path", "/api"))


def test_a_real_server_with_vllms_http_flags(tmp_path):
    """HTTPS, --root-path (the API key still checked under the prefix), --middleware, no docs, flags from
    --config, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE and our WORLDSERVE_HTTP_HEADER_TIMEOUT: on a real
    `worldserve serve` (fake backend)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "1", "-subj", "/CN=localhost"], cwd=tmp_path, check=True,
                   capture_output=True)  # fmt: skip
    (tmp_path / "c.yaml").write_text("api-key: sk-test\nserved-model-name: [cosmos, c3]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "1", "WORLDSERVE_HTTP_HEADER_TIMEOUT": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "worldserve.cli", "serve", "--backend", "fake", "--host", "127.0.0.1", "--port",
           "0", "--storage-dir", str(tmp_path / "s"), "--config", str(tmp_path / "c.yaml"), "--root-path",
           "/api", "--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "cert.pem"),
           "--middleware", "serve_middleware.stamp", "--disable-fastapi-docs", "--disable-uvicorn-access-log",
           "--log-file", str(tmp_path / "serve.log")]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = served_port(tmp_path / "serve.log", proc)
        # a new connection a request: the server closes idle ones after 1 s here, so a reused one could be
        # closed just as a request goes out on a busy host (seen in CI at the 11th request)
        fresh = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(
            base_url=f"https://127.0.0.1:{port}", verify=False, timeout=10, limits=fresh
        ) as http:
            wait_healthy(http, proc)
            _idle_connection_closes_after(port, 1.0)
            _silent_connection_gets_408(port, 1.0)
            key = {"Authorization": "Bearer sk-test"}
            assert http.get("/api/api/v1/models").status_code == 404, "a doubled prefix reached a route"
            for path in ("/api/v1/models", "/v1/models"):
                assert http.get(path).status_code == 401, path  # the prefix does not bypass the key
                models = http.get(path, headers=key)
                assert models.status_code == 200
                assert [m["id"] for m in models.json()["data"]] == ["cosmos", "c3"]
                assert models.headers["x-stamped"] == path, "a --middleware sees the URL the client sent"
            assert http.get("/api/health").status_code == 200
            for path in ("/docs", "/openapi.json", "/redoc", "/api/docs"):
                assert http.get(path).status_code == 404, path
            metrics = http.get("/api/metrics").text
            assert 'handler="/v1/models"' in metrics and 'model_name="cosmos"' in metrics
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "https://" in out and "requests may name 'cosmos' or 'c3'" in out
    assert '"GET /v1/models HTTP/1.1"' not in out, "--disable-uvicorn-access-log"
    logged = (tmp_path / "serve.log").read_text()  # the file as the console (it had every access line)
    assert "https://" in logged and '"GET /v1/models HTTP/1.1"' not in logged, logged[-2000:]


@pytest.mark.anyio
async def test_models_card_carries_the_chat_context_length(tmp_path, anyio_backend):
    """As vLLM's card: max_model_len is the Reasoner's context length (null without chats)."""
    chat = ScriptedChatBackend()
    chat.max_model_len = 4096
    for backend, expected in ((chat, 4096), (None, None)):
        client = make_client(tmp_path / str(expected), chat_backend=backend)
        app = build_app(client)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            (card,) = (await http.get("/v1/models")).json()["data"]
        assert card["max_model_len"] == expected
