"""Test helper: run a `worldserve` verb in this process, the way `python -m worldserve.cli` runs it.

`run_cli("generate", ckpt, "--prompt", ...)` calls `worldserve.cli.main` with the arguments as strings,
captures what it prints (stdout, stderr) and feeds `stdin` (text, or bytes decoded as Python decodes a
UTF-8 terminal's: undecodable bytes become lone surrogates), and returns a `subprocess.CompletedProcess` with
main's exit status (argparse's SystemExit included). In-process saves each call the ~5-10 s a fresh
interpreter spends importing torch, transformers and the tokenizer on a 2-core CI machine; every test file
that drives a verb this way keeps one real subprocess run of that verb (the console path a user takes).
"""

from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout


def run_cli(verb: str, *args, stdin: str | bytes | None = None) -> subprocess.CompletedProcess:
    from worldserve.cli import main

    argv = [verb, *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    raw = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    text_in = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="surrogateescape")
    saved_stdin, sys.stdin = sys.stdin, text_in
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = saved_stdin
    return subprocess.CompletedProcess(["worldserve", *argv], code, out.getvalue(), err.getvalue())
