"""Every environment variable worldserve reads, in one place (design.md anti-pattern 9: no scattered getenv).

Values are read when a function is called (never at import), so tests can set them per case. Command-line
flags win over these variables; the variables win over built-in defaults. The vLLM / vLLM-Omni names are
honoured so that existing deployments keep working.
"""

from __future__ import annotations

import os
from pathlib import Path

from worldserve.config_values import check_seconds

DEFAULT_SYNC_TIMEOUT_S = 600.0
MAX_FETCH_TIMEOUT_S = 86400.0
CUTE_DSL_RUNTIME_ENV = "WORLDSERVE_CUTE_DSL_RUNTIME"


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a number of seconds") from None


def sync_timeout_s() -> float:
    """`VLLM_OMNI_VIDEO_SYNC_TIMEOUT` (older builds: `VLLM_VIDEO_SYNC_TIMEOUT`), default 600 s."""
    for name in ("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", "VLLM_VIDEO_SYNC_TIMEOUT"):
        value = _env_float(name)
        if value is not None:
            check_seconds(f"environment variable {name}", value, zero=False)
            return value
    return DEFAULT_SYNC_TIMEOUT_S


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from variable `name`, `default` when unset or blank."""
    value = _env_float(name)
    if value is None:
        return default
    check_seconds(f"environment variable {name}", value, zero=False)
    return value


def http_timeout_keep_alive_s() -> float:
    """`VLLM_HTTP_TIMEOUT_KEEP_ALIVE` (vLLM's, default 5 s): how long an idle keep-alive connection stays open
    (uvicorn's timeout_keep_alive). A client pool that reuses connections idle about that long can meet the
    server closing them (a read error); raise it above the client's own idle timeout to avoid that."""
    return _env_seconds("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", 5.0)


def log_stats_interval_s() -> float:
    """`VLLM_LOG_STATS_INTERVAL` (vLLM's, default 10 s): seconds between two stats lines (api/stats_log.py)."""
    return _env_seconds("VLLM_LOG_STATS_INTERVAL", 10.0)


def http_header_timeout_s() -> float:
    """`WORLDSERVE_HTTP_HEADER_TIMEOUT` (default 60 s, nginx's client_header_timeout): how long a connection
    may take to send a request's headers (from its opening, or its first byte after a response), and then
    the longest silence while it owes body bytes (nginx's client_body_timeout, same default), before it is
    answered 408 and closed (api/http_protocol.py), so clients that open connections and never finish a
    request cannot hold the server's file descriptors forever."""
    return _env_seconds("WORLDSERVE_HTTP_HEADER_TIMEOUT", 60.0)


def max_completion_prompts() -> int:
    """`VLLM_MAX_COMPLETION_PROMPTS` (vLLM's, default 1024): the most prompts one /v1/completions request may
    list (each runs its `n` choices: without a bound, one request of thousands holds every other back)."""
    raw = os.environ.get("VLLM_MAX_COMPLETION_PROMPTS", "").strip()
    if not raw:
        return 1024
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"environment variable VLLM_MAX_COMPLETION_PROMPTS={raw!r} must be an integer >= 1")
    return value


def _env_flag(name: str, default: bool) -> bool:
    """A yes / no variable: 1 / true / yes / on, 0 / false / no / off (any case); unset or anything else:
    `default`."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    return False if value in ("0", "false", "no", "off") else default


def media_url_allow_redirects() -> bool:
    """`VLLM_MEDIA_URL_ALLOW_REDIRECTS` (default 1): whether downloads of http(s) media URLs follow redirects."""
    return _env_flag("VLLM_MEDIA_URL_ALLOW_REDIRECTS", True)


def media_allow_private_addresses() -> bool:
    """`WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES` (default 0): whether downloads of http(s) media URLs may reach
    hosts that resolve to private, loopback, link-local (cloud metadata), multicast or reserved addresses
    beyond those named in --allowed-media-domains (api/media_urls.py)."""
    return _env_flag("WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES", False)


def media_fetch_timeout_s(kind: str) -> float:
    """Seconds a chat's http(s) media download may take: vLLM's `VLLM_IMAGE_FETCH_TIMEOUT` (default 5) for
    images, `VLLM_VIDEO_FETCH_TIMEOUT` (default 30) for videos."""
    name, default = (
        ("VLLM_IMAGE_FETCH_TIMEOUT", 5.0) if kind == "image" else ("VLLM_VIDEO_FETCH_TIMEOUT", 30.0)
    )
    value = _env_float(name)
    if value is not None and not 0 < value <= MAX_FETCH_TIMEOUT_S:
        raise ValueError(f"environment variable {name}={value} must be a number of seconds in (0, 86400]")
    return default if value is None else value


def api_key() -> str | None:
    """`WORLDSERVE_API_KEY`, else vLLM's `VLLM_API_KEY`; None (no auth) when neither is set (or set empty).
    ValueError naming the variable for a key ending in blanks, a blank one included: HTTP strips them from
    the Authorization header, so no request could carry it (every /v1 request was refused)."""
    for name in ("WORLDSERVE_API_KEY", "VLLM_API_KEY"):
        key = os.environ.get(name)
        if key and key != key.rstrip():
            what = "only blanks" if not key.strip() else "a key ending in blanks"
            raise ValueError(f"environment variable {name} is {what}, which no request's bearer token can "
                             "match (HTTP strips the blanks ending a header): unset it or give the key alone")  # fmt: skip
        if key:
            return key
    return None


def keep_alive_on_engine_death() -> bool:
    """vLLM's `VLLM_KEEP_ALIVE_ON_ENGINE_DEATH` (an integer, default 0, read as vLLM reads it): non-zero keeps
    `worldserve serve` up once its engine is dead (/health and every request answering 503) instead of
    shutting it down with exit status 1 (commands/engine_death.py). ValueError for a value that is no integer
    (vLLM's int() failed on it only once its engine had died)."""
    raw = os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "").strip()
    try:
        return bool(int(raw or "0"))
    except ValueError:
        raise ValueError(
            f"environment variable VLLM_KEEP_ALIVE_ON_ENGINE_DEATH={raw!r} must be an integer (0: stop the "
            "server when its engine dies, the default; 1: keep it up, answering 503)"
        ) from None


def logging_config_path() -> str | None:
    """vLLM's `VLLM_LOGGING_CONFIG_PATH`: a logging configuration file, as `--log-config-file` (which wins);
    None when unset or empty."""
    return os.environ.get("VLLM_LOGGING_CONFIG_PATH") or None


def cache_home() -> str | None:
    """XDG_CACHE_HOME as set (None: unset or empty)."""
    return os.environ.get("XDG_CACHE_HOME") or None


def cache_dir() -> Path:
    """The user cache folder: `$XDG_CACHE_HOME/worldserve`, else `~/.cache/worldserve`."""
    return Path(cache_home() or str(Path.home() / ".cache")) / "worldserve"


def hf_hub_offline() -> bool:
    """Hugging Face's `HF_HUB_OFFLINE` (default 0): nothing is downloaded; a model not in the cache is an
    error."""
    return _env_flag("HF_HUB_OFFLINE", False)


def cute_dsl_runtime() -> Path | None:
    """`WORLDSERVE_CUTE_DSL_RUNTIME`: the CuTe DSL runtime library the FA4 cluster kernel loads, in place of
    the installed nvidia-cutlass-dsl libs' (models/layers/fa4_cluster.py)."""
    value = os.environ.get(CUTE_DSL_RUNTIME_ENV)
    return Path(value) if value else None


def storage_dir() -> Path:
    """Job store folder: `WORLDSERVE_STORAGE_DIR`, else vLLM-Omni's `VLLM_OMNI_SERVER_STORAGE__PATH` (or its
    deprecated `VLLM_OMNI_STORAGE_PATH`), else the cache."""
    names = ("WORLDSERVE_STORAGE_DIR", "VLLM_OMNI_SERVER_STORAGE__PATH", "VLLM_OMNI_STORAGE_PATH")
    explicit = next((value for name in names if (value := os.environ.get(name))), None)
    return Path(explicit) if explicit else cache_dir() / "storage"


def storage_file_ttl_s() -> float | None:
    """vLLM-Omni's `VLLM_OMNI_SERVER_STORAGE__FILE_TTL`: seconds a finished video is kept (here --job-ttl's
    default: the job goes with its file); None (keep forever) when unset or 0."""
    value = _env_float("VLLM_OMNI_SERVER_STORAGE__FILE_TTL")
    if value is not None:
        check_seconds("environment variable VLLM_OMNI_SERVER_STORAGE__FILE_TTL", value, zero=True)
    return value or None


def storage_sweep_interval_s() -> float | None:
    """vLLM-Omni's `VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL`: seconds between two expiry sweeps; None
    (unset): half the TTL, at most a minute."""
    value = _env_float("VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL")
    if value is not None:
        check_seconds("environment variable VLLM_OMNI_SERVER_STORAGE__TTL_SWEEP_INTERVAL", value, zero=False)
    return value


def cache_backend() -> tuple[str, str] | None:
    """(variable, value) of vLLM-Omni's `DIFFUSION_CACHE_BACKEND`, or of its older name `DIFFUSION_CACHE_ADAPTER`:
    --cache-backend's fallback (serve_compat checks it as the flag); None when neither is set."""
    for name in ("DIFFUSION_CACHE_BACKEND", "DIFFUSION_CACHE_ADAPTER"):
        if value := os.environ.get(name):
            return name, value
    return None


ATTENTION_BACKEND_VAR = "DIFFUSION_ATTENTION_BACKEND"


def attention_backend() -> str | None:
    """vLLM-Omni's `DIFFUSION_ATTENTION_BACKEND` (FLASH_ATTN, TORCH_SDPA, CUDNN_ATTN); None: auto."""
    return os.environ.get(ATTENTION_BACKEND_VAR) or None


def bench_commit() -> str | None:
    """WORLDSERVE_COMMIT: the commit a `worldserve bench` report names, for a tree copied without its git
    history (the GPU machine gets a `git archive`); None: read it from git."""
    return os.environ.get("WORLDSERVE_COMMIT") or None
