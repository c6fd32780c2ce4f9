"""A streamed request with more choices (chat `n`, text completions' prompts x n) than the chat worker has free
decode slots, over real HTTP (uvicorn on loopback): the stream answers once its first choice has started and
the admitted choices stream while the others still wait (as vLLM streams each choice as it comes); a later
choice's ChatStarted gives its prompt's counts inside the stream (continuous usage, return_token_ids, the
final usage and its cached tokens as a non-streamed answer counts them); a later choice that fails to start is
the stream's error event, closing the others; the first choice's refusal is still a JSON 4xx before any SSE.
A scripted backend (a token every few ms until the test ends a chat) makes the admission order certain; the
tiny Reasoner checks that a stream's content and usage equal the non-streamed answer's for a seed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from chat_fakes import ScriptedChatBackend, ScriptedChatSession
from serving_helpers import make_client, serve_app, wait_until

from worldserve.engine.outputs import ChatDelta
from worldserve.param_errors import ParamError

MODEL = "test-model"
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 100_000}
USAGE = {"include_usage": True, "continuous_usage_stats": True}
WAIT = httpx.Timeout(10, read=30)
"""A hang guard: without the fix the first byte only comes once the last choice is admitted, which these
tests never allow before they have read the first chunks."""


class QueuedSession(ScriptedChatSession):
    def __init__(self, max_tokens: int, prompt_ids: tuple[int, ...], cached: int):
        self.max_tokens, self.prompt_token_ids, self.cached_tokens = max_tokens, prompt_ids, cached
        self.prompt_tokens = len(prompt_ids) or 4  # (a chat's prompt: 4 tokens)
        self.n, self.closed, self.preempted, self.stop_now = 0, False, False, False

    def close(self) -> None:
        self.closed = True


class QueuedBackend(ScriptedChatBackend):
    """Sessions that emit "x" every few ms until closed, at max_tokens or once told (`stop_now`, or `finish`
    for all: "stop"). Start number k (0-based, in admission order) fails with `failures[k]` when given. A
    prompt's first session finds 1 token cached, its later ones all of it (the Reasoner's prefix cache)."""

    concurrent_with_video = True

    def __init__(self, prompts=None, max_model_len: int | None = None):
        self.prompts, self.max_model_len = prompts, max_model_len
        self.sessions: list[QueuedSession] = []
        self.failures: dict[int, Exception] = {}
        self.starts, self.seen, self.lock, self.finish = 0, set(), threading.Lock(), threading.Event()

    def start_many(self, batch):
        out: list = []
        with self.lock:
            for params in batch:
                number, self.starts = self.starts, self.starts + 1
                if number in self.failures:
                    out.append(self.failures[number])
                    continue
                ids = tuple(params.prompt_ids or ())
                session = QueuedSession(params.max_tokens, ids, 1 if ids not in self.seen else len(ids) or 4)
                self.seen.add(ids)
                self.sessions.append(session)
                out.append(session)
        return out

    def step_all(self, sessions):
        time.sleep(0.01)
        out = []
        for s in sessions:
            s.n += 1
            done = "stop" if self.finish.is_set() or s.stop_now else "length" if s.n == s.max_tokens else None
            out.append(ChatDelta(text="x", finish_reason=done, completion_tokens=s.n))
        return out


def _serve(tmp_path, backend: QueuedBackend, max_num_seqs: int, **app_options):
    from worldserve.api.app import build_app

    client = make_client(tmp_path, model_name=MODEL, chat_backend=backend, max_num_seqs=max_num_seqs)
    return client, serve_app(build_app(client, shutdown_timeout_s=1.0, **app_options), name="test-queued")


class Events:
    """A stream's `data:` payloads read line by line (JSON, or the "[DONE]" marker as is)."""

    def __init__(self, response: httpx.Response):
        self.lines, self.all = response.iter_lines(), []

    def until(self, done) -> None:
        """Read until `done(self)`; an AssertionError if the stream ends first."""
        for line in self.lines:
            if line.startswith("data: "):
                data = line[len("data: ") :]
                self.all.append(data if data == "[DONE]" else json.loads(data))
                if done(self):
                    return
        raise AssertionError(f"the stream ended first: {self.all[-3:]}")

    def to_end(self) -> None:
        self.until(lambda events: events.all[-1] == "[DONE]")

    def of(self, index: int) -> list[dict]:
        """The chunks of choice `index`."""
        return [
            e for e in self.all if e != "[DONE]" and e.get("choices") and e["choices"][0]["index"] == index
        ]


def _text(chunk: dict) -> str:
    """A choice chunk's text: a chat delta's content, or a text completion's text."""
    choice = chunk["choices"][0]
    return (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]


def _joined(events: Events, index: int) -> str:
    return "".join(_text(c) for c in events.of(index))


def _texts_from(*indices: int):
    """Whether every choice of `indices` has sent text."""
    return lambda events: all(any(_text(c) for c in events.of(i)) for i in indices)


def _counts(usage: dict) -> dict:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_a_streamed_chat_starts_before_its_last_choice_is_admitted(tmp_path):
    """2 decode slots, n=3: every choice's role chunk and the first two choices' tokens come while the third
    waits for a slot (it used to send nothing, not even headers, until the third was admitted); once the
    first two end, the third streams too, its continuous usage and the final usage as a non-streamed
    answer's (the prompt once, every choice's tokens)."""
    backend = QueuedBackend()
    client, serving = _serve(tmp_path, backend, max_num_seqs=2)
    with serving as url:
        body = {**BODY, "n": 3, "stream": True, "stream_options": USAGE}
        with httpx.stream("POST", url + CHAT, json=body, timeout=WAIT) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = Events(r)
            events.until(_texts_from(0, 1))
            assert (
                len(backend.sessions) == 2 and client.chat_worker.num_waiting == 1
            )  # the third still queued
            heads = [e["choices"][0] for e in events.all[:3]]
            assert [(c["index"], c["delta"]) for c in heads] == [
                (i, {"role": "assistant", "content": ""}) for i in range(3)
            ]
            backend.finish.set()
            events.to_end()
    assert len(backend.sessions) == 3
    for index, session in enumerate(backend.sessions):
        chunks = events.of(index)
        assert (
            _joined(events, index) == "x" * session.n and chunks[-1]["choices"][0]["finish_reason"] == "stop"
        )
        assert [c["usage"]["completion_tokens"] for c in chunks] == [0, *range(1, session.n + 1), session.n]
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {4}
    usage = events.all[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 4, "completion_tokens": sum(s.n for s in backend.sessions),
        "total_tokens": 4 + sum(s.n for s in backend.sessions),
    }  # fmt: skip


def test_streamed_completions_give_each_prompt_its_counts_as_its_choices_start(reasoner, tmp_path):
    """Prompts [5, 6, 7] and [8, 9], n=2, 3 decode slots: the stream starts with the last choice still queued;
    each choice's chunks carry its own prompt's count (continuous usage) and its first one its prompt's ids;
    the final usage sums both prompts and their first choices' cached tokens (what a non-streamed answer
    counts), the later choices' ChatStarted taken inside the stream."""
    backend = QueuedBackend(reasoner.prompts, max_model_len=4096)
    client, serving = _serve(tmp_path, backend, max_num_seqs=3, prompt_tokens_details=True)
    with serving as url:
        body = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 4000, "stream": True,
                "stream_options": USAGE, "return_token_ids": True}  # fmt: skip
        with httpx.stream("POST", url + TEXT, json=body, timeout=WAIT) as r:
            assert r.status_code == 200, r.read()
            events = Events(r)
            events.until(_texts_from(0, 1, 2))
            assert len(backend.sessions) == 3 and client.chat_worker.num_waiting == 1
            backend.finish.set()
            events.to_end()
    prompts = {0: [5, 6, 7], 1: [5, 6, 7], 2: [8, 9], 3: [8, 9]}
    for index, ids in prompts.items():
        chunks = events.of(index)
        assert _joined(events, index) == "x" * backend.sessions[index].n
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(ids)}
        assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    completion = sum(s.n for s in backend.sessions)
    assert events.all[-2]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion,
        "prompt_tokens_details": {"cached_tokens": 2},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("failure", "status", "param"),
    [
        (RuntimeError("out of memory"), 500, None),
        (ParamError("max_tokens", "too many for now"), 400, "max_tokens"),
    ],
)
def test_a_later_choice_that_fails_to_start_is_the_streams_error_event(tmp_path, failure, status, param):
    """2 slots, n=3: the second choice ends, the third takes its slot and fails to start: the stream (already
    sending the first two) ends with the error event and `[DONE]`, no usage chunk, and the first choice,
    still running, is stopped."""
    backend = QueuedBackend()
    backend.failures[2] = failure
    _, serving = _serve(tmp_path, backend, max_num_seqs=2)
    with serving as url:
        body = {**BODY, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + CHAT, json=body, timeout=WAIT) as r:
            assert r.status_code == 200
            events = Events(r)
            events.until(_texts_from(0, 1))
            backend.sessions[1].stop_now = True
            events.to_end()
        error = events.all[-2]["error"]
        assert error["code"] == status and error["param"] == param and str(failure) in error["message"]
        assert events.of(1)[-1]["choices"][0]["finish_reason"] == "stop"
        assert not any(e != "[DONE]" and "usage" in e and e["usage"] for e in events.all)
        wait_until(lambda: backend.sessions[0].closed, timeout=10)


def test_the_first_choice_s_refusal_is_still_a_json_error_before_any_event(tmp_path):
    backend = QueuedBackend()
    backend.failures[0] = ParamError("max_tokens", "too many for this prompt")
    _, serving = _serve(tmp_path, backend, max_num_seqs=2)
    with serving as url:
        r = httpx.post(url + CHAT, json={**BODY, "n": 3, "stream": True}, timeout=WAIT)
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["param"] == "max_tokens"
        wait_until(lambda: all(s.closed for s in backend.sessions), timeout=10)  # the one started is stopped


@pytest.fixture(scope="module")
def two_slots(reasoner, tmp_path_factory):
    """A uvicorn serving the tiny Reasoner with 2 decode slots (fewer than the requests' choices)."""
    from worldserve.api.app import build_app

    client = make_client(tmp_path_factory.mktemp("two-slots"), model_name=MODEL, chat_backend=reasoner,
                         max_num_seqs=2)  # fmt: skip
    with serve_app(build_app(client, shutdown_timeout_s=1.0), name="test-two-slots") as url:
        yield url


def _stream(url: str, path: str, body: dict) -> Events:
    with httpx.stream(
        "POST", url + path, json={**body, "stream": True, "stream_options": USAGE}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        events = Events(r)
        events.to_end()
    return events


def test_a_streamed_chat_equals_the_non_streamed_answer_with_fewer_slots_than_choices(two_slots):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "n": 3,
            "max_tokens": 12, "temperature": 1.0, "seed": 11}  # fmt: skip
    whole = httpx.post(two_slots + CHAT, json=body, timeout=60).json()
    events = _stream(two_slots, CHAT, body)
    for choice in whole["choices"]:
        index = choice["index"]
        assert _joined(events, index) == choice["message"]["content"]
        assert events.of(index)[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert _counts(events.all[-2]["usage"]) == _counts(whole["usage"])


def test_streamed_completions_equal_the_non_streamed_answer_with_fewer_slots_than_choices(
    two_slots, reasoner
):
    body = {"model": MODEL, "prompt": ["Once upon a time", "The sea"], "n": 2, "max_tokens": 10,
            "temperature": 1.0, "seed": 5}  # fmt: skip
    whole = httpx.post(two_slots + TEXT, json=body, timeout=60).json()
    events = _stream(two_slots, TEXT, body)
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        assert _joined(events, choice["index"]) == choice["text"]
        assert events.of(choice["index"])[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert _counts(events.all[-2]["usage"]) == _counts(whole["usage"])
    # each choice's chunks carry its own prompt's count
    sizes = [len(reasoner.tokenizer(p)["input_ids"]) for p in body["prompt"]]
    assert sizes[0] != sizes[1]
    for index in range(4):
        assert {c["usage"]["prompt_tokens"] for c in events.of(index)} == {sizes[index // 2]}
