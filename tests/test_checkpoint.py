"""Foundation: the tiny checkpoint's layout, determinism, diffusers / transformers loading, and loader errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from cli_helpers import run_cli
from safetensors.torch import load_file, save_file

from worldserve.models.cosmos3.checkpoint_keys import (
    count_parameters,
    loaded_checkpoint_shapes,
    transformer_checkpoint_shapes,
)
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.weights.checkpoint import CheckpointError, read_layout, resolve_model
from worldserve.weights.loader import check_checkpoint, read_header, stream_tensors
from worldserve.weights.safetensors_shards import write_sharded

PREFIX = "diffusion_pytorch_model"


def _all_files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_matches_the_released_repo(tiny_ckpt):
    for rel in (
        "model_index.json",
        "config.json",
        "model.safetensors.index.json",
        "transformer/config.json",
        f"transformer/{PREFIX}.safetensors.index.json",
        "vae/config.json",
        "sound_tokenizer/config.json",
        "text_tokenizer/tokenizer.json",
        "vision_encoder/model.safetensors",
        "scheduler/scheduler_config.json",
    ):
        assert (tiny_ckpt / rel).is_file(), rel
    assert len(list((tiny_ckpt / "transformer").glob(f"{PREFIX}-*-of-*.safetensors"))) > 1
    layout = read_layout(tiny_ckpt)
    assert layout.has_sound and layout.has_vision
    root_index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert root_index["layers.0.self_attn.to_q.weight"].startswith("transformer/")
    assert root_index["blocks.0.attn.qkv.weight"] == "vision_encoder/model.safetensors"


def test_make_tiny_is_deterministic(tmp_path):
    """A real `worldserve make-tiny` subprocess and two runs in this process: the same seed writes the same
    bytes across processes, another seed other bytes."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    subprocess.run([sys.executable, "-m", "worldserve.cli", "make-tiny", str(a), "--seed", "3", "--no-vision"],
                   check=True, capture_output=True)  # fmt: skip
    for d, seed in ((b, 3), (c, 4)):
        assert run_cli("make-tiny", d, "--seed", seed, "--no-vision").returncode == 0
    assert _all_files(a) == _all_files(b)
    assert _all_files(a) != _all_files(c)
    assert not (a / "vision_encoder").exists()


def test_make_tiny_where_no_folder_can_be_is_one_line(tmp_path, capsys):
    """A DIR that is a file or under one is a bad argument: one line and argparse's exit code 2 (was 1),
    before anything is written."""
    from worldserve.cli import main

    (tmp_path / "file").write_text("x")
    for target in (tmp_path / "file", tmp_path / "file" / "under"):
        assert main(["make-tiny", str(target), "--no-vision"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"worldserve make-tiny: error: DIR {target}") and "is not a directory" in err
        assert err.count("\n") == 1


def test_make_tiny_refuses_a_folder_with_files_and_an_empty_dir(tmp_path, capsys):
    """make-tiny wrote into a folder with files (a real checkpoint's weights replaced by random ones) and, for
    DIR '', into the current folder; now both are one line and exit 2, nothing written; --force writes."""
    from worldserve.cli import main

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "model_index.json").write_text("{}")
    for target in (str(kept), ""):
        assert main(["make-tiny", target, "--no-vision", "--no-sound"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("worldserve make-tiny: error: DIR") and err.count("\n") == 1, err
    assert [p.name for p in kept.iterdir()] == ["model_index.json"] and (
        kept / "model_index.json"
    ).read_text() == "{}"
    assert main(["make-tiny", str(kept), "--no-vision", "--no-sound", "--force"]) == 0
    assert (kept / "transformer").is_dir() and (kept / "model_index.json").read_text() != "{}"
    assert main(["make-tiny", str(kept), "--force"]) == 0
    assert {"vision_encoder", "sound_tokenizer"} <= {p.name for p in kept.iterdir()}
    (kept / "notes.txt").write_text("mine")
    assert main(["make-tiny", str(kept), "--no-vision", "--no-sound", "--force"]) == 0  # (they stayed behind)
    assert not (kept / "vision_encoder").exists() and not (kept / "sound_tokenizer").exists()
    assert (kept / "notes.txt").read_text() == "mine"  # (only the checkpoint's own folders are replaced)
    assert "vision_encoder" not in run_cli("info", kept).stdout


def test_an_interrupted_make_tiny_leaves_nothing(tmp_path, monkeypatch):
    """A new DIR is written beside it and renamed when complete: Ctrl-C (or a failure) midway left a
    half-written folder that info called "not a Cosmos3 checkpoint" and only --force could fill."""
    from worldserve.weights import tiny

    def interrupted(out, *a, **k):
        (out / "transformer").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "make_tiny", interrupted)
    assert run_cli("make-tiny", tmp_path / "new" / "ckpt").returncode == 130  # (main's "interrupted")
    assert list((tmp_path / "new").iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "empty").mkdir()  # (an empty DIR is filled the same way)
    assert run_cli("make-tiny", tmp_path / "empty", "--no-vision", "--no-sound").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]
    assert run_cli("info", tmp_path / "empty").returncode == 0


@pytest.mark.parametrize(
    "verb", [["make-tiny", "DIR"], ["chat", "--message", "hi"], ["generate", "--prompt", "x"]]
)
def test_a_seed_past_int64_is_a_usage_error(tmp_path, capsys, verb):
    """chat and make-tiny failed with a traceback after loading (make-tiny with half a folder written)."""
    from worldserve.cli import main

    argv = [str(tmp_path / "t") if a == "DIR" else a for a in verb]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--seed", "9" * 20])
    assert info.value.code == 2 and "argument --seed: must be in [-2**63, 2**63)" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_no_sound_variant(tmp_path):
    from worldserve.weights.tiny import make_tiny

    root = make_tiny(tmp_path / "ns", sound=False, vision=False)
    layout = read_layout(root)
    assert not layout.has_sound and "sound_tokenizer" not in layout.components
    assert not any("audio" in k for k in read_header(root / "transformer", PREFIX).shapes)


def test_a_declared_sound_tokenizer_missing_is_a_partial_download(tiny_copy):
    """model_index.json declares sound_tokenizer and its folder is gone (a partial download): a CheckpointError
    naming it, where generation went on without the sound that is on by default; declared null, the
    checkpoint is video-only as make-tiny --no-sound writes it."""
    import shutil

    shutil.rmtree(tiny_copy / "sound_tokenizer")
    with pytest.raises(CheckpointError, match="declares sound_tokenizer but its folder is missing"):
        read_layout(tiny_copy)
    index = json.loads((tiny_copy / "model_index.json").read_text())
    (tiny_copy / "model_index.json").write_text(json.dumps({**index, "sound_tokenizer": [None, None]}))
    assert not read_layout(tiny_copy).has_sound


def test_nano_shapes_are_cosmos3_nano(tmp_path):
    """`make-tiny --shapes nano` (~32 GB, not written here) sizes every component as the real Nano: the
    transformer config, the Wan2.2 VAE's widths, a 0.58B Qwen3-VL-8B ViT projecting into d_model 4096, 5 GB
    transformer shards (bench/reasoner_parity.py writes and runs it on the GPU)."""
    from diffusers import AutoencoderKLWan
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.weights.tiny import SHAPES

    nano = SHAPES["nano"]
    assert nano.transformer(300, True) == Cosmos3Config.nano()
    assert not nano.transformer(300, False).sound_gen
    assert nano.shard_bytes == 5 * 2**30
    with torch.device("meta"):
        vit = Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**nano.vision, out_hidden_size=4096))
        vae = AutoencoderKLWan(**nano.vae)
    assert 0.57e9 < sum(p.numel() for p in vit.parameters()) < 0.59e9
    assert vae.config.base_dim == 160 and vae.config.decoder_base_dim == 256 and vae.config.z_dim == 48


def test_diffusers_loads_tiny_with_every_key(tiny_ckpt):
    from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer

    model, info = Cosmos3OmniTransformer.from_pretrained(
        tiny_ckpt, subfolder="transformer", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = transformer_checkpoint_shapes(Cosmos3Config.from_json(tiny_ckpt / "transformer" / "config.json"))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == theirs
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
    assert pipe.sound_tokenizer is not None and pipe.vae.config.z_dim == 48


def test_key_table_matches_diffusers_at_nano_size():
    from diffusers import Cosmos3OmniTransformer

    cfg = Cosmos3Config.nano()
    with torch.device("meta"):
        model = Cosmos3OmniTransformer(**cfg.to_dict())
    assert transformer_checkpoint_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert abs(count_parameters(cfg) / 1e9 - 15.2) < 0.1


def test_reasoner_subset_loads_strictly_in_qwen3vl(tiny_ckpt):
    from worldserve.bench.reasoner_oracle import qwen3vl_oracle, reasoner_state

    model, result = qwen3vl_oracle(tiny_ckpt)
    state = reasoner_state(tiny_ckpt)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])


def test_sharded_equals_unsharded(tiny_copy):
    folder = tiny_copy / "transformer"
    header = read_header(folder, PREFIX)
    sharded = dict(stream_tensors(header, header.shapes, progress=False))
    for f in folder.glob(f"{PREFIX}*"):
        f.unlink()
    write_sharded(folder, PREFIX, sharded, max_shard_bytes=1 << 40)
    assert (folder / f"{PREFIX}.safetensors").is_file()
    single = read_header(folder, PREFIX)
    assert single.shapes == header.shapes
    for k, t in stream_tensors(single, single.shapes, progress=False):
        assert torch.equal(t, sharded[k]), k


def _expected(root):
    return transformer_checkpoint_shapes(Cosmos3Config.from_json(root / "transformer" / "config.json"))


def _rewrite_first_shard(root, edit, holding=None):
    """Rewrite one shard (the first, or the one holding key `holding`) through `edit`, keeping the index true."""
    folder = root / "transformer"
    shard = sorted(folder.glob(f"{PREFIX}-*.safetensors"))[0]
    if holding is not None:
        shard = read_header(folder, PREFIX).files[holding]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)
    index_path = folder / f"{PREFIX}.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: shard.name for k in tensors})
    index_path.write_text(json.dumps(index))
    return shard, tensors


def test_missing_shard_is_named(tiny_copy):
    shard = sorted((tiny_copy / "transformer").glob(f"{PREFIX}-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        read_header(tiny_copy / "transformer", PREFIX)


def test_wrong_shape_missing_and_unexpected_keys_are_one_error(tiny_copy):
    def edit(t):
        key = next(k for k in t if k.endswith("weight") and t[k].ndim == 2)
        t[key] = t[key][:, :-1].contiguous()

    _rewrite_first_shard(tiny_copy, edit)
    with pytest.raises(CheckpointError, match="wrong shapes"):
        check_checkpoint(read_header(tiny_copy / "transformer", PREFIX), _expected(tiny_copy), "t")
    expected = dict(_expected(tiny_copy))
    expected["layers.9.extra.weight"] = (4,)
    del expected["norm.weight"]
    with pytest.raises(
        CheckpointError, match=r"1 missing keys: layers\.9\.extra\.weight.*1 unexpected keys: norm"
    ):
        check_checkpoint(read_header(tiny_copy / "transformer", PREFIX), expected, "t")


def test_truncated_safetensors_is_named(tiny_copy):
    shard = sorted((tiny_copy / "transformer").glob(f"{PREFIX}-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*unreadable"):
        read_header(tiny_copy / "transformer", PREFIX)


def _cut(path, size):
    path.write_bytes(path.read_bytes()[:size])


def _config_with(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


BROKEN = [  # (what to break, the file the one line must name) -- each ended in a traceback
    (lambda r: (r / "model_index.json").write_text('{"_class_name": \n'), "model_index.json"),
    (lambda r: (r / "model_index.json").write_text("null"), "model_index.json"),
    (lambda r: (r / "transformer" / "config.json").write_text("[]"), "config.json"),
    (lambda r: _config_with(r / "transformer" / "config.json", action_dim="abc"), "action_dim"),
    (lambda r: _config_with(r / "transformer" / "config.json", head_dim=-4), "head_dim"),
    (lambda r: (r / "transformer" / f"{PREFIX}.safetensors.index.json").write_text('{"weight_map": 5}'), "index.json"),
    (lambda r: _cut(r / "vae" / f"{PREFIX}.safetensors", 20), "vae"),
    (lambda r: (r / "text_tokenizer" / "tokenizer.json").unlink(), "text_tokenizer: no tokenizer.json"),
    (lambda r: (r / "text_tokenizer" / "tokenizer.json").write_text("xx"), "tokenizer.json: not valid JSON"),
    # (info passed it, 0 parameters, exit 0; generate named the missing keys)
    (lambda r: (r / "transformer" / f"{PREFIX}.safetensors.index.json").write_text('{"weight_map": {}}'), "missing keys"),
    # (these two loaded and failed later: a jinja2 traceback at the first prompt, transformers' at the ViT)
    (lambda r: (r / "text_tokenizer" / "chat_template.jinja").write_text("{% if %}"), "chat_template.jinja: not a valid Jinja"),
    (lambda r: (r / "vision_encoder" / "config.json").write_text("{"), "vision_encoder/config.json: not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("brk", "named"), BROKEN, ids=[str(i) for i in range(len(BROKEN))])
def test_a_broken_checkpoint_is_one_line_naming_the_file(tiny_copy, brk, named):
    brk(tiny_copy)
    r = run_cli("info", tiny_copy)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and named in r.stderr, r.stderr
    assert r.stderr.startswith("worldserve info: error: ") and "Traceback" not in r.stderr


def test_unreadable_vae_and_vision_weights_are_checkpoint_errors(tiny_copy):
    """The loaders behind serve / generate / chat: diffusers' OSError and safetensors' error on a cut file
    were tracebacks (the CLI prints a CheckpointError as one line)."""
    from worldserve.models.cosmos3.vae import VideoVAE
    from worldserve.models.cosmos3.vision import VisionEncoder

    config = tiny_copy / "vae" / "config.json"
    kept = config.read_text()
    config.write_text("{}")  # diffusers' defaults then mismatch every shape: its ValueError was the message
    with pytest.raises(CheckpointError, match="vae: its config.json and weights disagree"):
        VideoVAE.from_pretrained(tiny_copy / "vae")
    config.write_text(kept)
    _cut(tiny_copy / "vae" / f"{PREFIX}.safetensors", 20)
    with pytest.raises(CheckpointError, match="vae.*unreadable"):
        VideoVAE.from_pretrained(tiny_copy / "vae")
    vision = tiny_copy / "vision_encoder" / "model.safetensors"
    _cut(vision, vision.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="model.safetensors.*unreadable weights"):
        VisionEncoder.from_pretrained(tiny_copy / "vision_encoder")


def _edit_weights(file, edit) -> str:
    """Rewrite a safetensors file with `edit` applied; the key it touched."""
    tensors = load_file(file)
    key = edit(tensors)
    save_file(tensors, file)
    return key


def _drop_one(t):
    key = sorted(t)[0]
    del t[key]
    return key


def _add_one(t):
    t["bogus.weight"] = torch.zeros(2)
    return "bogus.weight"


def _reshape_one(t):
    key = next(k for k in sorted(t) if t[k].ndim >= 1 and t[k].shape[0] > 1)
    t[key] = t[key][1:].contiguous()  # one row fewer
    return key


def _component_loader(component):
    from worldserve.models.cosmos3.audio_vae import AudioVAE
    from worldserve.models.cosmos3.vae import VideoVAE
    from worldserve.models.cosmos3.vision import VisionEncoder

    return {"vae": VideoVAE, "sound_tokenizer": AudioVAE, "vision_encoder": VisionEncoder}[component]


@pytest.mark.parametrize(
    ("component", "edit"),
    [(c, e) for c in ("vae", "sound_tokenizer", "vision_encoder") for e in (_drop_one, _reshape_one)]
    + [("vision_encoder", _add_one)],
)
def test_missing_and_mis_shaped_component_weights_are_named(tiny_copy, component, edit):
    """As the transformer's: a missing key of the VAE / sound tokenizer / ViT was a meta-device traceback
    ("Cannot copy out of meta tensor"), a mis-shaped ViT one a traceback; the ViT refuses extra keys too."""
    folder = tiny_copy / component
    key = _edit_weights(next(folder.glob("*.safetensors")), edit)
    with pytest.raises(CheckpointError, match=f"{component}: ") as err:
        _component_loader(component).from_pretrained(folder)
    assert key in str(err.value) and "re-download it" in str(err.value), err.value


@pytest.mark.parametrize("component", ["vae", "sound_tokenizer"])
def test_an_extra_key_in_a_diffusers_component_is_skipped_as_diffusers_skips_it(tiny_copy, component, caplog):
    """diffusers loads a VAE / sound tokenizer with keys its class has not (e.g. an audio encoder's), naming
    them in a warning: so do we, the weights it has loaded as they are."""
    folder = tiny_copy / component
    _edit_weights(next(folder.glob("*.safetensors")), _add_one)
    with caplog.at_level("WARNING"):
        _component_loader(component).from_pretrained(folder)
    assert "bogus.weight" in caplog.text


@pytest.mark.parametrize("component", ["vae", "sound_tokenizer"])
def test_a_diffusers_component_s_integer_tensor_or_missing_file_is_named(tiny_copy, component):
    """As the transformer's: a tensor that is not floating point is refused (diffusers cast it in silence),
    and a folder without its safetensors file is one error (diffusers went looking for a pickle file, with
    warnings, first)."""

    def to_int(t):
        key = sorted(t)[0]
        t[key] = t[key].to(torch.int32)
        return key

    folder = tiny_copy / component
    key = _edit_weights(folder / f"{PREFIX}.safetensors", to_int)
    with pytest.raises(
        CheckpointError, match=f"{component}: tensors that are not floating point: .*{key}: I32"
    ):
        _component_loader(component).from_pretrained(folder)
    (folder / f"{PREFIX}.safetensors").unlink()
    with pytest.raises(CheckpointError, match=f"no {PREFIX}.safetensors .* in .*{component}"):
        _component_loader(component).from_pretrained(folder)


def test_a_vae_missing_a_key_is_one_line_from_generate(tiny_copy):
    _edit_weights(tiny_copy / "vae" / f"{PREFIX}.safetensors", _drop_one)
    r = run_cli("generate", tiny_copy, "--prompt", "x", "--size", "32x32", "--num-frames", "1", "--steps", "1",
                "-o", tiny_copy / "o.png")  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]  # (after the transformer's loading progress)
    assert "vae: its weights do not match the model: missing ['decoder." in last and "error" in last, r.stderr


def test_a_tokenizer_without_a_chat_template_is_named_before_the_weights_load(tiny_copy, monkeypatch):
    """Every prompt goes through the chat template: without one, generation failed after the model had
    loaded, in transformers' words, naming no checkpoint."""
    import worldserve.runner.video_pipeline as vp

    (tiny_copy / "text_tokenizer" / "chat_template.jinja").unlink()
    monkeypatch.setattr(vp, "load_configured_transformer", lambda *a, **k: pytest.fail("loaded the weights"))
    with pytest.raises(CheckpointError, match="text_tokenizer: the tokenizer has no chat template"):
        vp.VideoPipeline.from_pretrained(tiny_copy, device="cpu")


def test_wrong_dtype_is_named(tiny_copy):
    def edit(t):
        key = next(k for k in t if t[k].ndim == 2)
        t[key] = t[key].to(torch.int32)
        edit.key = key

    _rewrite_first_shard(tiny_copy, edit)
    with pytest.raises(CheckpointError, match=f"non-float tensors: {edit.key}: I32"):
        check_checkpoint(read_header(tiny_copy / "transformer", PREFIX), _expected(tiny_copy), "t")


def test_fp8_checkpoint_is_detected_and_dequantised(tiny_copy):
    folder = tiny_copy / "transformer"
    original = dict(stream_tensors(read_header(folder, PREFIX), _expected(tiny_copy), progress=False))

    def edit(t):
        for key in [k for k in t if k.endswith("proj.weight") or k.endswith("to_q.weight")]:
            w = t[key].float()  # ModelOpt-style per-row scales
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0
            t[key] = (w / scale).to(torch.float8_e4m3fn)
            t[key[: -len("weight")] + "weight_scale"] = scale.squeeze(1)
            edit.keys.append(key)

    edit.keys = []
    _rewrite_first_shard(tiny_copy, edit, holding="layers.0.mlp.gate_proj.weight")
    header = read_header(folder, PREFIX)
    assert header.is_fp8 and edit.keys
    check_checkpoint(header, _expected(tiny_copy), "t")
    loaded = dict(stream_tensors(header, _expected(tiny_copy), progress=False))
    for key in edit.keys:
        ref = original[key].float()
        assert (loaded[key] - ref).norm() / ref.norm() < 0.05, key


def test_resolve_model_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        resolve_model("nvidia/Cosmos3-Nano")
    with pytest.raises(CheckpointError, match="no model_index.json"):
        resolve_model(str(tmp_path))
    for ref in (
        "not/a/repo/id",
        "bad repo/x!!",
        "~/nonexistent",
    ):  # (the last two: huggingface_hub tracebacks)
        with pytest.raises(CheckpointError, match="neither an existing folder"):
            resolve_model(ref)
    monkeypatch.chdir(tmp_path)  # (an empty model was the current folder)
    for ref in ("", " "):
        with pytest.raises(CheckpointError, match="the model is empty"):
            resolve_model(ref)


def test_a_revision_for_a_local_folder_is_said_to_do_nothing(tiny_ckpt, caplog):
    with caplog.at_level("WARNING"):
        assert resolve_model(str(tiny_ckpt), revision="v1") == tiny_ckpt.resolve()
    assert "--revision v1 has no effect" in caplog.text and "local folder" in caplog.text
    caplog.clear()
    resolve_model(str(tiny_ckpt))
    assert "--revision" not in caplog.text


def test_an_unreachable_hub_is_not_blamed_on_hf_hub_offline(tmp_path, monkeypatch):
    """Online, a download that cannot reach huggingface.co said 'HF_HUB_OFFLINE=1 forbids downloading it'."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(*args, **kwargs):
        raise LocalEntryNotFoundError("cannot find the files in the cache") from OSError(
            "Name or service not known"
        )

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(
        CheckpointError, match="huggingface.co could not be reached.*Name or service not known"
    ):
        resolve_model("nvidia/Cosmos3-Nano")


def test_resolve_model_finds_an_hf_cache_snapshot(tiny_ckpt, tmp_path, monkeypatch):
    from hf_cache import hf_cache_snapshot

    snap = hf_cache_snapshot(tiny_ckpt, tmp_path, monkeypatch)
    assert resolve_model("nvidia/Cosmos3-Nano") == snap


def test_info_cli_describes_the_checkpoint(tiny_ckpt):
    out = run_cli("info", tiny_ckpt, "--json").stdout
    info = json.loads(out)
    assert info["components"]["transformer"]["parameters"] == count_parameters(
        Cosmos3Config.from_json(tiny_ckpt / "transformer" / "config.json")
    )
    assert info["generation_defaults"]["num_frames"] == 189
    assert info["generation_defaults"]["generate_sound"] is True
    assert info["chat_defaults"]["temperature"] == 1.0 and info["chat_defaults"]["max_tokens"] is None
    assert info["chat_defaults"]["source"].startswith("vLLM's neutral defaults")
    assert info["runtime"]["attention"].startswith(("FlashAttention-3", "PyTorch SDPA"))
    # bf16 bytes of the tiny model: 2 per parameter it loads (+ fp32 parts): the checkpoint's but its action heads
    mem = info["transformer_memory"]
    loaded = loaded_checkpoint_shapes(Cosmos3Config.from_json(tiny_ckpt / "transformer" / "config.json"))
    assert mem["resident_gib"] * 2**30 >= 2 * sum(math.prod(s) for s in loaded.values())
    assert (
        0 < mem["offload_gpu_gib"] <= mem["resident_gib"]
    )  # 2 layers, 2 slots: every block stays on the GPU


def test_memory_plan_of_nano_matches_the_h200_measurement():
    """bench/results/offload-20261130-h200.json: 28.34 GiB resident, 4.05 GiB offloaded (allocator included)."""
    from worldserve.commands.info import memory_plan

    plan = memory_plan(Cosmos3Config.nano())
    assert 28.0 < plan["resident_gib"] < 28.34 and 3.7 < plan["offload_gpu_gib"] < 4.05
    assert plan["kv_bytes_per_token"] == 36 * 2 * 8 * 128 * 2  # 144 KiB: 36 layers, K and V, 8 heads of 128
    assert plan["kv_cache_gib"] == 2 * plan["kv_cache_offload_gib"] == 9.0  # 2 x 32768 tokens
    assert 25.9 < plan["offload_host_pinned_gib"] < 27.5  # 25.9 GiB of blocks, in power-of-two chunks
