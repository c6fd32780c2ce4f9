"""The LoRA flags: serve's `--enable-lora`, `--lora-path`, `--lora-scale` (config.py LoraConfig) parsed, checked
before the model loads (naming the flags, exit 2) and handed to the app as `worldserve serve` builds it (the static
adapter served to a request naming none); vLLM's `--lora-modules` still refused; generate's `--lora` /
`--lora-scale` into VideoParams, bad values exit 2 naming the flag before any model work."""

from __future__ import annotations

import logging
import os
import re

import pytest
from cli_helpers import run_cli
from test_api_videos import RecordingBackend
from test_serve_compat_flags import config, parse_args, serving

from worldserve.commands import serve
from worldserve.config import LoraConfig
from worldserve.params import LoraRequest


def test_the_flags_become_the_apps_lora_options(tmp_path, monkeypatch):
    """--enable-lora and --lora-path / --lora-scale reach build_app's options (the path made absolute: a job
    re-run after a restart from another folder finds it); by default: no adapters at all."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "style").mkdir()
    cfg = config("--enable-lora", "--lora-path", "style", "--lora-scale", "0.5")
    assert (cfg.lora.enable_lora, cfg.lora.lora_path, cfg.lora.lora_scale) == (True, "style", 0.5)
    options = serve.app_settings(cfg)
    assert options.lora.per_request is True
    assert options.lora.static == LoraRequest(name="static", path=str(tmp_path / "style"), scale=0.5)
    assert serve.app_settings(config("--lora-path", "/srv/a.safetensors")).lora.static == LoraRequest(
        "static", "/srv/a.safetensors", 1.0
    )
    plain = serve.app_settings(config())
    assert (plain.lora.per_request, plain.lora.static) == (False, None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-scale", "0.5"], "--lora-scale scales the --lora-path adapter: give --lora-path too"),
        (["--enable-lora", "--lora-scale", "2"], "--lora-scale scales the --lora-path adapter"),
        (["--lora-path", "/a", "--lora-scale", "nan"], "--lora-scale must be a finite number, got nan"),
        (["--lora-path", "/a", "--lora-scale=-inf"], "--lora-scale must be a finite number, got -inf"),
        (["--lora-path", ""], "--lora-path: an empty path"),
    ],
)
def test_bad_lora_flags_are_refused_naming_them(argv, message):
    with pytest.raises(ValueError) as error:
        config(*argv)
    assert str(error.value).startswith(message), error.value


def test_a_missing_adapter_stops_the_start_before_the_model_loads(tmp_path, monkeypatch, caplog):
    """--lora-path with nothing there: one line naming it, exit 2, before anything binds or loads (the adapter's
    own files are checked per request, by the backend)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    missing = tmp_path / "no-such-adapter"
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        assert serve.run(parse_args("--backend", "fake", "--lora-path", str(missing))) == 2
    assert f"--lora-path {missing}: no such file or folder" in caplog.text
    LoraConfig(lora_path=str(tmp_path)).check_path()  # (a folder that is there passes)
    with pytest.raises(ValueError, match="--lora-path"):
        LoraConfig(lora_path=str(missing)).check_path()
    with pytest.raises(
        ValueError, match="^--lora-path hf://o/a: a URL: give the adapter's local file or folder$"
    ):
        LoraConfig(lora_path="hf://o/a").check_path()  # (it said "no such file or folder")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_builds_the_app_with_the_static_adapter(tmp_path, monkeypatch, anyio_backend):
    """The app `worldserve serve --lora-path P --lora-scale S` builds runs a request naming no adapter with
    ("static", P, S), and refuses one naming its own (no --enable-lora)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    backend = RecordingBackend()
    argv = ("--lora-path", str(adapter), "--lora-scale", "0.25")
    small = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "1"}
    async with serving(tmp_path, monkeypatch, *argv, backend=backend) as http:
        assert (await http.post("/v1/videos/sync", data=small)).status_code == 200
        own = await http.post("/v1/videos/sync", json={**small, "lora": {"name": "a", "path": str(adapter)}})
        assert own.status_code == 400 and own.json()["error"]["param"] == "lora"
    assert [p.lora for p in backend.params] == [LoraRequest("static", str(adapter), 0.25)]


def test_vllms_lora_flags_are_real_ones_now():
    """`serve --help` lists the three flags in their own group with their help; --lora-modules stays refused
    (worldserve names adapters by path), with what to do instead."""
    from worldserve.cli import build_parser

    argv = ["serve", "--help"]
    (sub,) = [
        a for a in build_parser(argv)._actions if hasattr(a, "choices") and "serve" in (a.choices or {})
    ]
    text = " ".join(sub.choices["serve"].format_help().split())
    group = text[text.index("LoraConfig:") : text.index("MediaConfig:")]
    assert (
        "--enable-lora, --no-enable-lora Let video and image requests name a LoRA adapter of their own"
        in group
    )
    assert "--lora-path PATH A LoRA adapter" in group and "--lora-scale LORA_SCALE The scale of" in group
    with pytest.raises(ValueError, match=r"^--lora-modules .*--enable-lora.*--lora-path"):
        config("--lora-modules", "a=/srv/a")


def generate(tmp_path, *argv: str):
    """`worldserve generate` with a small request and `argv`, in this process (tests/cli_helpers.py)."""
    return run_cli("generate", "--prompt", "a cat", "--size", "64x48", "--num-frames", "5", *argv,
                   "-o", tmp_path / "x.mp4")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "flag", "message"),
    [
        (["--lora", "/no/such/adapter"], "--lora", "/no/such/adapter: no such file or folder"),
        (["--lora", "https://hf.co/x/y"], "--lora", "https:/hf.co/x/y: a URL: give the adapter's local file"),
        (["--lora-scale", "0.5"], "--lora-scale", "--lora-scale scales a --lora adapter: give --lora too"),
        (["--lora", ".", "--lora-scale", "nan"], "--lora-scale", "--lora-scale must be a finite number, got nan"),
        (["--lora", ".", "--lora-scale", "inf"], "--lora-scale", "--lora-scale must be a finite number, got inf"),
    ],
)  # fmt: skip
def test_generates_bad_lora_flags_exit_2_naming_the_flag(tmp_path, argv, flag, message):
    """One line naming the flag, exit 2, before any model work (the request's checks come before a checkpoint
    is resolved)."""
    proc = generate(tmp_path, *argv)
    assert proc.returncode == 2, proc.stderr
    assert re.search(f"worldserve generate: error: {re.escape(flag)}[: ]", proc.stderr), proc.stderr
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "x.mp4").exists()


def test_generates_lora_flags_become_the_requests_adapter(tmp_path, monkeypatch):
    """--lora PATH [--lora-scale S]: named after its folder (a file: its name less the suffix), at its absolute
    path, scale 1.0 by default; no --lora: the base model."""
    from worldserve.cli import build_parser
    from worldserve.commands.generate_params import build_params

    def lora(*argv: str) -> LoraRequest | None:
        argv = ("generate", "--prompt", "a cat", "-o", "x.mp4", *argv)
        return build_params(build_parser(list(argv)).parse_args(list(argv))).lora

    monkeypatch.chdir(tmp_path)
    (tmp_path / "pixel-art").mkdir()
    (tmp_path / "pixel-art" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    (tmp_path / "noir.safetensors").write_bytes(b"")
    assert lora("--lora", "pixel-art") == LoraRequest("pixel-art", str(tmp_path / "pixel-art"), 1.0)
    assert lora("--lora", "pixel-art/", "--lora-scale", "0") == LoraRequest(
        "pixel-art", str(tmp_path / "pixel-art"), 0.0
    )
    assert lora("--lora", "noir.safetensors", "--lora-scale", "0.8") == LoraRequest(
        "noir", os.path.join(tmp_path, "noir.safetensors"), 0.8
    )
    assert lora() is None
