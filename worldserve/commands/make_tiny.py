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
    # a new (or empty) DIR is written beside it and renamed when complete: an interrupted or failed run
    # leaves nothing (it left a half-written folder, "not a Cosmos3 checkpoint", that only --force could fill)
    fresh = not (target.is_dir() and any(target.iterdir()))
    folder = target.parent / f".{target.name}.partial-{os.getpid()}" if fresh else target
    try:
        make_tiny(
            folder, seed=args.seed, sound=not args.no_sound, vision=not args.no_vision, shapes=args.shapes
        )
        if fresh:
            if target.is_dir():
                target.rmdir()  # (empty)
            folder.rename(target)
    except (OSError, SafetensorError) as exc:  # what the check could not foresee (a missing parent under
        # /proc, a full disk: the weights' write fails in safetensors, a SafetensorError, not an OSError)
        print(f"worldserve make-tiny: error: cannot write {args.dir}: {write_failure_reason(exc)}",
              file=sys.stderr)  # fmt: skip
        return 1
    finally:
        if fresh and folder.exists():  # (failed or interrupted: Ctrl-C, SIGTERM)
            shutil.rmtree(folder, ignore_errors=True)
    print(f"wrote a {args.shapes} random Cosmos3 checkpoint to {target} (its outputs are noise)")
    return 0
