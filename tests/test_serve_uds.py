"""vLLM's `--uds PATH` (a Unix domain socket instead of --host / --port) and the HTTP-server flags vLLM's
frontend has beside it, on a real `worldserve serve` (fake backend) reached through httpx's UDS transport:
`uds:` from a --config file, a stale socket file replaced and the file removed at exit, the start line naming
`unix:PATH`, --h11-max-header-count (431) and --h11-max-incomplete-event-size (h11's 400),
--disable-access-log-for-endpoints and --log-config-file (both loggers configured by the file), and
--root-path's redirect keeping the prefix. The socket's own refusals (a live server, another kind of file,
a path too long) are checked on the binding function.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serving_helpers import wait_healthy

from worldserve.commands import serve_http

TESTS = Path(__file__).parent


def test_a_stale_socket_file_is_replaced_and_removed_at_the_end(tmp_path):
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:  # (a killed server leaves its file)
        gone.bind(path)
    sock = serve_http.bind_unix_listener(path)
    with sock, serve_http.unix_socket_removed(sock):
        serve_http.start_listening(sock, None)
        assert serve_http.listen_address(sock, "http", None) == f"unix:{path}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)
    assert not os.path.exists(path)


def test_what_the_socket_path_cannot_be(tmp_path):
    """A server still listening there, a file that is not a socket, a path over AF_UNIX's 107 bytes: each a
    one-line ValueError naming --uds (uvicorn would remove a live server's socket file)."""
    live = str(tmp_path / "live.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(live)
        other.listen()
        with pytest.raises(ValueError, match="^--uds .*live.sock: another server is listening on it"):
            serve_http.bind_unix_listener(live)
        assert os.path.exists(live)
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="a file that is not a socket"):
        serve_http.bind_unix_listener(str(tmp_path / "notes.txt"))
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="^--uds .*: cannot bind it"):
        serve_http.bind_unix_listener(str(tmp_path / ("x" * 120)))


LOG_CONFIG = {
    "version": 1,
    "formatters": {"tagged": {"format": "CFG %(name)s %(message)s"}},
    "handlers": {"file": {"class": "logging.FileHandler", "filename": "", "formatter": "tagged"}},
    "loggers": {
        "worldserve": {"handlers": ["file"], "level": "INFO"},
        "uvicorn": {"handlers": ["file"], "level": "INFO", "propagate": False},
        "uvicorn.access": {"handlers": ["file"], "level": "INFO", "propagate": False},
    },
}


def _unfinished_headers(path: Path, size: int) -> bytes:
    """The answer to `size` bytes of a request's headers that never end (h11 refuses them once they pass its
    --h11-max-incomplete-event-size; left at its 1 MiB default, the read would time out instead)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(30)
        raw.connect(str(path))
        raw.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * size)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    return answer


def test_a_real_server_on_a_unix_socket(tmp_path):
    path = tmp_path / "ws.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(path))
    (tmp_path / "c.yaml").write_text(f"uds: {path}\nroot-path: /api\n")
    config = {**LOG_CONFIG, "handlers": {"file": {**LOG_CONFIG["handlers"]["file"],
                                                  "filename": str(tmp_path / "cfg.log")}}}  # fmt: skip
    (tmp_path / "log.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "worldserve.cli", "serve", "--backend", "fake", "--storage-dir",
           str(tmp_path / "s"), "--config", str(tmp_path / "c.yaml"), "--h11-max-header-count", "30",
           "--h11-max-incomplete-event-size", "4096", "--disable-access-log-for-endpoints", "/health,/metrics",
           "--log-config-file", str(tmp_path / "log.json")]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        transport = httpx.HTTPTransport(uds=str(path))
        with httpx.Client(transport=transport, base_url="http://localhost", timeout=10) as http:
            wait_healthy(http, proc)
            assert http.get("/api/v1/models").status_code == 200
            redirect = http.get("/api/v1/videos/")
            assert redirect.status_code == 307
            assert redirect.headers["location"] == "http://localhost/api/v1/videos"
            many = http.get("/v1/models", headers={f"x-h{i}": "v" for i in range(40)})
            assert many.status_code == 431 and many.json()["error"]["code"] == 431
            assert "--h11-max-header-count" in many.json()["error"]["message"]
            assert _unfinished_headers(path, 5000).startswith(b"HTTP/1.1 431 "), "h11's bound (under the cap)"
            assert http.get("/metrics").status_code == 200 and http.get("/api/health").status_code == 200
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out[-3000:]
    assert not path.exists(), "the socket file is removed at exit"
    logged = (tmp_path / "cfg.log").read_text()
    assert f"CFG worldserve.serve Starting worldserve API server on unix:{path} " in logged, logged[-3000:]
    assert "CFG uvicorn.error Application startup complete." in logged
    assert '"GET /api/v1/models HTTP/1.1" 200' in logged and '"GET /v1/models HTTP/1.1" 431' in logged
    assert "GET /api/health" not in logged and "GET /health" not in logged and "GET /metrics" not in logged
