"""LoRA adapter files as PEFT and diffusers write them, read with the scaling PEFT / diffusers give them: the oracle is
the tiny checkpoint's diffusers Cosmos3OmniTransformer with the adapter loaded through PEFT
(`PeftModel.from_pretrained`) or diffusers (`load_lora_adapter`), each LoRA layer's `r` and `scaling` read (no
forward: the velocities' parity is tests/test_lora.py's). A config without lora_alpha takes PEFT's default, a
pipeline-level diffusers file its `transformer.`-prefixed metadata, a PEFT folder's weights file named directly
its folder's config; a pair on a module that is not a linear is refused naming `lora`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.weights.lora_adapter import inspect_adapter

peft = pytest.importorskip("peft")

TARGETS = ["to_q", "add_v_proj", "proj_out"]


def _reference(tiny_ckpt):
    from diffusers import Cosmos3OmniTransformer

    return Cosmos3OmniTransformer.from_pretrained(
        str(tiny_ckpt), subfolder="transformer", dtype=torch.float32
    )


def _scalings(model) -> dict[str, tuple[int, float]]:
    """module -> (r, scaling) of every PEFT LoRA layer of `model` (names without PEFT's wrapper prefix)."""
    out = {}
    for name, mod in model.named_modules():
        scaling = getattr(mod, "scaling", None)
        if isinstance(scaling, dict) and "default" in scaling:
            out[name.removeprefix("base_model.model.")] = (mod.r["default"], float(scaling["default"]))
    return out


@pytest.fixture(scope="module")
def config(tiny_ckpt):
    return Cosmos3Config.from_json(tiny_ckpt / "transformer" / "config.json")


@pytest.fixture(scope="module")
def peft_saved(tiny_ckpt, tmp_path_factory):
    """An adapter as `get_peft_model(...).save_pretrained` writes it (r 4, alpha 16, a rank and an alpha
    pattern)."""
    folder = tmp_path_factory.mktemp("peft") / "adapter"
    model = peft.get_peft_model(
        _reference(tiny_ckpt),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, rank_pattern={"layers.1.self_attn.to_q": 2},
                        alpha_pattern={"add_v_proj": 3}),
    )  # fmt: skip
    model.save_pretrained(str(folder))
    return folder


def test_peft_saved_adapter_scaling_matches_peft(tiny_ckpt, config, peft_saved):
    """(Sanity: passes.) The PEFT-written folder as it is."""
    ours = inspect_adapter(str(peft_saved), config).modules
    assert ours == _scalings(peft.PeftModel.from_pretrained(_reference(tiny_ckpt), str(peft_saved)))


def test_config_without_lora_alpha_takes_pefts_default(tiny_ckpt, config, peft_saved, tmp_path):
    """An adapter_config.json that leaves lora_alpha out: PEFT's LoraConfig default (8) applies, so the scaling
    is 8 / r. worldserve takes lora_alpha = r (scaling 1): every delta off by 8 / r, silently."""
    folder = tmp_path / "no-alpha"
    folder.mkdir()
    shutil.copy(peft_saved / "adapter_model.safetensors", folder)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "target_modules": TARGETS, "rank_pattern": {"layers.1.self_attn.to_q": 2},
    }))  # fmt: skip
    want = _scalings(peft.PeftModel.from_pretrained(_reference(tiny_ckpt), str(folder)))
    assert want["layers.0.self_attn.to_q"] == (4, 2.0)  # (PEFT: lora_alpha 8)
    assert inspect_adapter(str(folder), config).modules == want


def test_pipeline_lora_file_reads_its_prefixed_metadata(tiny_ckpt, config, peft_saved, tmp_path):
    """diffusers' pipeline-level writer (LoraBaseMixin._save_lora_weights, what every `*Pipeline.save_lora_weights`
    and diffusers' LoRA training scripts call) prefixes the keys with `transformer.` and packs the LoraConfig
    in the header as `transformer.r`, `transformer.lora_alpha`, ... diffusers' load_lora_adapter(prefix=
    "transformer") strips the prefix from both. worldserve strips it from the keys only, finds no `r` /
    `lora_alpha`, and runs alpha = r (scaling 1 for every module instead of 4.0 / 8.0 / 0.75 here)."""
    from diffusers.loaders.lora_base import LoraBaseMixin

    tensors = {k.removeprefix("base_model.model."): v
               for k, v in load_file(str(peft_saved / "adapter_model.safetensors")).items()}  # fmt: skip
    lora_config = json.loads((peft_saved / "adapter_config.json").read_text())
    LoraBaseMixin._save_lora_weights(
        str(tmp_path / "pipe"), lora_layers={"transformer": tensors}, lora_metadata={"transformer": lora_config},
        weight_name="pytorch_lora_weights.safetensors",
    )  # fmt: skip
    ref = _reference(tiny_ckpt)
    ref.load_lora_adapter(str(tmp_path / "pipe"), weight_name="pytorch_lora_weights.safetensors",
                          prefix="transformer", adapter_name="default")  # fmt: skip
    want = _scalings(ref)
    assert want["layers.0.self_attn.to_q"] == (4, 4.0) and want["layers.0.self_attn.add_v_proj"] == (4, 0.75)
    assert inspect_adapter(str(tmp_path / "pipe"), config).modules == want


def test_weights_file_named_inside_a_peft_folder_keeps_its_config(config, peft_saved):
    """A request naming the PEFT folder's adapter_model.safetensors (not the folder) runs the same adapter with
    the config beside it ignored: lora_alpha / rank_pattern / alpha_pattern dropped, scaling 1 everywhere,
    silently (the folder's scaling: 4.0 / 8.0 / 0.75)."""
    folder = inspect_adapter(str(peft_saved), config)
    file = inspect_adapter(str(peft_saved / "adapter_model.safetensors"), config)
    assert file.identity == folder.identity  # (the same file: the cache key is the same too)
    assert file.modules == folder.modules


def test_an_adapter_on_a_norm_is_refused_naming_lora(config, tmp_path):
    """A (hand-made) pair on a layer's RMSNorm: its weight is 1-D, and inspect_adapter's `out_f, in_f = target`
    raises a bare ValueError ("not enough values to unpack") instead of the ParamError naming `lora` that
    every other unusable module gets (and load_static_lora only turns a ParamError into its --lora-path line)."""
    from safetensors.torch import save_file

    from worldserve.params import ParamError

    save_file({"layers.0.input_layernorm.lora_A.weight": torch.randn(2, 64),
               "layers.0.input_layernorm.lora_B.weight": torch.randn(64, 2)},
              str(tmp_path / "norm.safetensors"))  # fmt: skip
    with pytest.raises(ParamError) as err:
        inspect_adapter(str(tmp_path / "norm.safetensors"), config)
    assert err.value.param == "lora"


def test_a_fifo_named_as_the_weights_is_refused_before_it_is_opened(tiny_ckpt, tmp_path):
    """A FIFO named *.safetensors (named, or alone in a folder): safetensors' open blocks holding the GIL, which
    froze every thread of the server until someone wrote to it; it is refused as not a regular file. (In a
    subprocess: a regression would freeze the process that opens it.)"""
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / "a.safetensors")
    script = (
        "import sys\n"
        "from worldserve.models.cosmos3.config import Cosmos3Config\n"
        "from worldserve.params import ParamError\n"
        "from worldserve.weights.lora_adapter import inspect_adapter\n"
        "config = Cosmos3Config.from_json(sys.argv[1])\n"
        "try:\n"
        "    inspect_adapter(sys.argv[2], config)\n"
        "except ParamError as exc:\n"
        "    print(exc.param, exc)\n"
    )
    for path in (tmp_path / "a.safetensors", tmp_path):
        try:
            run = subprocess.run(
                [sys.executable, "-c", script, str(tiny_ckpt / "transformer" / "config.json"), str(path)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            with open(tmp_path / "a.safetensors", "wb"):  # (lets the blocked open end)
                pass
            pytest.fail(f"inspect_adapter({path}) blocked on the FIFO")
        assert run.stdout.startswith("lora ") and "not a regular file" in run.stdout, run.stdout + run.stderr


def test_a_peft_config_that_is_not_a_regular_file_is_refused(config, peft_saved, tmp_path):
    """adapter_config.json there as a dangling link (or a folder): read as no config, the adapter had run at
    another strength (lora_alpha = r) with a 200; it is a 400 naming lora."""
    from worldserve.params import ParamError

    folder = tmp_path / "adapter"
    folder.mkdir()
    shutil.copy(peft_saved / "adapter_model.safetensors", folder)
    (folder / "adapter_config.json").symlink_to(tmp_path / "gone.json")
    for path in (folder, folder / "adapter_model.safetensors"):
        with pytest.raises(ParamError) as err:
            inspect_adapter(str(path), config)
        assert err.value.param == "lora" and "adapter_config.json" in str(err.value)


@pytest.mark.parametrize(("value", "scale"), [(float("nan"), 1.0), (float("inf"), 1.0), (1.0, 1e39)])
def test_weights_not_finite_after_the_scaling_are_refused(config, peft_saved, tmp_path, value, scale):
    """NaN or inf in an adapter, or a scale that makes its deltas overflow: every video came out black with a
    200; loading refuses it, naming lora and the module."""
    from safetensors.torch import save_file

    from worldserve.params import ParamError
    from worldserve.weights.lora_adapter import load_adapter

    tensors = load_file(str(peft_saved / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = value
    folder = tmp_path / "adapter"
    folder.mkdir()
    shutil.copy(peft_saved / "adapter_config.json", folder)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    spec = inspect_adapter(str(folder), config)
    with pytest.raises(ParamError) as err:
        load_adapter(spec, scale, config, dtype=torch.float32, device=torch.device("cpu"))
    assert err.value.param == "lora" and "not all finite" in str(err.value)


def test_a_path_the_file_system_refuses_is_a_400(config):
    """A name longer than the file system takes (255 bytes): Path.exists raised OSError, a 500."""
    from worldserve.params import ParamError

    with pytest.raises(ParamError) as err:
        inspect_adapter("/tmp/" + "x" * 300, config)
    assert err.value.param == "lora" and "not a usable path" in str(err.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"rank_pattern": {"(": 2}}, "not a regular expression"),
        ({"alpha_pattern": ["x"]}, "alpha_pattern must be an object"),
        ({"alpha_pattern": {"to_q": float("nan")}}, "must be a finite number"),
        ({"lora_alpha": None}, "lora_alpha must be a finite number"),
        ({"lora_alpha": 10**400}, "lora_alpha must be a finite number"),
        ({"lora_alpha": float("inf")}, "lora_alpha must be a finite number"),
        ({"r": "4"}, "r must be a positive integer"),
        ({"rank_pattern": {"to_q": 2.5}}, "must be a positive integer"),
    ],
)
def test_config_values_peft_would_not_take_are_refused(config, peft_saved, tmp_path, change, needle):
    """Bad numbers or patterns in adapter_config.json: TypeErrors, regex errors and overflows had been 500s, a
    NaN or inf lora_alpha a black video with a 200, "r": "4" a refusal saying 'has rank 4, its config says 4'."""
    from worldserve.params import ParamError

    folder = tmp_path / "adapter"
    folder.mkdir()
    shutil.copy(peft_saved / "adapter_model.safetensors", folder)
    cfg = {**json.loads((peft_saved / "adapter_config.json").read_text()), **change}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ParamError) as err:
        inspect_adapter(str(folder), config)
    assert err.value.param == "lora" and needle in str(err.value), str(err.value)
