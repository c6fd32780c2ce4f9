"""An interpreter exiting with an open worldserve.Engine still running requests, in a fresh interpreter on the
tiny checkpoint: a daemon thread's request, stopped at once in its MP4 encode, ends without a word (rc 0, no
traceback: its call ends with a silent SystemExit); the requests of non-daemon threads, which Python waits for
before the Engine's stop, are made in full, also those started after the main script ended (the pools they need
serve through the exit: lasting_pool.py); a thread that waits for the main thread to end does not hang it.
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
            fn()

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


def test_work_a_non_daemon_thread_starts_after_the_main_script_ended_is_made(tiny_ckpt, tmp_path):
    """Python waits for non-daemon threads before the Engine's stop, and the pools a request needs serve
    through the exit (lasting_pool.py): a thread's first call after the main script ended, a new Engine built
    then, and a user's ThreadPoolExecutor's queued jobs are all made (concurrent.futures' pools refused them:
    "cannot schedule new futures after interpreter shutdown")."""
    run = _run_script(tiny_ckpt, tmp_path, """
        from concurrent.futures import ThreadPoolExecutor

        def late():
            print("late", engine.generate_video("a fox", **FIELDS).video[4:8], flush=True)
            other = Engine(engine.config.model.model, **OPTIONS)
            print("new engine", other.generate_video("a cat", **FIELDS).video[4:8], flush=True)

        after_the_main_script(late)
        jobs = ThreadPoolExecutor(1)
        for i in range(3):
            jobs.submit(lambda i=i: print("job", i, engine.generate_video("an owl", **FIELDS).video[4:8], flush=True))
        print("leaving", flush=True)
    """)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = run.stdout.split("\n")
    assert out[0] == "leaving", out
    made = sorted(line for line in out[1:] if line)
    assert made == [
        "job 0 b'ftyp'",
        "job 1 b'ftyp'",
        "job 2 b'ftyp'",
        "late b'ftyp'",
        "new engine b'ftyp'",
    ], out
    assert "Traceback" not in run.stderr, run.stderr
