"""Engine death (serving-api.md §3.2, §6.2, §7.3): a Reasoner chat worker whose loop failed makes /health 503
with the reason, and later chats a 503 naming it, counted nowhere (over real HTTP: GracefulServer, uvicorn on
loopback, a scripted chat backend); a dead engine stops `worldserve serve` as SIGTERM does, exit status 1, its
unfinished jobs queued for the next start (a real `worldserve serve --backend fake` subprocess whose fake
backend loses its peer ranks: tests/peer_loss_serve.py), unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn
from serving_helpers import make_client, serve_app, served_url, wait_until
from test_api_chat_lifecycle import EndlessBackend
from test_api_chat_queue_metrics import gauge

from worldserve import envs
from worldserve.api.app import build_app
from worldserve.cli import build_parser
from worldserve.commands import serve, serve_backend
from worldserve.commands.serve_http import GracefulServer, uvicorn_options
from worldserve.engine.jobs import JobStatus, JobStore

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
MODEL = "test-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 100_000}
SMALL = {"size": "64x48", "num_frames": "5", "fps": "8"}
LAUNCHER = Path(__file__).with_name("peer_loss_serve.py")
WHY = "ValueError: zip() argument 2 is shorter than argument 1"  # (the worker's loop, given no delta)
STOPPED = f"the Reasoner's chat worker stopped: {WHY}"
REFUSED = f"The Reasoner's chat worker has stopped ({WHY}); no chat can run until the server restarts."


class BreakingBackend(EndlessBackend):
    """EndlessBackend whose step hands back no delta once `broken` is set, breaking what the chat worker's loop
    relies on (one delta a session): the loop itself fails (a bug of its own, not a model call's failure)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = threading.Event()

    def step_all(self, sessions):
        deltas = super().step_all(sessions)
        return [] if self.broken.is_set() else deltas


@contextlib.contextmanager
def graceful_server(storage: Path, backend: BreakingBackend, *, keep_alive: bool):
    """`worldserve serve`'s uvicorn server (GracefulServer) over a client with `backend`, on a loopback port in
    a thread; yields (url, server, its thread, the client)."""
    client = make_client(storage, model_name=MODEL, chat_backend=backend, max_num_seqs=1)
    app = build_app(client, shutdown_timeout_s=1.0)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            **uvicorn_options(argparse.Namespace()))  # fmt: skip
    server = GracefulServer(config, client, 1.0, keep_alive_on_engine_death=keep_alive)
    thread = threading.Thread(target=server.run, name="test-engine-death", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive())
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", server, thread, client
    finally:
        server.should_exit = True
        thread.join(15)


def break_a_streamed_chat(http: httpx.Client, backend: BreakingBackend) -> list[str]:
    """Stream a chat, break the worker's loop once its first token came: the events after that one."""
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as answer:
        assert answer.status_code == 200
        lines = (line for line in answer.iter_lines() if line)
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        backend.broken.set()
        return list(lines)


def test_a_stopped_chat_worker_is_unhealthy_and_refuses_chats_uncounted(tmp_path):
    """Before: /health stayed 200 while every chat got 503 "The server is shutting down." (nothing was),
    counted as an abort. Now /health is 503 naming why the worker stopped, the chat running then ends with a
    500 saying so (finished_reason "error"), and the one waiting then and a later one get a 503 naming it,
    counted nowhere (vLLM counts nothing its dead engine refused)."""
    backend = BreakingBackend()
    client = make_client(tmp_path, model_name=MODEL, chat_backend=backend, max_num_seqs=1)
    with (
        serve_app(build_app(client, shutdown_timeout_s=1.0)) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        assert http.get("/health").status_code == 200
        waiting: dict[str, httpx.Response] = {}
        queued = threading.Thread(
            target=lambda: waiting.update(r=http.post("/v1/chat/completions", json=BODY))
        )
        with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as answer:
            lines = (line for line in answer.iter_lines() if line)
            next(line for line in lines if '"content":"' in line and '"content":""' not in line)
            queued.start()  # (max_num_seqs 1: it waits for the running one)
            wait_until(lambda: client.chat_worker.num_waiting == 1)
            backend.broken.set()
            rest = list(lines)
        queued.join(15)
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert rest[-1] == "data: [DONE]" and error["code"] == 500
        assert error["message"] == f"The Reasoner's chat worker stopped ({WHY})."
        assert waiting["r"].status_code == 503 and waiting["r"].json()["error"]["message"] == REFUSED
        health = http.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "unhealthy", "reason": STOPPED}
        later = http.post("/v1/chat/completions", json=BODY)
        assert later.status_code == 503 and later.json()["error"]["message"] == REFUSED
        metrics = http.get("/metrics").text
    labels = {"model_name": MODEL, "engine": "0"}
    assert gauge(metrics, "vllm:request_success_total", {**labels, "finished_reason": "abort"}) == 0
    assert gauge(metrics, "vllm:request_success_total", {**labels, "finished_reason": "error"}) == 1


@pytest.mark.parametrize("keep_alive", [False, True])
def test_a_stopped_chat_worker_stops_the_server_with_status_1_unless_kept_alive(tmp_path, caplog, keep_alive):
    """Engine death ends the server as SIGTERM does (the running chat got its error first) and `worldserve
    serve` exits 1 (vLLM's launcher sets uvicorn's should_exit on it; it exits 0, vllm-project/vllm#48966).
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH keeps it up, answering 503, until stopped (exit 0)."""
    backend = BreakingBackend()
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        with graceful_server(tmp_path, backend, keep_alive=keep_alive) as (url, server, thread, _):
            with httpx.Client(base_url=url, timeout=30) as http:
                rest = break_a_streamed_chat(http, backend)
                if keep_alive:
                    wait_until(lambda: server.death.seen is not None)
                    assert http.get("/health").status_code == 503
                    assert thread.is_alive() and not server.should_exit, "kept alive"
            if not keep_alive:
                thread.join(15)  # (the hang guard: it ends by itself)
                assert not thread.is_alive()
    assert rest[-1] == "data: [DONE]" and '"code": 500' in rest[-2]
    assert server.death.seen == STOPPED
    if keep_alive:
        assert server.exit_status == 0 and server.death.reason is None
        assert "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set: the server stays up" in caplog.text
    else:
        assert server.exit_status == 1 and server.death.reason == STOPPED
        assert f"the engine is dead ({STOPPED}): the server shuts down, as on SIGTERM" in caplog.text


class PeerLosingServer:
    """`worldserve serve --backend fake` (tests/peer_loss_serve.py) as a subprocess; `lose(fault)` makes its
    backend lose its peers ("lost": mid-step, "gone": while it idles)."""

    def __init__(self, tmp_path: Path, *extra: str, keep_alive: str = ""):
        self.faults, self.storage, self.log = tmp_path / "faults", tmp_path / "store", tmp_path / "serve.log"
        self.faults.mkdir()
        cmd = [sys.executable, str(LAUNCHER), "serve", "--backend", "fake", "--host", "127.0.0.1", "--port", "0",
               "--storage-dir", str(self.storage), *extra]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WORLDSERVE_TEST_FAULTS": str(self.faults),
               "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": keep_alive}  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        try:
            self.url = served_url(self.log, self.proc)
        except BaseException:
            self.close()
            raise

    def lose(self, fault: str) -> None:
        (self.faults / fault).touch()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def servers():
    started: list[PeerLosingServer] = []
    yield started
    for server in started:
        server.close()


def test_an_engine_crash_stops_the_server_with_status_1_its_jobs_queued(tmp_path, servers):
    """Before: after the engine loop crashed the process stayed up, answering 503 forever. Now it shuts down as
    on SIGTERM (the waiting sync request answered 503, the running and queued jobs left queued to resume at
    the next start) and exits 1, the reason in its log."""
    server = PeerLosingServer(tmp_path, "--fake-step-delay", "0.05", "--max-batch-size", "1")
    servers.append(server)
    answers: dict[str, httpx.Response] = {}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        running = http.post(
            "/v1/videos", data={"prompt": "long", **SMALL, "num_inference_steps": "200"}
        ).json()
        queued = http.post("/v1/videos", data={"prompt": "next", **SMALL, "num_inference_steps": "2"}).json()
        sync = threading.Thread(target=lambda: answers.update(
            r=http.post("/v1/videos/sync", data={"prompt": "sync", **SMALL, "num_inference_steps": "2"})))  # fmt: skip
        sync.start()
        wait_until(lambda: len(http.get("/v1/videos").json()["data"]) == 3, timeout=20)
        wait_until(lambda: http.get(f"/v1/videos/{running['id']}").json()["progress"] > 0, timeout=20)
        server.lose("lost")
        sync.join(30)
    assert answers["r"].status_code == 503 and "engine has stopped" in answers["r"].json()["error"]["message"]
    assert server.proc.wait(30) == 1
    log = server.log.read_text()
    assert "the engine is dead (engine crashed: the peer ranks are gone (test)): the server shuts down" in log
    store = JobStore(server.storage)
    try:
        jobs = store.list(after=None, limit=None, order="asc")[0]
    finally:
        store.close()
    assert [job.id for job in jobs][:2] == [running["id"], queued["id"]]
    assert {job.status for job in jobs} == {JobStatus.QUEUED}


@pytest.mark.parametrize("keep_alive", ["", "1"])
def test_a_peer_lost_while_idle_stops_the_server_unless_kept_alive(tmp_path, servers, keep_alive):
    """A peer rank gone while the engine idles (nothing crashed yet, /health said so) is found by the watch
    at uvicorn's tick: exit 1. VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps the server up, /health 503 with the
    reason, and a SIGTERM then ends it with 0 (the death is not the cause of that exit)."""
    server = PeerLosingServer(tmp_path, keep_alive=keep_alive)
    servers.append(server)
    server.lose("gone")
    reason = "fake peer (rank 1, pid 0) exited: killed (test)"
    if not keep_alive:
        assert server.proc.wait(30) == 1
        assert f"the engine is dead ({reason}): the server shuts down" in server.log.read_text()
        return
    wait_until(lambda: "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set: the server stays up" in server.log.read_text(),
               timeout=20)  # fmt: skip
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["reason"] == reason
    assert server.proc.poll() is None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0


def test_a_malformed_keep_alive_variable_fails_the_start_before_the_load(tmp_path, caplog, monkeypatch):
    """VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is an integer, as vLLM reads it (its int() failed only once the engine
    had died): anything else stops the start, exit 2, naming it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for raw, kept in (("", False), ("0", False), ("1", True), (" 2 ", True)):
        monkeypatch.setenv("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", raw)
        assert envs.keep_alive_on_engine_death() is kept
    monkeypatch.setenv("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "yes")
    loads: list = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    argv = ["serve", "--backend", "fake", "--port", "0"]
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        assert serve.run(build_parser(argv).parse_args(argv)) == 2
    assert "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH='yes' must be an integer" in caplog.text and not loads
