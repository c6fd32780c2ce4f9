"""`worldserve make-tiny DIR`: write a tiny random Cosmos3 checkpoint in the exact layout of nvidia/Cosmos3-Nano."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output folder (created)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random tensor (same seed, same bytes)")
    p.add_argument("--no-sound", action="store_true", help="leave out the sound tokenizer and audio heads")
    p.add_argument("--no-vision", action="store_true", help="leave out the Reasoner's vision encoder")
    p.add_argument(
        "--shapes", choices=("tiny", "nano"), default="tiny",
        help="nano: Cosmos3-Nano's real sizes (~32 GB of random weights for GPU benchmarks; needs ~40 GB of "
        "host memory while writing)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from worldserve.weights.tiny import make_tiny

    try:
        out = make_tiny(
            args.dir, seed=args.seed, sound=not args.no_sound, vision=not args.no_vision, shapes=args.shapes
        )
    except OSError as exc:  # a path that cannot be a folder (a file, a missing parent under /proc, no rights)
        print(f"worldserve make-tiny: error: cannot write {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote a {args.shapes} random Cosmos3 checkpoint to {out} (its outputs are noise)")
    return 0
