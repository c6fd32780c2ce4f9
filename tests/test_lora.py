"""LoRA adapters against diffusers + PEFT on the tiny checkpoint (float32, CPU).

diffusers' Cosmos3OmniTransformer takes a PEFT adapter (`add_adapter`, random non-zero B so every delta
counts) and saves it (`save_lora_adapter`: diffusers' file with its LoraConfig in the header); the same
tensors are also written as PEFT's folder (`adapter_config.json` + `adapter_model.safetensors`, keys under
`base_model.model.`). Our transformer loads either (weights/lora_adapter.py) and its velocities, the und
K/V of the prompt included, must match the PEFT-wrapped reference's; the adapter's checks refuse what it
cannot apply, naming `lora`.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_transformer_parity import make_case, reference_forward, rel

from worldserve.models.cosmos3.batch import GenBatch, GenItem
from worldserve.params import ParamError
from worldserve.weights.lora_adapter import inspect_adapter, load_adapter

peft = pytest.importorskip("peft")

TOL = 1e-5
EVERY_MODULE = [
    "to_q", "to_k", "to_v", "to_out", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "gate_proj",
    "up_proj", "down_proj", "proj_in", "proj_out", "linear_1", "linear_2", "audio_proj_in", "audio_proj_out",
]  # fmt: skip


def _adapted_reference(tiny_ckpt, folder, **lora_config):
    """diffusers' transformer with a fresh PEFT adapter (B random), saved by diffusers into `folder`."""
    from diffusers import Cosmos3OmniTransformer

    ref = Cosmos3OmniTransformer.from_pretrained(str(tiny_ckpt), subfolder="transformer", dtype=torch.float32)
    ref.add_adapter(peft.LoraConfig(init_lora_weights=True, **lora_config))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ref.save_lora_adapter(str(folder))
    return ref.eval()


def _as_peft_folder(diffusers_folder, peft_folder, lora_config: dict) -> None:
    """The same adapter in PEFT's own layout (what `PeftModel.save_pretrained` writes)."""
    tensors = load_file(str(diffusers_folder / "pytorch_lora_weights.safetensors"))
    peft_folder.mkdir()
    save_file(
        {f"base_model.model.{k}": v for k, v in tensors.items()},
        str(peft_folder / "adapter_model.safetensors"),
    )
    config = {"peft_type": "LORA", "bias": "none", **lora_config}
    (peft_folder / "adapter_config.json").write_text(json.dumps(config))


def _ours_vs_reference(ours, ref, lora, cases):
    caches = ours.prefill_und([c["ids"] for c in cases], lora=lora)
    items = [
        GenItem(latents=c["latents"], timestep=c["timestep"], und_cache=cache, fps=24.0, sound=c.get("sound"))
        for c, cache in zip(cases, caches, strict=True)
    ]
    out = ours(GenBatch.pack(items, config=ours.config, device="cpu"), lora=lora)
    errors = []
    for c, video, sound in zip(cases, out.video, out.sound, strict=True):
        ref_video, ref_sound = reference_forward(
            ref, c["ids"], c["latents"], c["timestep"], sound=c.get("sound")
        )
        errors.append(rel(video, ref_video))
        if sound is not None:
            errors.append(rel(sound, ref_sound))
    return errors


@pytest.fixture(scope="module")
def ours(tiny_ckpt):
    from worldserve.weights.loader import load_transformer

    return load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)


@pytest.mark.parametrize(
    "lora_config",
    [
        {"r": 4, "lora_alpha": 8, "target_modules": EVERY_MODULE},
        {"r": 3, "lora_alpha": 5, "target_modules": EVERY_MODULE, "use_rslora": True,
         "rank_pattern": {"add_k_proj": 2, "down_proj": 5}, "alpha_pattern": {"to_add_out": 1.5}},
        {"r": 2, "lora_alpha": 2, "target_modules": ["add_q_proj", "up_proj"]},  # parts of fused layers only
    ],
    ids=["every-module", "rslora-patterns", "some-parts"],
)  # fmt: skip
def test_adapter_matches_diffusers_peft(tiny_ckpt, ours, tmp_path, lora_config):
    ref = _adapted_reference(tiny_ckpt, tmp_path / "diffusers", **lora_config)
    _as_peft_folder(tmp_path / "diffusers", tmp_path / "peft", lora_config)
    ids, latents, sound = make_case(2, 31, (3, 3, 5), sound_frames=10)
    neg = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(3))
    cases = [
        dict(ids=ids, latents=latents, timestep=861, sound=sound),
        dict(ids=neg, latents=latents, timestep=861),
    ]
    base_errors = _ours_vs_reference(ours, ref, None, cases)
    assert min(base_errors) > 1e-3, (
        "the adapter must change the reference's output for this test to mean anything"
    )
    for folder in ("diffusers", "peft"):
        spec = inspect_adapter(str(tmp_path / folder), ours.config)
        lora = load_adapter(spec, 1.0, ours.config, dtype=torch.float32, device=torch.device("cpu"))
        assert max(_ours_vs_reference(ours, ref, lora, cases)) <= TOL, folder


def test_scale_multiplies_every_delta(tiny_ckpt, ours, tmp_path):
    """scale 0.5 == the reference with every lora_B halved; scale 0 == the base model."""
    config = {"r": 4, "lora_alpha": 4, "target_modules": EVERY_MODULE}
    ref = _adapted_reference(tiny_ckpt, tmp_path / "a", **config)
    ids, latents, sound = make_case(9, 21, (2, 4, 6), sound_frames=8)
    cases = [dict(ids=ids, latents=latents, timestep=500, sound=sound)]
    spec = inspect_adapter(str(tmp_path / "a"), ours.config)
    half = load_adapter(spec, 0.5, ours.config, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    assert max(_ours_vs_reference(ours, ref, half, cases)) <= TOL
    ref.disable_adapters()
    zero = load_adapter(spec, 0.0, ours.config, dtype=torch.float32, device=torch.device("cpu"))
    assert max(_ours_vs_reference(ours, ref, zero, cases)) <= TOL


def _write_adapter(folder, tensors: dict, config: dict | None = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    if config is None:
        save_file(tensors, str(folder / "pytorch_lora_weights.safetensors"))
    else:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, **config})
        )
    return str(folder)


def _pickled_peft_folder(folder) -> str:
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.bin").write_bytes(b"x")
    return str(folder)


def _pair(out_f: int, in_f: int, r: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(r, in_f), torch.randn(out_f, r)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such file or folder"),
        ("dora", "DoRA adapters are not supported"),
        ("unknown-module", "does not apply LoRA to: ['embed_tokens']"),
        ("shape", "do not fit its weight [64, 64]"),
        ("only-a", "has lora_A but not both"),
        ("strange-key", "not LoRA weights (lora_A / lora_B, lora_down / lora_up, alpha)"),
        ("rank-vs-config", "has rank 2, its config says 3"),
        ("pickle", "adapter_model.bin (pickle"),
        ("int-weights", "must be floating point"),
        ("rank-0", "has rank 0"),
        ("rank-0-kohya", "has rank 0"),
        ("twice", "has two A tensors"),
    ],
)
def test_refusals_name_lora(ours, tmp_path, case, message):
    q_a, q_b = _pair(64, 64)
    good = {
        "layers.0.self_attn.add_q_proj.lora_A.weight": q_a,
        "layers.0.self_attn.add_q_proj.lora_B.weight": q_b,
    }
    path = {
        "missing": lambda: str(tmp_path / "nowhere"),
        "dora": lambda: _write_adapter(tmp_path / "d", good, {"use_dora": True}),
        "unknown-module": lambda: _write_adapter(
            tmp_path / "u", {**good, "embed_tokens.lora_A.weight": torch.randn(2, 1291),
                             "embed_tokens.lora_B.weight": torch.randn(64, 2)}),
        "shape": lambda: _write_adapter(tmp_path / "s", {**good, "layers.0.self_attn.to_q.lora_A.weight": torch.randn(2, 32),
                                                         "layers.0.self_attn.to_q.lora_B.weight": torch.randn(64, 2)}),
        "only-a": lambda: _write_adapter(tmp_path / "o", {"layers.1.mlp.up_proj.lora_A.weight": torch.randn(2, 64)}),
        "strange-key": lambda: _write_adapter(tmp_path / "k", {**good, "layers.0.mlp.up_proj.lora_magnitude_vector": torch.ones(64)}),
        "rank-vs-config": lambda: _write_adapter(tmp_path / "r", good, {"r": 3}),
        "pickle": lambda: _pickled_peft_folder(tmp_path / "p"),
        "int-weights": lambda: _write_adapter(tmp_path / "i", {k: v.to(torch.int32) for k, v in good.items()}),
        # (rank 0 without a config, or with a kohya alpha: a ZeroDivisionError, a 500)
        "rank-0": lambda: _write_adapter(tmp_path / "z", {k: v[:0] if "lora_A" in k else v[:, :0] for k, v in good.items()}),
        "rank-0-kohya": lambda: _write_adapter(tmp_path / "zk", {
            "layers.0.mlp.up_proj.lora_down.weight": torch.randn(0, 64), "layers.0.mlp.up_proj.lora_up.weight": torch.randn(128, 0),
            "layers.0.mlp.up_proj.alpha": torch.tensor(1.0)}),
        # (the same module under two prefixes: one pair ran, the other was dropped in silence)
        "twice": lambda: _write_adapter(tmp_path / "t", {**good, **{f"transformer.{k}": v.clone() for k, v in good.items()}}),
    }[case]()  # fmt: skip
    with pytest.raises(ParamError) as err:
        inspect_adapter(path, ours.config)
    assert err.value.param == "lora" and message in err.value.message, err.value.message


def test_lm_head_is_skipped_and_parts_are_fused(ours, tmp_path):
    """A delta on the Reasoner's head does not stop a video adapter; q and v of one layer fuse into one pair
    whose k rows get no delta."""
    q, v = _pair(64, 64), _pair(32, 64, r=3)
    tensors = {
        "layers.1.self_attn.add_q_proj.lora_A.weight": q[0], "layers.1.self_attn.add_q_proj.lora_B.weight": q[1],
        "layers.1.self_attn.add_v_proj.lora_A.weight": v[0], "layers.1.self_attn.add_v_proj.lora_B.weight": v[1],
        "lm_head.lora_A.weight": torch.randn(2, 64), "lm_head.lora_B.weight": torch.randn(1291, 2),
    }  # fmt: skip
    spec = inspect_adapter(_write_adapter(tmp_path / "a", tensors), ours.config)
    assert sorted(spec.modules) == ["layers.1.self_attn.add_q_proj", "layers.1.self_attn.add_v_proj"]
    lora = load_adapter(spec, 2.0, ours.config, dtype=torch.float32, device=torch.device("cpu"))
    a, b = lora.tower(1, "gen")["qkv_proj"]
    assert (
        a.shape == (5, 64)
        and b.shape == (128, 5)
        and lora.tower(0, "gen") is None
        and lora.tower(1, "und") is None
    )
    x = torch.randn(3, 64)
    delta = (x @ a.T) @ b.T  # [3, q 64 | k 32 | v 32]
    # (no config: alpha = r). Values ~20 from differently blocked float32 GEMMs: 1e-4 absolute, not 1e-5
    torch.testing.assert_close(delta[:, :64], 2.0 * (x @ q[0].T) @ q[1].T, rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(delta[:, 64:96]) == 0
    torch.testing.assert_close(delta[:, 96:], 2.0 * (x @ v[0].T) @ v[1].T, rtol=1e-5, atol=1e-4)


def test_kohya_style_file_matches_its_peft_folder(ours, tiny_ckpt, tmp_path):
    """A trainer's kohya-style file (`diffusion_model.` prefix, lora_down / lora_up, a scalar alpha per module,
    float or integer, no config) is the same adapter as the PEFT folder with that lora_alpha: the same scalings
    and deltas (an integer alpha, which diffusers reads, had been refused: "must be one finite float")."""
    from pipeline_helpers import write_random_adapter

    folder = write_random_adapter(tmp_path / "peft", tiny_ckpt, rank=4, alpha=6.0)
    tensors = load_file(f"{folder}/adapter_model.safetensors")
    want = inspect_adapter(folder, ours.config)
    for alpha in (torch.tensor(6.0), torch.tensor(6, dtype=torch.int64)):
        kohya = {}
        for key, value in tensors.items():
            module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
            kohya[f"diffusion_model.{module}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
            kohya[f"diffusion_model.{module}.alpha"] = alpha.clone()
        (tmp_path / f"kohya-{alpha.dtype}").mkdir()
        save_file(kohya, str(tmp_path / f"kohya-{alpha.dtype}" / "style.safetensors"))
        got = inspect_adapter(str(tmp_path / f"kohya-{alpha.dtype}"), ours.config)
        assert got.modules == want.modules and next(iter(got.modules.values())) == (4, 1.5)
    cpu = torch.device("cpu")
    a = load_adapter(want, 1.0, ours.config, dtype=torch.float32, device=cpu)
    b = load_adapter(got, 1.0, ours.config, dtype=torch.float32, device=cpu)
    torch.testing.assert_close(b.tower(1, "gen")["qkv_proj"][1], a.tower(1, "gen")["qkv_proj"][1])
    torch.testing.assert_close(b.top["proj_out"][1], a.top["proj_out"][1])
