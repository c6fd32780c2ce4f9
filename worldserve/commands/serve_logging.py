"""Where `worldserve serve`'s log lines go beyond the console: `--log-file PATH` (every line appended to PATH
too), vLLM's `--log-config-file PATH` (a logging configuration, Python's dictConfig schema in JSON or YAML,
applied at startup to worldserve's and uvicorn's loggers: serve_http.uvicorn_options then has uvicorn set up
none of its own) and vLLM's `--disable-access-log-for-endpoints /health,/metrics` (those paths' requests log
no access line; the others do).

Inputs: the flags' values; outputs: the handler, the configuration applied, the access log's filter for the
time of serving. Each file that cannot be read or used is a FlagValueError naming its flag (exit 2, before
the model loads). Separate from serve_compat.py (the vLLM flags' table) and serve_http.py (the server).
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import sys
from collections.abc import Iterator

from worldserve.config import FlagValueError

ACCESS_LOGGER = "uvicorn.access"
"""The logger of uvicorn's access lines (`'%s - "%s %s HTTP/%s" %d'`: client, method, path, version, status)."""


def apply_log_config(path: str, origin: str = "--log-config-file") -> None:
    """--log-config-file: the file's configuration applied (logging.config.dictConfig; errors name `origin`,
    the flag or vLLM's VLLM_LOGGING_CONFIG_PATH). Loggers the file does not name keep working unless it says
    `disable_existing_loggers: true` (dictConfig's own default would silence every worldserve logger a
    configuration pasted from vLLM, naming `vllm`, leaves out)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith((".yaml", ".yml")):
            import yaml

            config = yaml.safe_load(text)
        else:
            config = json.loads(text)
    except (OSError, ValueError) as exc:  # (yaml.YAMLError and json's errors are ValueErrors)
        why = " ".join(str(getattr(exc, "strerror", None) or exc).split())
        raise FlagValueError(f"{origin} {path}: cannot read it ({why})") from None
    if not isinstance(config, dict):
        raise FlagValueError(f"{origin} {path}: expected a logging configuration (a JSON object with "
                             "version: 1, formatters, handlers, loggers)")  # fmt: skip
    config.setdefault("disable_existing_loggers", False)
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        # (dictConfig says which logger or handler, its __cause__ why: an unknown level, a missing folder)
        why = f"{exc} ({exc.__cause__})" if exc.__cause__ is not None else str(exc)
        raise FlagValueError(f"{origin} {path}: {' '.join(why.split())}") from None


def excluded_paths(text: str | None) -> frozenset[str]:
    """--disable-access-log-for-endpoints' comma-separated paths; FlagValueError for one without its '/'."""
    paths = frozenset(p.strip() for p in (text or "").split(",") if p.strip())
    for path in sorted(paths):
        if not path.startswith("/"):  # (it would match no request)
            raise FlagValueError(
                f"--disable-access-log-for-endpoints: {path!r} must start with '/' (e.g. /{path})"
            )
    return paths


class AccessLogExclusions(logging.Filter):
    """Drops uvicorn's access line of a request for one of `paths` (its query left out; under --root-path the
    path with or without the prefix, as requests are served either way)."""

    def __init__(self, paths: frozenset[str], root_path: str | None) -> None:
        super().__init__()
        self.paths, self.root = paths, (root_path or "").rstrip("/")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        path = str(args[2]).split("?", 1)[0]
        if path in self.paths:
            return False
        root = self.root
        return not (root and path.startswith(root + "/") and path[len(root) :] in self.paths)


@contextlib.contextmanager
def access_log_excluded(paths: frozenset[str], root_path: str | None) -> Iterator[None]:
    """uvicorn's access logger drops `paths`' lines while serving (nothing to do without paths)."""
    if not paths:
        yield
        return
    exclusions = AccessLogExclusions(paths, root_path)
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addFilter(exclusions)
    try:
        yield
    finally:
        logger.removeFilter(exclusions)


def log_to_file(path: str, log_format: str) -> logging.Handler:
    """--log-file: a handler appending to `path`, added to the root logger (worldserve's lines; serve adds it
    to uvicorn's loggers, which do not propagate, once uvicorn has set them up); FlagValueError when it cannot
    be opened."""
    try:
        handler = _LogFile(path, encoding="utf-8")
    except OSError as exc:
        raise FlagValueError(f"--log-file {path}: cannot open it ({exc.strerror or exc})") from None
    handler.setFormatter(logging.Formatter(log_format, datefmt="%m-%d %H:%M:%S"))
    logging.getLogger().addHandler(handler)
    return handler


class _LogFile(logging.FileHandler):
    """--log-file's handler: a line it cannot write (a full disk) is said once on stderr, in one line, not as
    logging's "--- Logging error ---" traceback for every line."""

    _failed = False

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            self._said(exc)

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:  # (the buffered lines' last write, at exit)
            self._said(exc)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        why = sys.exc_info()[1]
        if isinstance(why, OSError):
            self._said(why)
        else:  # (a line that does not format: logging's own report, the file is fine)
            super().handleError(record)

    def _said(self, why: BaseException | None) -> None:
        if not self._failed:
            self._failed = True
            sys.stderr.write(f"worldserve: --log-file {self.baseFilename}: cannot write to it ({why}); its "
                             "lines from here on may be lost\n")  # fmt: skip
