"""A chat request's lifecycle over real HTTP (uvicorn on loopback) with a scripted chat backend that decodes a
token every few ms and never ends on its own: a client that disconnects stops its chat (non-streamed too,
and before it was admitted), the `n` choices of a request are admitted in one batch (one prefill, shared
prompt K/V in the Reasoner), and a server shutdown ends running chats with a 503 (the SSE error event and
`[DONE]`, or the JSON envelope) instead of cutting their connections."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
from chat_fakes import ScriptedChatBackend, ScriptedChatSession
from serving_helpers import make_client, serve_app, wait_until

from worldserve.engine.outputs import ChatDelta

MODEL = "test-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 100_000}


class EndlessSession(ScriptedChatSession):
    prompt_tokens = 4

    def __init__(self, max_tokens: int):
        self.max_tokens, self.n, self.closed, self.preempted = max_tokens, 0, False, False

    def close(self) -> None:
        self.closed = True


class EndlessBackend(ScriptedChatBackend):
    """Sessions that emit one token every `delay` seconds until closed, at max_tokens (100k in BODY) or once
    `finish` is set (then "stop"); a session a test marks `preempted` idles (no token), as the Reasoner's does
    while it waits for K/V blocks."""

    concurrent_with_video = True

    def __init__(self, delay: float = 0.005):
        self.delay, self.sessions, self.batches, self.preemptions = delay, [], [], 0
        self.lock, self.finish = threading.Lock(), threading.Event()

    def start_many(self, batch):
        with self.lock:
            self.batches.append(len(batch))
            new = [EndlessSession(params.max_tokens) for params in batch]
            self.sessions += new
        return new

    def step_all(self, sessions):
        time.sleep(self.delay)
        out = []
        for s in sessions:
            if s.preempted:
                out.append(ChatDelta(text="", finish_reason=None, completion_tokens=s.n))
                continue
            s.n += 1
            done = "stop" if self.finish.is_set() else "length" if s.n == s.max_tokens else None
            out.append(ChatDelta(text="x", finish_reason=done, completion_tokens=s.n))
        return out

    def kv_cache_usage(self) -> float:
        return sum(not s.closed for s in self.sessions) / 100


@pytest.fixture
def server(tmp_path):
    from worldserve.api.app import build_app

    backend = EndlessBackend()
    client = make_client(tmp_path, model_name=MODEL, chat_backend=backend, max_num_seqs=1)  # a 2nd chat waits
    app = build_app(client, shutdown_timeout_s=1.0)
    with serve_app(app, name="test-chat-lifecycle") as url:
        yield url, client, backend


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("worldserve:chat_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _aborted(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("worldserve:chat_request_success_total{") and 'finish_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_non_streamed_chat_stops_when_its_client_disconnects(server):
    url, _, backend = server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=BODY, timeout=httpx.Timeout(5, read=0.5))
    wait_until(lambda: backend.sessions and backend.sessions[0].closed, timeout=5)
    wait_until(lambda: _running(url) == 0 and _aborted(url) == 1, timeout=5)
    assert backend.sessions[0].n < 5_000  # stopped, not decoded to max_tokens


def test_a_waiting_chat_whose_client_left_is_never_started(server):
    url, client, backend = server

    def leaves_after_1_5_s():
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=BODY, timeout=httpx.Timeout(5, read=1.5))

    first = threading.Thread(target=leaves_after_1_5_s, daemon=True)
    first.start()
    wait_until(lambda: len(backend.sessions) == 1)
    with pytest.raises(httpx.ReadTimeout):  # queued behind the first (max_num_seqs 1), then gone
        httpx.post(url + "/v1/chat/completions", json=BODY, timeout=httpx.Timeout(5, read=0.3))
    first.join(10)  # the first client leaves too: its chat closes, the slot frees
    wait_until(lambda: backend.sessions[0].closed, timeout=5)
    # a third chat, queued after the abandoned one: the worker admits in order, so once the third has started
    # the abandoned one was taken off the queue before it, and must have been skipped (a sleep before the
    # check let a slow worker pass a chat that was never skipped)
    third = httpx.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 3}, timeout=10)
    assert third.status_code == 200 and third.json()["usage"]["completion_tokens"] == 3
    assert [s.max_tokens for s in backend.sessions] == [BODY["max_tokens"], 3]
    assert client.chat_worker.num_waiting == 0


def test_the_n_choices_of_a_request_are_admitted_in_one_batch(server):
    url, client, backend = server
    client.chat_worker.max_num_seqs = 4
    body = {**BODY, "n": 3, "max_tokens": 5}
    out = httpx.post(url + "/v1/chat/completions", json=body, timeout=10).json()
    assert [c["finish_reason"] for c in out["choices"]] == ["length"] * 3
    assert backend.batches == [3]
    assert out["usage"]["completion_tokens"] == 15


def test_a_chat_still_waiting_at_shutdown_gets_its_503_at_once(server):
    """max_num_seqs 1: the second chat waits; at the shutdown it gets its 503 at once (it can never start),
    not when the running chat ends at the timeout; the running one gets its 503 after the timeout."""
    url, client, backend = server
    answers: dict[str, tuple[float, httpx.Response, int]] = {}

    def chat(name: str) -> None:
        r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=20)
        answers[name] = (time.monotonic(), r, backend.sessions[0].n)  # (the running chat's tokens by then)

    running = threading.Thread(target=chat, args=("running",), daemon=True)
    running.start()
    wait_until(lambda: len(backend.sessions) == 1)
    waiting = threading.Thread(target=chat, args=("waiting",), daemon=True)
    waiting.start()
    wait_until(lambda: client.chat_worker.num_waiting == 1)
    t0 = time.monotonic()
    client.begin_shutdown(2.0)
    for t in (running, waiting):
        t.join(10)  # (a hang guard, not a speed bound)
    # at once: the running chat (which only the 2 s timeout ends) still made tokens after the waiting one's 503
    assert backend.sessions[0].n > answers["waiting"][2]
    assert answers["waiting"][1].status_code == 503
    assert "shutting down" in answers["waiting"][1].json()["error"]["message"]
    # the running one only after the timeout: a lower bound (timers do not fire early, so it cannot flake)
    assert answers["running"][1].status_code == 503 and answers["running"][0] - t0 > 1.9
    assert len(backend.sessions) == 1  # the waiting chat never started


def test_shutdown_ends_running_chats_with_a_503(server):
    url, client, backend = server
    client.chat_worker.max_num_seqs = 4
    events: list[str] = []

    def stream():
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=20
        ) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    answers: list[httpx.Response] = []
    threads = [
        threading.Thread(target=stream, daemon=True),
        threading.Thread(
            target=lambda: answers.append(httpx.post(url + "/v1/chat/completions", json=BODY, timeout=20)),
            daemon=True,
        ),
    ]
    for t in threads:
        t.start()
    wait_until(lambda: len(backend.sessions) == 2)
    client.begin_shutdown(0.3)  # what `worldserve serve` does on SIGTERM
    for t in threads:
        t.join(10)  # (the chats never end on their own: only the shutdown ends them; a hang guard)
    assert not any(t.is_alive() for t in threads)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])
    assert error["error"]["code"] == 503 and "shutting down" in error["error"]["message"]
    (answer,) = answers
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
    assert all(s.closed for s in backend.sessions)


def test_chats_get_their_shutdown_503_at_the_timeout_even_inside_a_long_video_step(tmp_path):
    """The chat worker's shutdown deadline does not wait for the engine: a video step (or decode) that
    outlasts the timeout must not hold the chats' 503 back until the HTTP server closes the connections (the
    video step here is held until the chat's answer has come)."""
    from worldserve.api.app import build_app
    from worldserve.engine.fake_backend import FakeBackend

    backend, video_step = EndlessBackend(), threading.Event()
    client = make_client(
        tmp_path, backend=FakeBackend(step_gate=video_step), model_name=MODEL, chat_backend=backend
    )
    app = build_app(client, shutdown_timeout_s=1.0)
    with serve_app(app, name="test-chat-shutdown-long-step") as url:
        try:
            form = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "3"}
            assert httpx.post(url + "/v1/videos", data=form, timeout=10).status_code == 200
            wait_until(lambda: client.engine.num_running == 1)
            answers: list[httpx.Response] = []
            chat = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(url + "/v1/chat/completions", json=BODY, timeout=20)
                ),
                daemon=True,
            )
            chat.start()
            wait_until(lambda: len(backend.sessions) == 1)
            client.begin_shutdown(0.3)
            chat.join(10)  # (a hang guard, not a speed bound)
            # answered while the video step was still held (it cannot have ended), not after it
            assert not chat.is_alive() and client.engine.backend.steps_done == 0
            assert answers[0].status_code == 503
        finally:
            video_step.set()


def test_a_chunk_that_fails_to_render_ends_the_stream_with_the_error_event(caplog):
    """A bug while rendering a chunk (here a chunk that cannot be serialized) still ends the SSE stream the
    way a failed chat does: the error event (500) and `[DONE]`, the chats closed, the traceback logged."""
    import asyncio

    from worldserve.api.chat_stream import sse_events

    closed = []

    async def events():
        try:
            yield ChatDelta(text="a", finish_reason=None, completion_tokens=1)
            yield ChatDelta(text="\ud800", finish_reason=None, completion_tokens=2)
            await asyncio.sleep(10)
        finally:
            closed.append(True)

    def render(index, delta):
        yield (
            "data: " + json.dumps({"text": delta.text}, ensure_ascii=False).encode("utf-8").decode() + "\n\n"
        )

    async def collect():
        return [e async for e in sse_events([events()], render, tail=lambda: ())]

    out = asyncio.run(collect())
    assert out[0] == 'data: {"text": "a"}\n\n' and len(out) == 2
    error, done = out[1].split("\n\n")[:2]
    assert json.loads(error[6:])["error"]["code"] == 500 and done == "data: [DONE]"
    assert closed == [True] and "failed while rendering" in caplog.text
