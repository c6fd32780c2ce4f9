"""`python -m worldserve.cli serve --backend fake` as a subprocess: kill -9 mid-job, restart on the same
storage folder (completed jobs still downloadable, interrupted and queued ones re-run to completion), then
SIGTERM with a short --shutdown-timeout (clean exit, the running job parked as queued)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serving_helpers import png_bytes, served_url, wait_until

from worldserve.engine.jobs import JobStatus, JobStore

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
SMALL = {"size": "64x48", "num_frames": "5", "fps": "8"}
CLEAN_EXIT = (0,)  # (uvicorn raises a SIGTERM again after its graceful shutdown: the serve command takes it)


class ServerProcess:
    def __init__(self, storage: Path, log: Path, *extra: str):
        self.log = log
        cmd = [sys.executable, "-m", "worldserve.cli", "serve", "--backend", "fake", "--host", "127.0.0.1",
               "--port", "0", "--storage-dir", str(storage), *extra]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.url = served_url(log, self.proc)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def test_kill9_restart_then_sigterm(tmp_path):
    storage = tmp_path / "store"
    first = ServerProcess(storage, tmp_path / "first.log", "--fake-step-delay", "0.05")
    log = (tmp_path / "first.log").read_text()
    assert "Route: /v1/videos/sync, Methods: POST" in log and "Application startup complete." in log
    with httpx.Client(base_url=first.url, timeout=10) as http:
        done = http.post("/v1/videos", data={"prompt": "quick", **SMALL, "num_inference_steps": "2"}).json()
        wait_until(lambda: http.get(f"/v1/videos/{done['id']}").json()["status"] == "completed", timeout=20)
        video = http.get(f"/v1/videos/{done['id']}/content").content
        running = http.post(
            "/v1/videos", data={"prompt": "long", **SMALL, "num_inference_steps": "200"}
        ).json()
        queued = http.post("/v1/videos", data={"prompt": "i2v", **SMALL, "num_inference_steps": "3"},
                           files={"input_reference": ("ref.png", png_bytes(), "image/png")}).json()  # fmt: skip
        wait_until(lambda: http.get(f"/v1/videos/{running['id']}").json()["progress"] > 0, timeout=20)
    first.kill()

    second = ServerProcess(storage, tmp_path / "second.log", "--shutdown-timeout", "0.3")
    with httpx.Client(base_url=second.url, timeout=10) as http:
        assert http.get(f"/v1/videos/{done['id']}").json()["status"] == "completed"
        assert http.get(f"/v1/videos/{done['id']}/content").content == video
        for job in (running, queued):
            wait_until(
                lambda j=job: http.get(f"/v1/videos/{j['id']}").json()["status"] == "completed", timeout=30
            )
            assert http.get(f"/v1/videos/{job['id']}/content").status_code == 200
        ids = [j["id"] for j in http.get("/v1/videos", params={"order": "asc"}).json()["data"]]
        assert ids == [done["id"], running["id"], queued["id"]]
    assert "resuming 2 unfinished job(s)" in (tmp_path / "second.log").read_text()
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(20) in CLEAN_EXIT

    third = ServerProcess(
        storage, tmp_path / "third.log", "--fake-step-delay", "0.05", "--shutdown-timeout", "0.3"
    )
    with httpx.Client(base_url=third.url, timeout=10) as http:
        parked = http.post(
            "/v1/videos", data={"prompt": "parked", **SMALL, "num_inference_steps": "200"}
        ).json()
        wait_until(lambda: http.get(f"/v1/videos/{parked['id']}").json()["progress"] > 0, timeout=20)
    third.proc.send_signal(signal.SIGTERM)
    assert third.proc.wait(20) in CLEAN_EXIT  # (the wait is the hang guard)
    log = (tmp_path / "third.log").read_text()
    # stopped at the 0.3 s timeout with its job running (queued again below), not after its ~10 s of steps
    assert "shutdown requested" in log and "queued again" in log
    assert "worldserve serve stopped" in log  # its cleanup ran (the peer ranks of a parallel backend stop)
    store = JobStore(storage)
    assert store.get(parked["id"]).status is JobStatus.QUEUED and store.get(parked["id"]).progress == 0
    store.close()

    fourth = ServerProcess(
        storage, tmp_path / "fourth.log", "--fake-step-delay", "0.05", "--shutdown-timeout", "60"
    )
    with httpx.Client(base_url=fourth.url, timeout=10) as http:
        wait_until(lambda: http.get(f"/v1/videos/{parked['id']}").json()["progress"] > 0, timeout=20)
    # Ctrl-C twice: the second ends the 60 s grace at once, the job still running (queued again, not done)
    fourth.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    fourth.proc.send_signal(signal.SIGINT)
    code = fourth.proc.wait(30)  # (the hang guard)
    log = (tmp_path / "fourth.log").read_text()
    assert "second interrupt: stopping now" in log, (code, log[-2000:])
    assert "queued again" in log
    assert log.count("Waiting for application shutdown") == 1, log[-3000:]  # (uvicorn's, ended once)
    store = JobStore(storage)
    assert store.get(parked["id"]).status is JobStatus.QUEUED
    store.close()

    fifth = ServerProcess(
        storage, tmp_path / "fifth.log", "--fake-step-delay", "0.05", "--shutdown-timeout", "60"
    )
    with httpx.Client(base_url=fifth.url, timeout=10) as http:
        wait_until(lambda: http.get(f"/v1/videos/{parked['id']}").json()["progress"] > 0, timeout=20)
    fifth.proc.send_signal(
        signal.SIGINT
    )  # twice at once (`timeout -s INT` signals the child, then its group):
    time.sleep(0.02)  # the second lands before uvicorn's loop sees the first, so it skips the app's lifespan
    fifth.proc.send_signal(signal.SIGINT)
    code = fifth.proc.wait(30)
    log = (tmp_path / "fifth.log").read_text()
    assert "second interrupt: stopping now" in log and "Traceback" not in log, (code, log[-3000:])
    assert "worldserve serve stopped" in log


def test_a_listing_paged_across_a_kill9_goes_on_after_a_deleted_cursor(tmp_path):
    """GET /v1/videos?after=<id>: the cursor job deleted between two pages and the server killed (-9) and
    started again: the next page goes on after it (its anchor was committed with the row's deletion), not an
    empty page with has_more false."""
    storage = tmp_path / "store"
    first = ServerProcess(storage, tmp_path / "first.log")
    with httpx.Client(base_url=first.url, timeout=10) as http:
        form = {"prompt": "x", **SMALL, "num_inference_steps": "2"}
        ids = [http.post("/v1/videos", data=form).json()["id"] for _ in range(4)]
        page = http.get("/v1/videos", params={"order": "asc", "limit": 2}).json()
        assert [j["id"] for j in page["data"]] == ids[:2] and page["has_more"]
        assert http.delete(f"/v1/videos/{page['last_id']}").status_code == 200
    first.kill()
    second = ServerProcess(storage, tmp_path / "second.log", "--shutdown-timeout", "0.3")
    with httpx.Client(base_url=second.url, timeout=10) as http:
        page = http.get("/v1/videos", params={"order": "asc", "limit": 2, "after": ids[1]}).json()
        assert [j["id"] for j in page["data"]] == ids[2:] and not page["has_more"], page
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(20) in CLEAN_EXIT
