"""file:// media of chat requests (api/chat_media.load_media_url) under --allowed-local-media-path: only
regular files inside the folder are read (a FIFO, /dev/zero or a symlink leading out is refused at once,
never read), files over the size cap are refused, and messages name the path as the request gave it."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest

from worldserve.api import chat_media
from worldserve.api.chat_media import load_media_url
from worldserve.params import ParamError


def _load(url: str, root: str | Path) -> bytes:
    """load_media_url on a thread of its own, given 5 s (a read that blocks would hang the test otherwise)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_call(url, str(root))), daemon=True)
    thread.start()
    thread.join(5)
    assert result, f"reading {url} blocked"
    if isinstance(result[0], ParamError):
        raise result[0]
    return result[0]


def _call(url: str, root: str):
    try:
        return load_media_url(url, root, param="p")
    except ParamError as exc:
        return exc


def test_regular_files_inside_the_folder_are_read(tmp_path):
    (tmp_path / "a.png").write_bytes(b"png")
    assert _load(f"file://{tmp_path}/a.png", tmp_path) == b"png"
    assert _load(f"file://{tmp_path}/sub/%2e%2e/a.png", tmp_path) == b"png"
    assert _load(f"file://localhost{tmp_path}/a.png", tmp_path) == b"png"
    with pytest.raises(ParamError, match="host must be empty or localhost, not 'evil.com'"):  # (as in vLLM)
        _load(f"file://evil.com{tmp_path}/a.png", tmp_path)
    with pytest.raises(ParamError, match="names no file"):
        _load("file://", tmp_path)


def test_fifos_and_devices_are_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(ParamError, match="not a regular file"):
        _load(f"file://{tmp_path}/pipe.png", tmp_path)
    with pytest.raises(ParamError, match="not a regular file"):  # would never end (and fill the memory)
        _load("file:///dev/zero", "/dev")


def test_files_over_the_cap_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_media, "MAX_LOCAL_FILE_BYTES", 1000)
    (tmp_path / "big.mp4").write_bytes(b"\0" * 1001)
    with pytest.raises(ParamError, match="larger than"):
        _load(f"file://{tmp_path}/big.mp4", tmp_path)


def test_messages_name_the_given_path_not_a_symlinks_target(tmp_path):
    root, outside = tmp_path / "media", tmp_path / "private-dir"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("x")
    (root / "link.png").symlink_to(outside / "secret")
    with pytest.raises(ParamError, match="must be a subpath") as err:
        _load(f"file://{root}/link.png", root)
    assert "private-dir" not in err.value.message and f"{root}/link.png" in err.value.message
    with pytest.raises(ParamError, match="NUL"):  # (a ValueError deep in os: a 500 before)
        _load(f"file://{root}/a.png%00.txt", root)


def test_a_directory_is_refused_and_leaves_no_descriptor_open(tmp_path):
    """(was an IsADirectoryError, a 500, and one file descriptor leaked per request: a client could use up the
    server's descriptors)"""
    (tmp_path / "sub").mkdir()
    # (an earlier test's objects collected meanwhile close their descriptors: counted before, as new ones after)
    gc.collect()
    before = set(os.listdir("/proc/self/fd"))
    for url in (f"file://{tmp_path}/sub", f"file://{tmp_path}/") * 10:
        with pytest.raises(ParamError, match="not a regular file"):
            _load(url, tmp_path)
    after = set(os.listdir("/proc/self/fd"))
    assert after <= before and len(after) <= len(before), (
        "a descriptor opened by the refused loads stays open"
    )


@pytest.mark.parametrize("url", ["//[::1", "zz://[", "file://[::1/x"])
def test_urls_pythons_parser_refuses_name_the_field(url):
    """urlparse raises ValueError ("Invalid IPv6 URL") for these: it had been a 500 on every chat media part."""
    with pytest.raises(ParamError) as err:
        load_media_url(url, None, param="messages[0].content[0].image_url")
    assert err.value.param == "messages[0].content[0].image_url" and "Invalid image URL" in str(err.value)


def test_a_symlink_loop_under_the_allowed_folder_names_the_field(tmp_path):
    """Path.resolve raises on a symlink loop (RuntimeError on Python 3.11): it had been a 500."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ParamError) as err:
        load_media_url(f"file://{tmp_path}/a/x.png", str(tmp_path), param="messages[0].content[0].image_url")
    assert err.value.param == "messages[0].content[0].image_url" and "cannot be resolved" in str(err.value)
