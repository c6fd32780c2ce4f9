"""A video job's inputs record (every VideoParams field but the reference, which is a file of its own, its LoRA
adapter as a JSON object, plus the encode options; kept in the row's `inputs` column), the files a job keeps
beside its row (written atomically), and the storage folder's lock.

`inputs_record` / `inputs_from_record` are the one definition of that record: the store persists it at
submit and the client re-runs an interrupted job from it (the reference bytes decoded again). `write_atomic`
writes a file so that readers see the old one or the whole new one, across a crash. `lock_storage` holds
the folder for one process (two servers would re-run and delete each other's jobs); `database_gone` says
when the database was removed under the running server, `folder_unwritable` when a folder's files cannot be
written any more; `remove_strays` clears what a crash left.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
from pathlib import Path
from typing import Any, TextIO

from worldserve.engine.request import EncodeOptions
from worldserve.media.atomic_write import write_atomically
from worldserve.params import LoraRequest, VideoParams

log = logging.getLogger(__name__)


def inputs_record(params: VideoParams, encode: EncodeOptions) -> dict[str, Any]:
    """What the store keeps to re-run a job: every VideoParams field but the image / video (a file), and which
    of the two the reference file was read as (`reference`: "image", "video" or None); the LoRA adapter as an
    object of its fields."""
    fields = {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(VideoParams)
        if f.name not in ("image", "video")
    }
    if params.lora is not None:
        fields["lora"] = dataclasses.asdict(params.lora)
    kind = "video" if params.video is not None else "image" if params.image is not None else None
    return {"params": fields, "crf": encode.crf, "codec_options": encode.codec_options, "reference": kind}


LEGACY_FIELD_NAMES = {
    "condition_frame_indexes": "extra_params.condition_frame_indexes_vision",
    "condition_video_keep": "extra_params.condition_video_keep",
}
"""Where a video route takes VideoParams fields that records written before VideoParams named its own fields
lack (it named these two by their request fields)."""


def legacy_field_names(names: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """A record's field_names as VideoParams names its fields now: a record written before named the
    conditioning reference `input_reference` (now `image` / `video`) and the condition fields by their request
    fields (LEGACY_FIELD_NAMES): a check failing as the job is restored names what its client sent."""
    if (reference := names.pop("input_reference", None)) is not None:
        names.setdefault("image", reference)
        names.setdefault("video", reference)
    for field_name, request_field in LEGACY_FIELD_NAMES.items():
        names.setdefault(field_name, request_field)
    return tuple(names.items())


def inputs_from_record(record: dict[str, Any], reference: bytes | None) -> tuple[VideoParams, EncodeOptions]:
    fields = dict(record["params"])
    for name in ("condition_frame_indexes", "guidance_interval"):  # JSON gave lists back
        if fields.get(name) is not None:
            fields[name] = tuple(fields[name])
    fields["field_names"] = legacy_field_names(dict(fields.get("field_names", ())))
    if fields.get("lora") is not None:
        fields["lora"] = LoraRequest(**fields["lora"])
    image = video = None
    if reference is not None:  # the upload or data URL as received, read as it was at submit
        from worldserve.media.image import decode_image
        from worldserve.media.video_input import condition_budget, decode_reference, decode_video

        probe = VideoParams(**fields)
        frames, keep = condition_budget(probe.condition_frame_indexes), probe.condition_video_keep
        kind = record.get("reference")  # (a record from before it was kept: sniffed, image first)
        if kind == "image":
            image = decode_image(reference)
        elif kind == "video":  # (a video_reference's image bytes are a one-frame clip, as at submit)
            video = decode_video(reference, frames, keep)
        else:
            image, video = decode_reference(reference, max_frames=frames, keep=keep, still_images=True)
    params = VideoParams(**fields, image=image, video=video)
    return params, EncodeOptions(crf=record["crf"], codec_options=record["codec_options"])


def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename over `path`, fsync the folder (media/atomic_write.py, private: 0600): readers see
    the old file or the whole new one. Its folder is made again if it was removed (not the folders above it:
    see `database_gone`)."""
    path.parent.mkdir(exist_ok=True)
    write_atomically(path, data, private=True)


OWN_FILE = re.compile(r"(\.?)(video_gen_[0-9a-f]{32})\.(?:mp4|ref)(\.[0-9a-f]{32}\.tmp)?")
"""A file the store writes: a job's video or reference, or a temp file of `write_atomic` (dot, name, .tmp);
groups: the temp dot, the job id, the temp suffix."""


def remove_strays(folder: Path, keep: set[str]) -> None:
    """Remove the store's temp files in `folder` and its job files whose job is not in `keep` (a file the
    store does not write, a folder or a symlink is left be)."""
    for path in folder.iterdir():
        own = OWN_FILE.fullmatch(path.name)
        if own and (own[1] or own[3] or own[2] not in keep) and path.is_file() and not path.is_symlink():
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # (a folder made read-only: the server still starts, the file stays)
                log.warning("could not remove the stray file %s: %s", path, exc)


def folder_unwritable(folder: Path) -> str | None:
    """Why `write_atomic` cannot create files in `folder` now (no read, write or search permission on it: it
    opens the folder to fsync it after the rename; no write or search permission on its parent when it was
    removed, where it is made again; a read-only filesystem), else None. Named, not by path (the reason
    reaches clients, as `database_gone`'s does). (A root server passes any permission check.)"""
    if folder.exists():
        if os.access(folder, os.R_OK | os.W_OK | os.X_OK):
            return None
    elif os.access(folder.parent, os.W_OK | os.X_OK):
        return None
    return f"its {folder.name} folder is not writable by the server"


def file_identity(path: Path) -> tuple[int, int]:
    """(device, inode) of `path`: which file it is, whatever its name says later."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def database_gone(path: Path, identity: tuple[int, int]) -> str | None:
    """Why the job database the store opened (`identity`) is no longer the file at `path` (removed, or the
    storage folder removed, or replaced), else None. SQLite keeps writing to a removed file, which is lost
    at the next start: a store whose database is gone must take no more jobs. The reason reaches clients (a
    create's 503, the unauthenticated /health), so it names the file, not its path (the startup log has the
    storage folder), as job_faults.py's messages do."""
    try:
        if file_identity(path) == identity:
            return None
    except OSError as exc:
        return (
            f"its job database {path.name} is gone ({exc.strerror}): the storage folder was removed or moved"
        )
    return f"its job database {path.name} was replaced by another file under the running server"


class StorageError(RuntimeError):
    """The storage directory cannot be used (not writable, or locked by another process)."""

    status_code = 503  # met while serving: the answer of the request, or the code of the job, that met it


class StorageInUseError(StorageError):
    """Another process holds the storage directory (two servers would re-run and delete each other's jobs)."""


def lock_storage(root: Path) -> TextIO:
    """An exclusive lock on `root`/.lock for this process (the open file holds it; closing releases it).
    Where the filesystem has no locks (some NFS / FUSE mounts) the store runs unlocked, with a warning."""
    try:
        owner = open(root / ".lock", "a+")  # noqa: SIM115 (held for the store's lifetime)
    except OSError as exc:
        raise StorageError(f"cannot write to the storage directory {root}: {exc}") from None
    try:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner.close()
        raise StorageInUseError(
            f"the storage directory {root} is in use by another worldserve server; give each server its own "
            "--storage-dir"
        ) from None
    except OSError as exc:  # ENOLCK / EOPNOTSUPP: no locks on this filesystem
        log.warning("cannot lock the storage directory %s (%s): make sure no other server uses it", root, exc)
    return owner
