"""An interpreter exiting with an open worldserve.Engine still running requests, in a fresh interpreter on the
tiny checkpoint: a daemon thread's request, stopped at once in its MP4 encode, ends without a word (rc 0, no
traceback: the stop runs before concurrent.futures shuts its pools, and the daemon's call ends with a silent
SystemExit); a non-daemon thread's request in flight, which the exit waits for, is made in full; a thread
that waits for the main thread to end does not hang the exit (the exit joins no thread); a non-daemon thread's
call made after the exit began is refused aloud, never dropped without a word.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PRELUDE = """
    import threading
    import worldserve.media.video as video
    from worldserve import Engine

    # set when the first frame is converted for the MP4: the request is in its decode and encode
    converting = threading.Event()
    convert = video._to_yuv420p

    def watched(*args):
        converting.set()
        return convert(*args)

    video._to_yuv420p = watched
    OPTIONS = dict(device="cpu", dtype="float32", max_model_len=1024, warmup_shapes="none")
    engine = Engine({ckpt!r}, **OPTIONS)
    FIELDS = dict(width=64, height=64, num_frames=33, num_inference_steps=2, fps=8)

    # fn run on a non-daemon thread once the main script has ended (the interpreter's exit begun)
    def after_the_main_script(fn):
        started = threading.Event()

        def run():
            started.set()
            while threading.main_thread().is_alive():
                threading.Event().wait(0.05)
            try:
                fn()
            except RuntimeError as exc:
                print("refused:", exc, flush=True)

        threading.Thread(target=run).start()
        started.wait()
"""


def _run_script(tiny_ckpt, tmp_path, body: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(PRELUDE).format(ckpt=str(tiny_ckpt)) + textwrap.dedent(body)
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )


def test_exit_with_a_daemon_threads_video_encoding_is_quiet(tiny_ckpt, tmp_path):
    """The main script ends while a daemon thread's generate_video is encoding its frames: rc 0, no traceback
    (it was "cannot schedule new futures after interpreter shutdown" twice: the log's and the thread's), and
    no storage folder left."""
    run = _run_script(tiny_ckpt, tmp_path, """
        def make():
            engine.generate_video("a fox", **FIELDS)
            print("not stopped")

        threading.Thread(target=make, daemon=True).start()
        converting.wait()
        print("leaving")
    """)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "Exception in thread" not in run.stderr, run.stderr
    assert run.stdout.split("\n")[0] == "leaving"
    assert not list(tmp_path.glob("worldserve-offline-*"))


def test_exit_waits_for_a_non_daemon_threads_video(tiny_ckpt, tmp_path):
    """The main script ends while a non-daemon thread's generate_video runs: the interpreter waits for that
    thread, and its MP4 is made (its encode had been refused by the pools shut at exit)."""
    run = _run_script(tiny_ckpt, tmp_path, """
        def make():
            print("made", engine.generate_video("a fox", **FIELDS).video[4:8])

        threading.Thread(target=make).start()
        converting.wait()
        print("leaving")
    """)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stdout.split("\n")[:2] == ["leaving", "made b'ftyp'"], run.stdout


def test_a_thread_waiting_for_the_main_thread_to_end_does_not_hang_the_exit(tiny_ckpt, tmp_path):
    """A worker that serves a queue while the main thread lives (it called the Engine before): the exit waits
    for calls in flight only, so the worker sees the main thread end and stops (joining it hung forever)."""
    run = _run_script(tiny_ckpt, tmp_path, """
        import queue

        jobs = queue.Queue()

        def worker():
            while threading.main_thread().is_alive():
                try:
                    prompt = jobs.get(timeout=0.2)
                except queue.Empty:
                    continue
                print("made", engine.generate_video(prompt, **FIELDS).video[4:8], flush=True)
            print("worker done", flush=True)

        threading.Thread(target=worker).start()
        jobs.put("a fox")
        converting.wait()
        print("leaving", flush=True)
    """)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == ["leaving", "made b'ftyp'", "worker done"], run.stdout


def test_a_non_daemon_threads_call_after_the_exit_began_is_refused_aloud(tiny_ckpt, tmp_path):
    """A non-daemon thread that calls only once the main script has ended: a RuntimeError saying the
    interpreter is exiting, and a warning line (a thread pool's work item would keep it in an unread future)."""
    run = _run_script(tiny_ckpt, tmp_path, """
        after_the_main_script(lambda: engine.generate_video("a fox", **FIELDS))
        print("leaving", flush=True)
    """)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["leaving", "refused: the interpreter is exiting: the Engine left "
                                           "open was stopped without waiting for this call"], run.stdout  # fmt: skip
    assert "the interpreter is exiting" in run.stderr
    assert "During handling of the above exception" not in run.stderr, run.stderr


def test_an_engine_built_after_the_exit_began_is_refused_before_its_load(tiny_ckpt, tmp_path):
    """A non-daemon thread that builds an Engine once the main script has ended: a RuntimeError saying so at
    once (it was built, then failed in its first request with "cannot schedule new futures")."""
    run = _run_script(tiny_ckpt, tmp_path, """
        after_the_main_script(lambda: Engine(engine.config.model.model, **OPTIONS))
        print("leaving", flush=True)
    """)  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split("\n")
    assert lines[0] == "leaving" and lines[1].startswith("refused: the interpreter is exiting: no Engine"), (
        lines
    )
    assert "Traceback" not in run.stderr, run.stderr
