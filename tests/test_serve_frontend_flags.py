"""The flags of vLLM's OpenAI frontend and engine that a pasted `vllm serve` line carries and that had been
"unrecognized arguments": HTTPS from a certfile alone (certificate and key in one PEM, as uvicorn and vLLM
take it), --ssl-ciphers honoured on a real TLS server, --h11-max-header-count's 431 (HTTP and WebSocket),
--disable-mm-preprocessor-cache folded into --mm-processor-cache-gb 0, and each of the others accepted with
one log line saying why it changes nothing, or refused before the model loads with one line naming it.
(--uds, the h11 byte bound, the access-log exclusions and --log-config-file run on a real server in
tests/test_serve_uds.py.)
"""

from __future__ import annotations

import logging
import ssl
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from serving_helpers import make_client, serve_app
from test_serve_compat_flags import config, flag_of, parse_args

from worldserve.api.app import build_app
from worldserve.api.header_count import HeaderCountLimit
from worldserve.commands import serve, serve_compat, serve_http


@pytest.fixture(scope="module")
def pem(tmp_path_factory) -> Path:
    """A folder with cert.pem, key.pem and both.pem (the certificate and its key in one file)."""
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "1", "-subj", "/CN=localhost"], cwd=folder, check=True,
                   capture_output=True)  # fmt: skip
    (folder / "both.pem").write_text((folder / "cert.pem").read_text() + (folder / "key.pem").read_text())
    return folder


def _handshake(url: str, cipher: str) -> str:
    """The cipher a TLS 1.2 client offering only `cipher` agrees on with the server at `url`."""
    import socket

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(cipher)
    where = urlsplit(url)
    with (
        socket.create_connection((where.hostname, where.port), timeout=10) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        return tls.cipher()[0]


def test_a_certfile_holding_its_key_serves_https_alone(tmp_path, pem):
    """`--ssl-certfile both.pem` without --ssl-keyfile was refused ("go together"); uvicorn loads it with
    load_cert_chain(certfile, None). A keyfile alone is still refused."""
    args = parse_args("--ssl-certfile", str(pem / "both.pem"))
    serve_http.check_http_arguments(args)
    with serve_app(build_app(make_client(tmp_path)), **serve_http.uvicorn_options(args)) as url:
        answer = httpx.get(url.replace("http://", "https://") + "/version", verify=False, timeout=10)
    assert answer.status_code == 200
    with pytest.raises(ValueError, match="^--ssl-keyfile needs --ssl-certfile"):
        serve_http.check_http_arguments(parse_args("--ssl-keyfile", str(pem / "key.pem")))
    # (a certificate without its key)
    with pytest.raises(ValueError, match="^--ssl-certfile: cannot load it"):
        serve_http.check_http_arguments(parse_args("--ssl-certfile", str(pem / "cert.pem")))


def test_ssl_ciphers_limit_what_tls_1_2_clients_may_use(tmp_path, pem):
    wanted, other = "ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-RSA-AES256-GCM-SHA384"
    args = parse_args("--ssl-certfile", str(pem / "cert.pem"), "--ssl-keyfile", str(pem / "key.pem"),
                      "--ssl-ciphers", wanted)  # fmt: skip
    serve_http.check_http_arguments(args)
    with serve_app(build_app(make_client(tmp_path)), **serve_http.uvicorn_options(args)) as url:
        assert _handshake(url, wanted) == wanted
        with pytest.raises(ssl.SSLError):
            _handshake(url, other)
    bad = parse_args("--ssl-certfile", str(pem / "both.pem"), "--ssl-ciphers", "NO-SUCH-CIPHER")
    with pytest.raises(ValueError, match="^--ssl-ciphers 'NO-SUCH-CIPHER': OpenSSL knows none"):
        serve_http.check_http_arguments(bad)


@pytest.mark.anyio
async def test_h11_max_header_count_answers_431(tmp_path, anyio_backend):
    app = build_app(make_client(tmp_path))
    serve_http.install(app, root_path=None, middlewares=[], max_header_count=8)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        assert (await http.get("/version", headers={f"x-{i}": "v" for i in range(3)})).status_code == 200
        many = await http.get("/version", headers={f"x-{i}": "v" for i in range(9)})
    assert many.status_code == 431 and many.json()["error"]["type"] == "Request Header Fields Too Large"
    sent = []

    async def send(message):
        sent.append(message)

    handshake = {"type": "websocket", "path": "/v1/realtime/video", "headers": [(b"x", b"v")] * 9}
    await HeaderCountLimit(app, limit=8)(handshake, None, send)
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "Too many headers"}]


def test_disable_mm_preprocessor_cache_is_a_zero_cache():
    """vLLM's deprecated flag is --mm-processor-cache-gb 0, and wins over that flag, as in vLLM."""
    assert config("--disable-mm-preprocessor-cache").reasoner.mm_processor_cache_gb == 0
    both = config("--mm-processor-cache-gb", "8", "--disable-mm-preprocessor-cache")
    assert both.reasoner.mm_processor_cache_gb == 0
    assert config("--no-disable-mm-preprocessor-cache").reasoner.mm_processor_cache_gb == 4.0


ACCEPTED = [
    "--log-error-stack", "--enable-log-deltas", "--no-enable-log-outputs", "--no-enable-ssl-refresh",
    "--disable-frontend-multiprocessing", "--tool-parser-plugin", "",
    "--max-logprobs", "20", "--distributed-executor-backend", "mp", "--hf-token", "--code-revision", "abc",
    "--max-parallel-loading-workers", "2", "--cpu-offload-gb", "0", "--speculative-config", "{}",
    "--structured-outputs-config", '{"backend": "guidance"}', "--guided-decoding-backend", "auto",
    "--model-impl", "auto", "--no-skip-tokenizer-init", "--no-tokens-only", "--no-enable-per-request-metrics",
    "--no-exclude-tools-when-tool-choice-none", "--no-enable-tokenizer-info-endpoint", "--no-enable-offline-docs",
]  # fmt: skip


def test_accepted_frontend_and_engine_flags_log_why(caplog):
    args = parse_args("nvidia/Cosmos3-Nano", "--revision", "r1", "--tokenizer-revision", "r1", *ACCEPTED)
    with caplog.at_level(logging.INFO, logger="worldserve.serve"):
        serve_compat.log_compat(args, serve.engine_config(args))
    logged = {flag_of(r) for r in caplog.records}
    for flag in (a for a in ACCEPTED if a.startswith("--")):
        assert flag in logged, flag
    assert "--tokenizer-revision" in logged and "accepted, no effect: " in caplog.text


REFUSED = [
    (["--enable-ssl-refresh"], "restart it"), (["--enable-log-outputs"], "not what they generate"),
    (["--enable-tokenizer-info-endpoint"], "/tokenizer_info"), (["--enable-offline-docs"], "CDN"),
    (["--tokens-only"], "whole API"), (["--headless"], "headless"), (["--enable-per-request-metrics"], "/metrics"),
    (["--exclude-tools-when-tool-choice-none"], "send no tools"), (["--tool-parser-plugin", "p.py"], "hermes"),
    (["--tool-server", "demo"], "tool calls go back"), (["--max-logprobs", "5"], "at 20"),
    (["--distributed-executor-backend", "ray"], "no Ray"), (["--hf-token", "hf_secret"], "HF_TOKEN"),
    (["--tokenizer-revision", "r2"], "--revision"), (["--cpu-offload-gb", "4"], "--enable-layerwise-offload"),
    (["--speculative-config", '{"method": "ngram"}'], "speculative"),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], "llguidance"),
    (["--guided-decoding-backend", "outlines"], "llguidance"), (["--model-impl", "transformers"], "its own"),
    (["--skip-tokenizer-init"], "tokenizer"), (["--otlp-traces-endpoint", "http://c:4317"], "OpenTelemetry"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "why"), REFUSED, ids=[r[0][0] + str(i) for i, r in enumerate(REFUSED)])
def test_frontend_and_engine_flags_worldserve_cannot_honour_are_refused(argv, why):
    """One line starting with the flag, saying why; never a bare "unrecognized arguments"."""
    with pytest.raises(ValueError) as error:
        config(*argv)
    message = str(error.value)
    assert message.startswith(argv[0]) and why in message and "\n" not in message
    assert "hf_secret" not in message, "a token is never echoed"


def test_a_log_config_file_that_is_no_configuration_is_named(tmp_path):
    """(checked before dictConfig, which would first close every handler the process has)"""
    from worldserve.commands import serve_logging

    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "cut.json").write_text('{"version": 1,')
    with pytest.raises(ValueError, match="^--log-config-file .*list.json: expected a logging configuration"):
        serve_logging.apply_log_config(str(tmp_path / "list.json"))
    with pytest.raises(ValueError, match="^--log-config-file .*cut.json: cannot read it"):
        serve_logging.apply_log_config(str(tmp_path / "cut.json"))
    (tmp_path / "level.json").write_text('{"version": 1, "loggers": {"worldserve.x": {"level": "BOGUS"}}}')
    with pytest.raises(
        ValueError, match=r"Unable to configure logger 'worldserve.x' \(Unknown level: 'BOGUS'\)"
    ):
        serve_logging.apply_log_config(str(tmp_path / "level.json"))


def test_vllms_logging_config_path_variable_is_read_as_the_flag(tmp_path, monkeypatch):
    """VLLM_LOGGING_CONFIG_PATH (vLLM's) configures logging as --log-config-file does, which wins; a bad file
    stops the start naming the variable, before anything loads."""
    import json

    (tmp_path / "cut.json").write_text('{"version": 1,')
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "cut.json"))
    with pytest.raises(ValueError, match="^VLLM_LOGGING_CONFIG_PATH .*cut.json: cannot read it"):
        serve._checked_config(parse_args("--backend", "fake"))
    good = {"version": 1, "handlers": {"f": {"class": "logging.FileHandler", "filename": str(tmp_path / "v.log")}},
            "loggers": {"worldserve.test_env_log": {"handlers": ["f"], "level": "INFO"}}}  # fmt: skip
    (tmp_path / "good.json").write_text(json.dumps(good))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "good.json"))
    args = parse_args("--backend", "fake", "--storage-dir", str(tmp_path / "s"))
    try:
        serve._checked_config(args)
        logging.getLogger("worldserve.test_env_log").info("configured by the variable")
        assert args.log_config_file == str(tmp_path / "good.json")
    finally:
        for handler in logging.getLogger("worldserve.test_env_log").handlers:
            handler.close()
        logging.getLogger("worldserve.test_env_log").handlers.clear()
    assert "configured by the variable" in (tmp_path / "v.log").read_text()
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "cut.json"))
    flagged = parse_args("--backend", "fake", "--storage-dir", str(tmp_path / "s"), "--log-config-file",
                         str(tmp_path / "good.json"))  # fmt: skip
    serve._checked_config(flagged)  # (the flag wins: the variable's bad file is not read)
