"""`worldserve make-tiny DIR`: write a tiny random Cosmos3 checkpoint in the exact layout of nvidia/Cosmos3-Nano."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from worldserve.config_values import int64_seed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output folder (created)")
    p.add_argument(
        "--seed", type=int64_seed, default=0, help="seed of every random tensor (same seed, same bytes)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into DIR even when it holds files (they may be overwritten; a checkpoint's component "
        "folders there are replaced)",
    )
    p.add_argument("--no-sound", action="store_true", help="leave out the sound tokenizer and audio heads")
    p.add_argument("--no-vision", action="store_true", help="leave out the Reasoner's vision encoder")
    p.add_argument(
        "--shapes", choices=("tiny", "nano"), default="tiny",
        help="nano: Cosmos3-Nano's real sizes (~32 GB of random weights for GPU benchmarks; needs ~40 GB of "
        "host memory while writing)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    from worldserve.commands.cli_inputs import check_writable
    from worldserve.params import ParamError
    from worldserve.weights.checkpoint import write_failure_reason
    from worldserve.weights.tiny import make_tiny

    try:  # a DIR that is a file, or under one, or read-only: the argument's fault, argparse's exit code
        if not args.dir:
            raise ParamError("dir", "DIR must not be empty (it wrote into the current folder)")
        check_writable(Path(args.dir), "dir", "DIR", folder=True)
        if not args.force and Path(args.dir).is_dir() and any(Path(args.dir).iterdir()):
            raise ParamError("dir", f"DIR {args.dir} is not empty: its files would be mixed with the checkpoint's "
                             "or overwritten (a real checkpoint's weights by random ones); name a new folder, or "
                             "pass --force")  # fmt: skip
    except ParamError as e:
        print(f"worldserve make-tiny: error: {e.message}", file=sys.stderr)
        return 2
    target = Path(args.dir)
    # the checkpoint is written beside DIR and moved in when complete: an interrupted or failed run leaves DIR
    # as it was (a new one: nothing; it left a half-written folder, "not a Cosmos3 checkpoint"; --force over
    # a checkpoint: that checkpoint, where it left one shard of eight and no VAE)
    # (inside an existing DIR, on its file system: DIR may be a link to, or a mount of, another one)
    inside = target.is_dir()
    folder = (
        (target / f".partial-{os.getpid()}")
        if inside
        else target.parent / f".{target.name}.partial-{os.getpid()}"
    )
    try:
        make_tiny(
            folder, seed=args.seed, sound=not args.no_sound, vision=not args.no_vision, shapes=args.shapes
        )
        _move_in(folder, target)
    except (OSError, SafetensorError) as exc:  # what the check could not foresee (a missing parent under
        # /proc, a full disk: the weights' write fails in safetensors, a SafetensorError, not an OSError)
        print(f"worldserve make-tiny: error: cannot write {args.dir}: {write_failure_reason(exc)}",
              file=sys.stderr)  # fmt: skip
        return 1
    finally:
        if folder.exists():  # (failed or interrupted: Ctrl-C, SIGTERM)
            shutil.rmtree(folder, ignore_errors=True)
    print(f"wrote a {args.shapes} random Cosmos3 checkpoint to {target} (its outputs are noise)")
    return 0


def _move_in(folder: Path, target: Path) -> None:
    """The complete checkpoint `folder` as `target`: renamed to it when `target` does not exist, else (an
    empty DIR, or --force) each of its entries renamed over `target`'s of that name and an earlier
    checkpoint's components it has not removed, the older ones moved aside first and deleted once all are in
    (a failure midway puts them back), `target`'s other files left be, as --force writing into it left them."""
    from worldserve.weights.tiny import COMPONENT_FOLDERS

    if not target.is_dir():
        folder.rename(target)
        return
    aside = target / f".older-{os.getpid()}"
    aside.mkdir()
    moved: list[str] = []
    try:
        # (an earlier checkpoint's component the new one has not, e.g. vision_encoder/ under --no-vision, goes)
        names = {entry.name for entry in folder.iterdir()} | set(COMPONENT_FOLDERS)
        for name in sorted(names):
            older = target / name
            if older.exists() or older.is_symlink():
                older.rename(aside / name)
            moved.append(name)
            if (folder / name).exists():
                (folder / name).rename(older)
    except BaseException:
        for name in reversed(moved):  # the older checkpoint put back as it was
            if (target / name).is_dir() and not (target / name).is_symlink():
                shutil.rmtree(target / name, ignore_errors=True)
            elif (target / name).exists():
                (target / name).unlink()
            if (aside / name).exists() or (aside / name).is_symlink():
                (aside / name).rename(target / name)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
