"""Outputs written whole or not at all: `generate`'s -o (MP4, PNG, npz) and --save-latents, the embedded tiny
checkpoint in the cache and `make-tiny`, on a disk that fills up midway or a run interrupted midway.

A full disk is simulated without root (no tmpfs to mount): `_FillingDisk` has every binary file opened for
writing under one folder take a few bytes more, then raise OSError(ENOSPC) as a full file system does (or
KeyboardInterrupt, as Ctrl-C midway), whichever writer opens it (Path.write_bytes, open, os.fdopen); the
checkpoint's weights, written by safetensors' Rust code, fail as safetensors reports a full disk
(SafetensorError, not an OSError).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli
from media_probe import probe_mp4

SMALL = ["--size", "80x48", "--num-frames", "9", "--steps", "2", "--negative-prompt", ""]
FULL_DISK = "No space left on device"


class _FillingDisk:
    """Binary files opened for writing under `folder` accept `free` more bytes in all, then raise `failure`."""

    def __init__(self, folder: Path, free: int, failure: type[BaseException] = OSError) -> None:
        self.folder, self.free, self.failure = os.path.realpath(folder), free, failure
        self.opened: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_open = io.open

        def open_on_disk(file, mode="r", *args, **kwargs):
            where = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else os.fspath(file)
            writes = "b" in mode and any(m in mode for m in "wax+")
            if not writes or not os.path.realpath(where).startswith(self.folder + os.sep):
                return real_open(file, mode, *args, **kwargs)
            self.opened.append(where)
            closefd = kwargs.get("closefd", True)
            return _FillingFile(io.FileIO(file, mode.replace("b", ""), closefd=closefd), self)

        monkeypatch.setattr(io, "open", open_on_disk)
        monkeypatch.setattr(builtins, "open", open_on_disk)

    def fail(self) -> BaseException:
        if self.failure is OSError:
            return OSError(errno.ENOSPC, FULL_DISK)
        return self.failure()


class _FillingFile(io.BufferedWriter):
    """A file on a `_FillingDisk`: what fits is written (and reaches the file), then the disk's failure."""

    def __init__(self, raw: io.FileIO, disk: _FillingDisk) -> None:
        super().__init__(raw)
        self.disk = disk

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) <= self.disk.free:
            self.disk.free -= len(data)
            return super().write(data)
        super().write(data[: self.disk.free])
        super().flush()
        self.disk.free = 0
        raise self.disk.fail()


def _older_files(*paths: Path) -> dict[Path, bytes]:
    """An older good file at each path (what a failed write must leave as it was)."""
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"an older good file " + path.name.encode())
    return {path: path.read_bytes() for path in paths}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in ("keep.mp4", "lat.safetensors"))


@pytest.mark.parametrize("failing", ["-o", "--save-latents"])
def test_a_full_disk_keeps_the_older_file_and_leaves_no_partial_one(
    tiny_ckpt, tmp_path, monkeypatch, failing
):
    """`generate -o keep.mp4` on a disk filling up midway: one line, rc 1, and keep.mp4 still the older good
    file (it had been truncated to what fitted: unplayable); no temporary file left. The same for
    --save-latents (it had left a 0-byte file)."""
    out, latents = tmp_path / "s5" / "keep.mp4", tmp_path / "s5" / "lat.safetensors"
    older = _older_files(out, latents)
    disk = _FillingDisk(tmp_path / "s5", free=300)
    disk.install(monkeypatch)
    argv = [tiny_ckpt, "--prompt", "x", *SMALL, "-o", out]
    r = run_cli("generate", *argv, *(["--save-latents", latents] if failing == "--save-latents" else []))
    flag, path = (failing, out if failing == "-o" else latents)
    reason = FULL_DISK if failing == "-o" else f"[Errno {errno.ENOSPC}] {FULL_DISK}"
    assert (r.returncode, r.stderr.splitlines()[-1]) == (
        1,
        f"worldserve generate: error: {flag} {path}: cannot write it ({reason})",
    ), r.stderr
    assert disk.opened and disk.free == 0, "the write reached the full disk"
    assert {p: p.read_bytes() for p in older} == older
    assert _leftovers(tmp_path / "s5") == []


def test_outputs_still_replace_the_older_file_whole(tiny_ckpt, tmp_path):
    """With room on the disk the new MP4 and latents replace the older files, each keeping its mode (a new
    file gets the umask's)."""
    from safetensors.torch import load_file

    out, latents, new = tmp_path / "keep.mp4", tmp_path / "lat.safetensors", tmp_path / "new.mp4"
    _older_files(out, latents)
    os.chmod(out, 0o640)
    os.chmod(latents, 0o604)
    r = run_cli("generate", tiny_ckpt, "--prompt", "x", *SMALL, "-o", out, "--save-latents", latents)
    assert r.returncode == 0, r.stderr
    assert probe_mp4(out.read_bytes()).num_frames == 9
    assert tuple(load_file(latents)["video_latents"].shape) == (48, 3, 3, 5)
    assert (out.stat().st_mode & 0o777, latents.stat().st_mode & 0o777) == (0o640, 0o604)
    assert run_cli("generate", tiny_ckpt, "--prompt", "x", *SMALL, "-o", new).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert new.stat().st_mode & 0o777 == 0o666 & ~umask
    assert _leftovers(tmp_path) == ["new.mp4"]


def _result(num_frames: int):
    from worldserve.engine.outputs import VideoResult

    frames = np.random.default_rng(0).integers(0, 256, (num_frames, 32, 48, 3), dtype=np.uint8)
    audio = np.zeros((2, 48000 * num_frames // 24), dtype=np.float32)
    return VideoResult(frames=frames, fps=24.0, audio=audio)


@pytest.mark.parametrize("name", ["a.mp4", "a.png", "a.npz"])
@pytest.mark.parametrize("failure", [OSError, KeyboardInterrupt])
def test_a_write_failing_midway_leaves_the_path_as_it_was(tmp_path, monkeypatch, name, failure):
    """Every -o format, a full disk or Ctrl-C midway: the exception goes on (main makes it one line), the
    older file is intact and nothing else is left (a .png had been left partial, an .npz as a.npz.tmp)."""
    from worldserve.commands.generate import write_output

    path = tmp_path / name
    older = _older_files(path)
    disk = _FillingDisk(tmp_path, free=100, failure=failure)
    disk.install(monkeypatch)
    with pytest.raises(failure):
        write_output(path, _result(1 if name.endswith(".png") else 5))
    monkeypatch.undo()
    assert disk.opened and path.read_bytes() == older[path]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize("name", ["new.mp4", "new.png", "new.npz"])
def test_a_failed_write_of_a_new_output_leaves_no_file(tmp_path, monkeypatch, name):
    from worldserve.commands.generate import write_output

    _FillingDisk(tmp_path, free=100).install(monkeypatch)
    with pytest.raises(OSError, match=FULL_DISK):
        write_output(tmp_path / name, _result(1 if name.endswith(".png") else 5))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["a.mp4", "a.png", "a.npz"])
def test_write_output_through_a_symlink_replaces_its_target(tmp_path, name):
    """-o naming a symlink: the file it points to gets the output; the link stays a link."""
    from worldserve.commands.generate import write_output

    real, link = tmp_path / "real" / name, tmp_path / name
    _older_files(real)
    link.symlink_to(real)
    write_output(link, _result(1 if name.endswith(".png") else 5))
    assert link.is_symlink() and real.read_bytes() != b"an older good file " + name.encode()
    assert sorted(p.name for p in real.parent.iterdir()) == [name]


def _safetensors_disk_fills(monkeypatch, failure: type[BaseException]) -> list[str]:
    """safetensors' save_file (diffusers' save_pretrained writes through it) writes some bytes, then fails as
    it does on a full disk (a SafetensorError wrapping the OS error) or is interrupted (Ctrl-C)."""
    import safetensors.torch
    from safetensors import SafetensorError

    written: list[str] = []

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)
        written.append(str(filename))
        if failure is SafetensorError:
            raise SafetensorError(
                f"Error while serializing: I/O error: {FULL_DISK} (os error {errno.ENOSPC})"
            )
        raise failure()

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return written


@pytest.mark.parametrize("failure", ["full disk", KeyboardInterrupt])
def test_the_embedded_checkpoint_on_a_full_disk_is_one_line_and_leaves_no_folder(
    tmp_path, monkeypatch, failure
):
    """`worldserve info` without MODEL writes the embedded tiny checkpoint into the cache: a full disk there
    was safetensors' traceback (a SafetensorError, which the OSError handler missed) and left
    tiny-cosmos3-...tmp<pid>/ behind, as every Ctrl-C did; now one line naming the cache folder (rc 1), or
    main's "interrupted" (rc 130), and no folder left."""
    from safetensors import SafetensorError

    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    written = _safetensors_disk_fills(monkeypatch, SafetensorError if failure == "full disk" else failure)
    r = run_cli("info")
    assert written and "Traceback" not in r.stderr, r.stderr
    if failure == "full disk":
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith(
            f"worldserve info: error: the cache folder {cache / 'worldserve'} (XDG_CACHE_HOME={cache}) cannot "
            f"hold the embedded tiny checkpoint: {FULL_DISK}; set XDG_CACHE_HOME"
        ), r.stderr
    else:
        assert (r.returncode, r.stderr) == (130, "worldserve info: interrupted\n")
    assert list((cache / "worldserve").iterdir()) == []


def test_make_tiny_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    """make-tiny on a full disk: one line naming DIR and the reason, rc 1 (was safetensors' traceback); its
    partial folder removed."""
    from safetensors import SafetensorError

    _safetensors_disk_fills(monkeypatch, SafetensorError)
    target = tmp_path / "new" / "ckpt"
    r = run_cli("make-tiny", target)
    assert (r.returncode, r.stderr) == (
        1,
        f"worldserve make-tiny: error: cannot write {target}: {FULL_DISK}\n",
    )
    assert list((tmp_path / "new").iterdir()) == []


def test_write_failure_reason_reads_the_os_error_inside_a_safetensors_error():
    from safetensors import SafetensorError

    from worldserve.weights.checkpoint import write_failure_reason

    assert write_failure_reason(OSError(errno.ENOSPC, FULL_DISK)) == FULL_DISK
    debug = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })'
    assert write_failure_reason(SafetensorError(debug)) == os.strerror(errno.ENOSPC)
    assert write_failure_reason(SafetensorError("header too large")) == "header too large"


def test_make_tiny_force_over_a_checkpoint_that_fails_leaves_it_whole(tmp_path):
    """--force over an existing checkpoint wrote into it in place: a full disk midway left one transformer
    shard and no VAE. Now the new checkpoint is written beside and moved in whole: a failure leaves the older
    one as it was; a success replaces its files (another file there stays, as --force kept it)."""
    from safetensors import SafetensorError

    target = tmp_path / "ckpt"
    assert run_cli("make-tiny", target).returncode == 0
    (target / "NOTES.txt").write_text("mine")
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    with pytest.MonkeyPatch.context() as patch:
        _safetensors_disk_fills(patch, SafetensorError)
        assert run_cli("make-tiny", "--force", target).returncode == 1
    assert {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    r = run_cli("make-tiny", "--force", "--seed", "1", target)
    assert r.returncode == 0, r.stderr
    after = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert after.keys() == before.keys() and after != before and after[Path("NOTES.txt")] == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_make_tiny_force_puts_the_older_checkpoint_back_when_moving_in_fails(tmp_path):
    """A failure while the new checkpoint's folders are moved in (after some went in) puts the older ones back
    (they had been deleted with the new ones: no transformer/ at all); a DIR that is a link writes its
    temporary folders inside the folder it names (on that file system), none beside the link."""
    target, real = tmp_path / "link", tmp_path / "real" / "ckpt"
    real.parent.mkdir()
    assert run_cli("make-tiny", real).returncode == 0
    target.symlink_to(real)
    before = {p.relative_to(real): p.read_bytes() for p in real.rglob("*") if p.is_file()}
    rename = Path.rename

    def failing(self, to):
        if Path(to).name == "transformer" and ".partial-" in str(self):
            raise OSError(16, "Device or resource busy")
        return rename(self, to)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "rename", failing)
        r = run_cli("make-tiny", "--force", "--seed", "1", target)
    assert r.returncode == 1 and "Device or resource busy" in r.stderr, r.stderr
    assert {p.relative_to(real): p.read_bytes() for p in real.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert run_cli("make-tiny", "--force", "--seed", "1", target).returncode == 0
    assert {p.relative_to(real): p.read_bytes() for p in real.rglob("*") if p.is_file()} != before
    assert sorted(p.name for p in real.iterdir() if p.name.startswith(".")) == []
