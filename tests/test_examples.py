"""examples/ run as a user runs them (design.md §3.2: standalone, run in CI): each script a subprocess with its
own defaults on the tiny random checkpoint, the client scripts against one real `worldserve serve` subprocess
started for this module. Their MP4s are decoded back with PyAV (H.264 + AAC 48 kHz stereo, every frame) and
their chat answers must be non-empty.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from media_probe import probe_mp4
from serving_helpers import served_url

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
COVERED = {"offline_video.py", "offline_chat.py", "openai_video_client.py", "openai_chat_client.py",
           "realtime_video.py"}  # fmt: skip
# the examples' defaults: 320x192, 17 frames (README: the size to keep tiny-checkpoint requests to on a CPU)
DEFAULT_VIDEO = ("h264", 320, 192, 17, "aac", 48000, 2)


def run_example(name: str, *args: object, cwd: Path) -> subprocess.CompletedProcess:
    """`python examples/NAME ARGS...` in `cwd`; its output in the assertion when it fails."""
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert done.returncode == 0, f"{name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def video_of(path: Path) -> tuple:
    p = probe_mp4(path.read_bytes())
    return (p.video_codec, p.width, p.height, p.num_frames, p.audio_codec, p.sample_rate, p.channels)


def answers(stdout: str) -> list[str]:
    """The text after each `A: ` the chat examples print, up to the next question or token count line."""
    return [a.strip() for a in re.findall(r"^A: (.*?)(?=^Q: |^\(|\Z)", stdout, re.S | re.M)]


@pytest.fixture(scope="module")
def server_url(tiny_ckpt, tmp_path_factory):
    """One `worldserve serve` on the tiny checkpoint (CPU), on a port it picks, for the client examples."""
    tmp = tmp_path_factory.mktemp("examples_server")
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "worldserve.cli", "serve", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
           "--device", "cpu", "--storage-dir", tmp / "storage", "--max-model-len", "2048"]  # fmt: skip
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(list(map(str, cmd)), stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        yield served_url(log, proc, timeout=180)
    finally:
        proc.terminate()
        proc.wait(30)


def test_every_example_has_a_test():
    assert {p.name for p in EXAMPLES.glob("*.py")} == COVERED


def test_offline_video_writes_t2v_i2v_and_the_takes_mp4s(tiny_ckpt, tmp_path):
    run_example("offline_video.py", "--model", tiny_ckpt, "--output-dir", tmp_path / "out", cwd=tmp_path)
    assert video_of(tmp_path / "out" / "t2v.mp4") == DEFAULT_VIDEO
    assert video_of(tmp_path / "out" / "i2v.mp4") == DEFAULT_VIDEO
    assert video_of(tmp_path / "out" / "take1.mp4") == DEFAULT_VIDEO  # (the list's takes)


def test_offline_chat_answers_text_and_an_image(tiny_ckpt, tmp_path):
    done = run_example("offline_chat.py", "--model", tiny_ckpt, cwd=tmp_path)
    texts = answers(done.stdout)
    assert len(texts) == 2 and all(texts), done.stdout
    assert "16 completion tokens" in done.stdout


def test_openai_video_client_async_jobs_and_sync_route(server_url, tmp_path):
    done = run_example(
        "openai_video_client.py", "--base-url", server_url, "--output-dir", tmp_path, cwd=tmp_path
    )
    assert "completed 100%" in done.stdout
    for name in ("t2v.mp4", "i2v.mp4", "sync.mp4"):
        assert video_of(tmp_path / name) == DEFAULT_VIDEO, name
    # the SDK's deprecation of OpenAI's hosted Sora is filtered in the example: nothing else is warned
    assert "Warning" not in done.stderr, done.stderr


def test_openai_chat_client_streams_an_answer_about_an_image(server_url, tmp_path):
    done = run_example("openai_chat_client.py", "--base-url", server_url, cwd=tmp_path)
    texts = answers(done.stdout)
    assert len(texts) == 1 and texts[0], done.stdout
    assert "16 completion tokens" in done.stderr, done.stderr


def test_realtime_video_says_a_refused_key_in_one_line(tmp_path):
    """A keyed server's 401 to the WebSocket upgrade: one line naming --api-key (it was a traceback)."""
    from serving_helpers import uvicorn_thread

    with uvicorn_thread(tmp_path, api_key="k") as (url, _):
        done = subprocess.run([sys.executable, str(EXAMPLES / "realtime_video.py"), "--base-url", url],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"})  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.strip() == "the server refused the WebSocket with HTTP 401: pass --api-key (or set "
        "$OPENAI_API_KEY)"
    ), done.stderr


def test_realtime_video_writes_the_streamed_fragmented_mp4(server_url, tmp_path):
    done = run_example("realtime_video.py", "--base-url", server_url, "--output", "rt.mp4", cwd=tmp_path)
    parts = re.search(r"done: (\d+) parts", done.stdout)
    assert parts and int(parts[1]) >= 2, done.stdout
    assert video_of(tmp_path / "rt.mp4") == DEFAULT_VIDEO
