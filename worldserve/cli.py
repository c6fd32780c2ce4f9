"""The `worldserve` console script: one argparse subcommand per verb, each living in `worldserve/commands/`.

Every verb module exposes `add_arguments(parser)` and `run(args) -> int`; modules are imported only when
their verb runs, so `worldserve make-tiny` does not pay for FastAPI and `worldserve serve` not for PyAV.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

VERBS: dict[str, tuple[str, str]] = {
    "serve": ("worldserve.commands.serve", "serve the video and chat APIs over HTTP"),
    "generate": ("worldserve.commands.generate", "generate one video (or image) offline"),
    "chat": (
        "worldserve.commands.chat",
        "chat with the Reasoner in this process (one message, or stdin turns)",
    ),
    "make-tiny": ("worldserve.commands.make_tiny", "write a tiny random checkpoint in the real layout"),
    "info": ("worldserve.commands.info", "describe a checkpoint: components, parameters, dtypes, defaults"),
    "bench": ("worldserve.commands.bench", "benchmark the denoising step and decode (GPU)"),
}


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag or value is one line naming it (and exit 2), not argparse's usage of every flag first (over
    a hundred lines for `serve`); `--help` still lists them. Each verb's parser is one too (add_subparsers)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def chosen_verb(argv: list[str]) -> str | None:
    """The verb `argv` names: its first word that is not a flag (None: none)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="worldserve", description="Serving engine for Cosmos3 world models")
    from worldserve import __version__

    parser.add_argument("-v", "--version", action="version", version=__version__)  # (as `vllm --version`)
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    chosen = chosen_verb(argv)
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        if verb == chosen:  # only the verb that runs imports its module
            importlib.import_module(module).add_arguments(p)
    return parser


def verb_parser(parser: argparse.ArgumentParser, verb: str) -> argparse.ArgumentParser:
    """The parser of `verb` (a subcommand) within build_parser's `parser`."""
    # (argparse exposes its subparsers only through its private action list)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[verb]


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so the verb's clean-ups run
    (parallel peers stopped, no partial output). A serving server has its own graceful stop (uvicorn holds
    SIGTERM while it serves); this is serve's during its start-up (the model load: minutes at full size)."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


REDELIVERIES: list[threading.Timer] = []
"""The SIGTERMs `_unraisable` will send again: cancelled when `main` returns (once it has restored the
previous handler, one would end the program that called it, a test's for one)."""


def _cancel_redeliveries() -> bool:
    """Cancel the SIGTERMs not yet sent again; True if one was still to come (the verb ended first)."""
    pending = False
    while REDELIVERIES:
        timer = REDELIVERIES.pop()
        pending |= not timer.finished.is_set()
        timer.cancel()
    return pending


def _unraisable(hook: Callable[[Any], object]) -> Callable[[Any], object]:
    """`hook` (sys.unraisablehook), but a Terminated that Python dropped is delivered again instead of
    printed: SIGTERM once more, sent 10 ms later from another thread, so that the handler runs after the
    finalizer (sent from here, it ran inside this hook and was dropped again; should it land in another
    finalizer, it comes round once more). A SIGTERM Python drops is so never lost: once uvicorn's handlers
    are in (serve), the one sent again starts its graceful stop."""

    def redeliver(unraisable: Any) -> object:
        if isinstance(unraisable.exc_value, Terminated):
            again = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM))
            again.daemon = True
            REDELIVERIES.append(again)
            again.start()
            return None
        return hook(unraisable)

    return redeliver


def main(argv: list[str] | None = None) -> int:
    from worldserve.commands.help_topics import help_topic, show_help_topic
    from worldserve.commands.vllm_argv import vllm_argv

    argv = vllm_argv(sys.argv[1:] if argv is None else argv)  # (vLLM's underscore and dotted-key spellings)
    parser = build_parser(argv)
    if (topic := help_topic(argv)) is not None:  # (vLLM's --help=listgroup / =ModelConfig / =max / =page)
        chosen = chosen_verb(argv)
        return show_help_topic(verb_parser(parser, chosen) if chosen in VERBS else parser, topic)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (named by the verb's parser: `worldserve serve: error: ... (see worldserve serve --help)`)
        verb_parser(parser, args.verb).error(f"unrecognized arguments: {' '.join(unknown)}")
    from worldserve.weights.checkpoint import CheckpointError

    previous = None  # (restored on return: main may run inside another program, a test)
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(
            signal.SIGTERM, _terminated
        )  # (the default had died at once: rc -15, silent)
    unraisable_hook, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)
    try:
        rc = int(importlib.import_module(VERBS[args.verb][0]).run(args) or 0)
        if _cancel_redeliveries():  # (a SIGTERM the verb's end outran: it still ends as terminated)
            raise Terminated
        return rc
    except CheckpointError as e:  # a missing or broken checkpoint is the user's: one line, no traceback
        print(f"worldserve {args.verb}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `worldserve info | head`: the reader left; no traceback, none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl-C (uvicorn re-raises it after its graceful shutdown): no traceback
        print(f"worldserve {args.verb}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"worldserve {args.verb}: terminated", file=sys.stderr)
        return 143  # (128 + SIGTERM, as a shell reports a process the signal ended)
    finally:
        _cancel_redeliveries()
        sys.unraisablehook = unraisable_hook
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def console() -> NoReturn:
    """The `worldserve` program: main()'s exit status. After a model load it stopped waiting for (serve's
    --init-timeout expired, or a signal came during the load) the interpreter's exit aborts the process in
    torch's C++ teardown (SIGABRT, exit 134, "terminate called without an active exception"): the program
    then leaves at once with main()'s status, its output flushed, its multi-GPU peer ranks killed first."""
    from worldserve.commands.serve_backend import LOAD_ABANDONED

    rc = main()
    if LOAD_ABANDONED.is_set():
        if (peers := sys.modules.get("worldserve.runner.peers")) is not None:  # (no exit hook runs below)
            peers.kill_peers_left()
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    console()
