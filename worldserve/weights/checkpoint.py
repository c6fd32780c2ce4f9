"""Resolving a model reference to a Cosmos3 checkpoint folder and describing its components.

A reference is a local folder, or a Hugging Face repo id (`nvidia/Cosmos3-Nano`) looked up in the HF cache
(`HF_HOME` / `HF_HUB_CACHE`, honouring `--revision`). With `HF_HUB_OFFLINE=1` (always set in tests) a
missing snapshot is one clear error naming the cache folder; otherwise huggingface_hub downloads it.
`None` means the embedded tiny checkpoint, written once under the user cache folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worldserve import envs
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.weights.load_lock import model_loads

log = logging.getLogger(__name__)

GENERATION_COMPONENTS = ("transformer", "vae", "text_tokenizer", "scheduler")
OPTIONAL_COMPONENTS = ("sound_tokenizer", "vision_encoder")
# Only what generation and the Reasoner read; the repo also carries assets/ and example outputs.
ALLOW_PATTERNS = [
    "model_index.json",
    "config.json",
    "model.safetensors.index.json",
    "generation_config.json",  # the Reasoner's sampling defaults (--generation-config auto), when shipped
    "transformer/*",
    "vae/*",
    "sound_tokenizer/*",
    "text_tokenizer/*",
    "vision_encoder/*",
    "scheduler/*",
]
TINY_SEED = 0
TINY_LAYOUT = 2
"""Bumped whenever make-tiny writes something else (2: the tokenizer's Qwen text tokens), so that the cached
embedded default is written again instead of reused."""


class CheckpointError(RuntimeError):
    """The checkpoint folder is missing, incomplete or inconsistent; the message says what to fix."""


@contextlib.contextmanager
def readable_weights(folder: Path | str) -> Iterator[None]:
    """Inside it, a weights file under `folder` that cannot be read (a cut safetensors header, a file a loader
    expects and does not find), or weights whose shapes its config.json does not give (diffusers' ValueError),
    is a CheckpointError naming the folder, not diffusers' or safetensors' traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{folder}: unreadable weights ({e}); re-download them") from e
    except ValueError as e:  # (e.g. a config.json of `{}`: diffusers' defaults, then every shape mismatched)
        first = str(e).strip().split(" For more information")[0].splitlines()[0] if str(e).strip() else ""
        first = (first if len(first) <= 300 else first[:297] + "...") or type(e).__name__
        raise CheckpointError(
            f"{folder}: its config.json and weights disagree ({first}); re-download it"
        ) from e


def load_diffusers_component(model_cls: Any, folder: Path | str, **kwargs: Any) -> Any:
    """`model_cls.from_pretrained(folder, **kwargs)` (a diffusers model: the video VAE, the sound tokenizer)
    held to the transformer's rules. Its safetensors headers are read first: none there, an unreadable one,
    or a tensor that is not floating point is one CheckpointError naming it (diffusers went looking for a
    pickle file instead, and cast integers in silence). Missing and mis-shaped keys are refused; extra keys
    (an encoder this server does not run) are skipped, as diffusers skips them, with one log line; diffusers'
    own multi-line loading warnings stay out of the output."""
    from worldserve.weights.loader import read_header

    folder = Path(folder)
    header = read_header(folder, "diffusion_pytorch_model")
    ints = header.non_float(header.dtypes)
    if ints:
        more = f" and {len(ints) - 5} more" if len(ints) > 5 else ""
        raise CheckpointError(
            f"{folder}: tensors that are not floating point: {ints[:5]}{more}; re-download it"
        )
    library = logging.getLogger("diffusers")
    level = library.level
    library.setLevel(logging.ERROR)
    try:
        with model_loads(model_cls.__name__), readable_weights(folder):
            model, info = model_cls.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    finally:
        library.setLevel(level)
    check_weights_match(folder, info["missing_keys"], (), info["mismatched_keys"])
    if extra := info["unexpected_keys"]:
        log.warning("%s: skipped %d weights %s has no use for: %s%s", folder, len(extra), model_cls.__name__,
                    sorted(extra)[:5], " ..." if len(extra) > 5 else "")  # fmt: skip
    return model


def check_weights_match(
    folder: Path | str, missing: Sequence[str], unexpected: Sequence[str], mismatched: Sequence[str] = ()
) -> None:
    """A CheckpointError naming the keys (five of each kind) when a component's weights are not the model's: a
    missing one would stay random (or on the meta device), an unexpected one would be ignored."""
    problems = [f"{what} {list(keys[:5])}" + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
                for what, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mismatched))
                if keys]  # fmt: skip
    if problems:
        raise CheckpointError(
            f"{folder}: its weights do not match the model: {'; '.join(problems)}; re-download it"
        )


def default_tiny_checkpoint() -> Path:
    """The embedded default model: a tiny random checkpoint, written once (atomically) and reused. A cache
    folder that cannot hold it (XDG_CACHE_HOME a file, a read-only home, a full disk: an OSError, or
    safetensors' SafetensorError from the weights' write) is a CheckpointError naming the folder, the reason
    and how to pick another (it had been a traceback). The folder being written is removed whatever stops
    it (a failure, Ctrl-C, SIGTERM), so only a complete checkpoint is ever left in the cache."""
    import shutil

    from safetensors import SafetensorError

    from worldserve.weights.tiny import make_tiny

    target = envs.cache_dir() / f"tiny-cosmos3-v{TINY_LAYOUT}-seed{TINY_SEED}"
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        try:
            if (target / "model_index.json").is_file():  # (is_file raises on a folder it may not search)
                return target
            make_tiny(tmp, seed=TINY_SEED)
        except (OSError, SafetensorError) as exc:
            raise _unusable_cache(exc) from None
        try:
            tmp.rename(target)
        except OSError as exc:  # another process won the race (its copy is identical), or the rename failed
            if not (target / "model_index.json").is_file():
                raise _unusable_cache(exc) from None
    finally:
        # (renamed: nothing there; anything else, KeyboardInterrupt included: the partial folder)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_failure_reason(exc: Exception) -> str:
    """Why writing a file failed, in a few words: an OSError's strerror ("No space left on device"), else the
    exception's text; safetensors' SafetensorError ("Error while serializing: I/O error: No space left on
    device (os error 28)") as the OSError it wraps would say it."""
    if strerror := getattr(exc, "strerror", None):
        return strerror
    text = str(exc)
    # (Rust's io::Error as Display prints it, "... (os error 28)", or as Debug, "Os { code: 28, ... }")
    if wrapped := re.search(r"\(os error (\d+)\)|\bOs \{ code: (\d+)", text):
        return os.strerror(int(wrapped[1] or wrapped[2]))
    return text or type(exc).__name__


def _unusable_cache(exc: Exception) -> CheckpointError:
    """The one-line error of a cache folder the embedded tiny checkpoint cannot be written to."""
    base = envs.cache_home()
    where = f"{envs.cache_dir()} (XDG_CACHE_HOME={base})" if base else str(envs.cache_dir())
    return CheckpointError(f"the cache folder {where} cannot hold the embedded tiny checkpoint: "
                           f"{write_failure_reason(exc)}; set XDG_CACHE_HOME to a writable folder (the cache is "
                           "$XDG_CACHE_HOME/worldserve, else ~/.cache/worldserve), or give a MODEL")  # fmt: skip


def _hf_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_model(ref: str | None, revision: str | None = None) -> Path:
    """A model reference -> a local checkpoint folder holding model_index.json."""
    if ref is None:
        return default_tiny_checkpoint()
    if not ref.strip():  # (Path("") is the current folder: `info "$UNSET"` named it "." )
        raise CheckpointError("the model is empty (an unset variable?): give a folder or a Hugging Face repo "
                              "id, or leave it out for the embedded tiny checkpoint")  # fmt: skip
    local = Path(ref).expanduser()
    if local.exists():
        if not (local / "model_index.json").is_file():
            raise CheckpointError(f"{local} is not a Cosmos3 checkpoint folder (no model_index.json)")
        if revision is not None:  # (as Hugging Face's loaders: a folder is read as it is)
            log.warning("--revision %s has no effect: %s is a local folder, read as it is", revision, local)
        return local.resolve()
    if ref.count("/") != 1 or ref.startswith((".", "/", "~")):
        raise CheckpointError(f"model {ref!r} is neither an existing folder nor a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = envs.hf_hub_offline()
    where = f"{ref} (revision {revision or 'main'})"
    try:
        path = snapshot_download(
            ref, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=offline
        )
    except HFValidationError as e:  # ('bad repo/x!!')
        raise CheckpointError(
            f"model {ref!r} is neither an existing folder nor a Hugging Face repo id"
        ) from e
    except LocalEntryNotFoundError as e:  # (offline; or online, when huggingface.co could not be reached)
        why = ("HF_HUB_OFFLINE=1 forbids downloading it" if offline
               else f"huggingface.co could not be reached to download it ({e.__cause__ or e})")  # fmt: skip
        raise CheckpointError(f"{where} is not in the Hugging Face cache {_hf_cache_dir()} and {why}") from e
    except HfHubHTTPError as e:  # a repo or revision that is not there, or one needing a token
        raise CheckpointError(f"{where}: {str(e).splitlines()[0]}") from e
    return Path(path)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointLayout:
    root: Path
    """The checkpoint folder."""
    components: tuple[str, ...]
    """Component folders present (transformer, vae, ...)."""
    model_index: dict
    """model_index.json."""
    transformer_config: Cosmos3Config
    """transformer/config.json parsed."""

    @property
    def has_sound(self) -> bool:
        return "sound_tokenizer" in self.components and bool(self.transformer_config.sound_gen)

    @property
    def has_vision(self) -> bool:
        return "vision_encoder" in self.components


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file that must hold an object; CheckpointError naming the file otherwise (broken JSON,
    or `null` / a list, ended in tracebacks)."""
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
        raise CheckpointError(f"{path}: not valid JSON ({e}); re-download it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(data).__name__}; re-download it")
    return data


def read_layout(root: Path) -> CheckpointLayout:
    """Check the folder has every generation component and parse the configs."""
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise CheckpointError(f"{root}: model_index.json is missing")
    index = read_json_object(index_path)
    missing = [c for c in GENERATION_COMPONENTS if not (root / c).is_dir()]
    if missing:
        raise CheckpointError(f"{root}: component folder(s) missing: {', '.join(missing)}")
    if (index.get("sound_tokenizer") or [None])[0] is not None and not (root / "sound_tokenizer").is_dir():
        # (a partial download: generation went on without the sound that is on by default)
        raise CheckpointError(f"{root}: model_index.json declares sound_tokenizer but its folder is missing; "
                              "re-download it (or set sound_tokenizer to [null, null] there for video only)")  # fmt: skip
    tok = root / "text_tokenizer"  # (without its files, the error came after loading, about missing tokens)
    if not (tok / "tokenizer.json").is_file() and not all(
        (tok / f).is_file() for f in ("vocab.json", "merges.txt")
    ):
        raise CheckpointError(f"{tok}: no tokenizer.json (nor vocab.json + merges.txt); re-download it")
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
    ):  # (a cut file failed in transformers, naming none)
        if (tok / name).is_file():
            read_json_object(tok / name)
    check_chat_template(tok / "chat_template.jinja")
    present = [c for c in GENERATION_COMPONENTS + OPTIONAL_COMPONENTS if (root / c).is_dir()]
    for component in present:  # (a broken vision_encoder/config.json was transformers' traceback, even for a
        if (root / component / "config.json").is_file():  # text-only chat)
            read_json_object(root / component / "config.json")
    if "sound_tokenizer" in present and (index.get("sound_tokenizer") or [None])[0] is None:
        present.remove("sound_tokenizer")
    return CheckpointLayout(
        root=root,
        components=tuple(present),
        model_index=index,
        transformer_config=read_transformer_config(root),
    )


def check_chat_template(path: Path) -> None:
    """CheckpointError naming `path` when the chat template there does not parse as Jinja (transformers
    compiles it at the first prompt: a traceback after minutes of loading); nothing when it is absent."""
    if not path.is_file():
        return
    import jinja2

    try:
        jinja2.Environment().parse(path.read_text(encoding="utf-8"))
    except (jinja2.TemplateSyntaxError, UnicodeDecodeError) as e:
        where = f", line {e.lineno}" if isinstance(e, jinja2.TemplateSyntaxError) else ""
        raise CheckpointError(f"{path}: not a valid Jinja template ({e}{where}); re-download it") from None


def read_transformer_config(root: Path) -> Cosmos3Config:
    """`root`/transformer/config.json parsed; CheckpointError naming the file when it is missing or broken."""
    cfg_path = root / "transformer" / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{root}: transformer/config.json is missing")
    try:
        return Cosmos3Config.from_dict(read_json_object(cfg_path))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
