"""A LoRA adapter merged into the weights as they load (KernelOptions.merged_lora: serve's --lora-path without
--enable-lora, `generate --lora`), float32 on the CPU, tiny checkpoint: its requests equal the unmerged
adapter's (which equals diffusers + PEFT, test_lora_pipeline.py), alone, under layerwise offload and under
tensor parallelism; only the gen pathway's weights change (the Reasoner's und tower stays the base model's, the
adapter's und deltas run unmerged in the prefill); the merged model refuses every other adapter and the base
model by name; its files are not read again; serve merges only without --enable-lora.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_helpers import rel, run_requests, two_rank_cpu_pipeline, write_random_adapter

from worldserve.params import LoraRequest, ParamError, VideoParams
from worldserve.runner.kernel_options import KernelOptions

BASE = dict(negative_prompt="blurry", num_inference_steps=3, num_frames=9, height=48, width=80)


@pytest.fixture(scope="module")
def lora(tiny_ckpt, tmp_path_factory) -> LoraRequest:
    return LoraRequest(
        "fox", write_random_adapter(tmp_path_factory.mktemp("lora") / "fox", tiny_ckpt, seed=8), 0.75
    )


def _load(ckpt, lora: LoraRequest, **kernels):
    from worldserve.runner.video_pipeline import VideoPipeline

    options = KernelOptions(compile=False, merged_lora=lora, **kernels)
    return VideoPipeline.from_pretrained(
        ckpt, device="cpu", dtype=torch.float32, progress=False, kernels=options
    )


@pytest.fixture(scope="module")
def merged(tiny_ckpt, lora):
    return _load(tiny_ckpt, lora)


def _batch(lora: LoraRequest | None) -> list[VideoParams]:
    return [
        VideoParams(prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=True,
                    lora=lora, **BASE),
        VideoParams(prompt="The scene moves.", guidance_scale=4.0, seed=7, generate_sound=False, lora=lora,
                    image=np.random.default_rng(7).integers(0, 256, (48, 80, 3), dtype=np.uint8), **BASE),
    ]  # fmt: skip


def _assert_same(runs, expected) -> None:
    for (lat, snd, res), (lat1, snd1, res1) in zip(runs, expected, strict=True):
        assert rel(lat, lat1) <= 1e-5
        assert (snd is None) == (snd1 is None) and (snd is None or rel(snd, snd1) <= 1e-5)
        np.testing.assert_allclose(res.frames.astype(int), res1.frames.astype(int), atol=1)


def test_merged_requests_equal_the_unmerged_adapters(merged, ours_pipeline, lora):
    batch = _batch(lora)
    unmerged = run_requests(ours_pipeline, batch)
    _assert_same(run_requests(merged, batch), unmerged)
    plain = run_requests(ours_pipeline, _batch(None))
    assert rel(plain[0][0], unmerged[0][0]) > 1e-2  # (the adapter mattered)


def test_only_the_gen_pathway_changes(merged, ours_pipeline, lora):
    """The gen tower's four linears and the top linears carry the deltas; the und tower, embeddings, norms and
    lm_head are the base model's bit for bit (the Reasoner's chats run on them); the und deltas stay unmerged."""
    base = dict(ours_pipeline.transformer.named_parameters())
    changed = {n for n, p in merged.transformer.named_parameters() if not torch.equal(p, base[n])}
    gen = {f"layers.{i}.gen.{lin}.weight" for i in range(len(merged.transformer.layers))
           for lin in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}  # fmt: skip
    top = {f"{m}.weight" for m in ("proj_in", "proj_out", "time_embedder.linear_1", "time_embedder.linear_2",
                                   "audio_proj_in", "audio_proj_out")}  # fmt: skip
    assert changed == gen | top
    rest = merged.transformer.merged_lora.rest
    assert rest is not None and not rest.top
    assert all(set(layer) == {"und"} for layer in rest.layers)
    assert merged.loras.get(lora) is rest and merged.loras.check(lora) is None


OTHERS = {
    "another adapter": lambda lora: dataclasses.replace(lora, path=lora.path + "-other"),
    "another scale": lambda lora: dataclasses.replace(lora, scale=0.5),
    "scale 0": lambda lora: dataclasses.replace(lora, scale=0.0),
    "no adapter": lambda lora: None,
}


@pytest.mark.parametrize("other", list(OTHERS))
def test_the_merged_model_refuses_other_adapters_and_the_base_model(merged, lora, other):
    request = OTHERS[other](lora)
    for call in (merged.loras.check, merged.loras.get):
        with pytest.raises(ParamError, match="merged into its weights") as err:
            call(request)
        assert err.value.param == "lora" and lora.path in err.value.message
    with pytest.raises(ParamError, match="it runs no other adapter, nor the base model"):
        merged.validate(VideoParams(prompt="a cat", lora=request, **BASE))
    assert (
        merged.loras.get(dataclasses.replace(lora, name="another name")) is not None
    )  # (names do not count)


def test_merged_under_layerwise_offload_and_with_its_files_gone(tiny_ckpt, merged, lora, tmp_path):
    """Merged before the layers are packed into host memory; once merged, the adapter's files are not read again
    (what runs is what was merged): removing them changes nothing."""
    copy = dataclasses.replace(lora, path=str(shutil.copytree(lora.path, tmp_path / "fox")))
    offloaded = _load(tiny_ckpt, copy, layerwise_offload=True)
    assert offloaded.transformer.gen_blocks is not None
    shutil.rmtree(copy.path)
    batch = _batch(copy)[:1]
    _assert_same(
        run_requests(offloaded, batch), run_requests(merged, [dataclasses.replace(batch[0], lora=lora)])
    )


def test_merging_goes_before_quantising_and_happens_once(merged, lora):
    from worldserve.runner.lora_cache import merge_lora

    with pytest.raises(ValueError, match="merged into this model already"):
        merge_lora(merged.transformer, lora, torch.device("cpu"))
    from worldserve.bench.models import fill_random_
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer

    model = Cosmos3Transformer(merged.transformer.config, dtype=torch.float32)
    fill_random_(model, seed=0)
    model.quantize_gen_fp8(emulate=True)
    with pytest.raises(ValueError, match="before quantize_gen_fp8"):
        merge_lora(model, lora, torch.device("cpu"))
    assert model.merged_lora is None


@pytest.fixture(scope="module")
def gen_only(lora, tmp_path_factory) -> LoraRequest:
    """The adapter less its und tower modules: merged, nothing is left unmerged (MergedLora.rest is None)."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(lora.path, tmp_path_factory.mktemp("lora") / "gen-only")
    weights = folder / "adapter_model.safetensors"
    und = (
        "self_attn.to_",
        "mlp.",
    )  # (diffusers' und names; the gen tower's are add_*_proj, to_add_out, mlp_moe_gen)
    save_file({k: v for k, v in load_file(weights).items() if not any(u in k for u in und)}, str(weights))
    return dataclasses.replace(lora, name="gen-only", path=str(folder))


@pytest.fixture(scope="module", params=["tp2", "tp2-gen-only", "cfg2"])
def merged_parallel(request, tiny_ckpt, lora, gen_only):
    adapter = gen_only if request.param.endswith("gen-only") else lora
    layout = {"cfg_parallel_size": 2} if request.param == "cfg2" else {"tensor_parallel_size": 2}
    for pipe in two_rank_cpu_pipeline(
        tiny_ckpt, **layout, kernels=KernelOptions(compile=False, merged_lora=adapter)
    ):
        yield pipe, adapter


def test_each_rank_merges_its_slices(merged_parallel, ours_pipeline):
    """Under TP 2 q|k|v and gate|up merge B's rows of the rank, o_proj and down_proj A's columns; under CFG-parallel
    the uncond rank merges the whole adapter and prefills with its und deltas: the same requests as one unmerged
    process; an adapter with no und deltas too (the peers still hear which adapter runs)."""
    pipe, adapter = merged_parallel
    merged = pipe.local.transformer.merged_lora
    assert merged is not None and (merged.rest is None) == (adapter.name == "gen-only")
    batch = _batch(adapter)[:1]
    _assert_same(run_requests(pipe, batch), run_requests(ours_pipeline, batch))


def _bf16_model(ckpt):
    from worldserve.runner.video_pipeline import load_configured_transformer

    return load_configured_transformer(Path(ckpt), torch.bfloat16, torch.device("cpu"), KernelOptions(compile=False),
                                       progress=False)  # fmt: skip


def test_an_adapter_rounding_would_erase_stays_unmerged(tiny_ckpt, lora):
    """In bf16 weights a delta far below a weight's last bit rounds away: such an adapter (here a small scale)
    merges into no bf16 weight, each as loaded, and runs unmerged (only the time embedder's float32 weights
    take theirs); a float32 model merges it all; the same adapter at scale 0.75 merges whole into bf16."""
    from worldserve.runner.lora_cache import MERGE_ERASURE_LIMIT, merge_lora

    small, cpu = dataclasses.replace(lora, scale=1e-3), torch.device("cpu")
    model = _bf16_model(tiny_ckpt)
    before = {n: p.clone() for n, p in model.named_parameters()}
    merged, total, _ = merge_lora(model, small, cpu)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert merged == 2 < total and changed == {
        "time_embedder.linear_1.weight",
        "time_embedder.linear_2.weight",
    }
    rest = model.merged_lora.rest  # (every bf16 linear's pair, beside the und deltas)
    assert sum(len(layer.get("gen", {})) for layer in rest.layers) + len(rest.top) == total - 2
    assert _load(tiny_ckpt, small).transformer.merged_lora.rest.top == {}  # (float32: nothing rounds away)
    model = _bf16_model(tiny_ckpt)
    merged, total, worst = merge_lora(model, lora, cpu)  # (scale 0.75)
    assert merged == total and worst <= MERGE_ERASURE_LIMIT and model.merged_lora is not None


def test_a_linear_whose_delta_would_round_away_stays_unmerged(tiny_ckpt, lora, tmp_path, ours_pipeline):
    """One part of a fused gen linear barely trained (q's B x 1e-4, beside strong k and v): every other row
    merges, q's rows alone run unmerged (MergedLora.rest carries q|k|v's pair with k's and v's rows of B
    zeroed, beside the und deltas), their weights as loaded; in bf16 the requests land where the unmerged
    adapter's do, far from the base model's."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(lora.path, tmp_path / "weak-one")
    weights = folder / "adapter_model.safetensors"
    weak = "layers.1.self_attn.add_q_proj"
    tensors = load_file(weights)
    tensors[f"base_model.model.{weak}.lora_B.weight"] *= 1e-4
    save_file(tensors, str(weights))
    adapter = dataclasses.replace(lora, name="weak-one", path=str(folder))
    from worldserve.runner.lora_cache import merge_lora

    model = _bf16_model(tiny_ckpt)
    qkv = model.layers[1].gen.qkv_proj.weight.clone()
    q = model.config.q_dim  # (q's rows of the fused q|k|v)
    merged, total, _ = merge_lora(model, adapter, torch.device("cpu"))
    assert merged == total - 1  # (the fused q|k|v keeps q's rows unmerged)
    a, b = model.merged_lora.rest.tower(1, "gen")["qkv_proj"]
    assert (
        model.merged_lora.rest.tower(0, "gen") is None and b[:q].count_nonzero() > 0 == b[q:].count_nonzero()
    )
    weight = model.layers[1].gen.qkv_proj.weight
    assert torch.equal(weight[:q], qkv[:q]) and not torch.equal(weight[q:], qkv[q:])  # (k and v merged)
    from worldserve.runner.video_pipeline import VideoPipeline

    def run(**kernels):
        pipe = VideoPipeline.from_pretrained(tiny_ckpt, device="cpu", dtype=torch.bfloat16, progress=False,
                                             kernels=KernelOptions(compile=False, **kernels))  # fmt: skip
        return run_requests(pipe, _batch(adapter)[:1])[0][0].float()

    partial, unmerged = run(merged_lora=adapter), run()
    base = run_requests(ours_pipeline, _batch(None)[:1])[0][0]
    assert rel(partial, unmerged) < 0.1 < rel(base, unmerged)


def test_serve_merges_the_static_adapter_only_without_enable_lora(tiny_ckpt, lora, tmp_path, monkeypatch):
    """--lora-path alone: merged as the weights load; with --enable-lora (requests may name others) or at scale
    0: not. An adapter that does not fit stops the start naming the flag before any weights load."""
    from worldserve.commands.serve_backend import load_backend
    from worldserve.config import LoraConfig, ModelConfig, ParallelConfig
    from worldserve.runner import video_pipeline

    class Loaded(Exception):
        pass

    seen = []

    def load_pipeline(path, **kwargs):
        seen.append(kwargs["kernels"].merged_lora)
        raise Loaded

    monkeypatch.setattr(video_pipeline, "load_pipeline", load_pipeline)
    model = ModelConfig(model=str(tiny_ckpt), device="cpu", dtype="float32")
    for flags in (dict(), dict(enable_lora=True), dict(lora_scale=0.0)):
        with pytest.raises(Loaded):
            load_backend(
                model, ParallelConfig(), lora=LoraConfig(lora_path=lora.path, **{"lora_scale": 0.75, **flags})
            )
    assert seen == [dataclasses.replace(lora, name="static"), None, None]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^--lora-path: LoRA adapter .*found 0 \.safetensors files"):
        load_backend(model, ParallelConfig(), lora=LoraConfig(lora_path=str(tmp_path / "empty")))
    assert len(seen) == 3


def test_generate_merges_its_adapter(tiny_ckpt, lora, tmp_path, monkeypatch):
    """`generate --lora` runs one adapter: merged as the weights load, checked before (exit 2 naming --lora)."""
    from cli_helpers import run_cli

    from worldserve.runner import video_pipeline

    loaded, real = [], video_pipeline.load_pipeline
    monkeypatch.setattr(
        video_pipeline, "load_pipeline", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1]
    )
    small = ("--size", "64x48", "--num-frames", "5", "--steps", "2", "--dtype", "float32", "--device", "cpu")
    proc = run_cli("generate", tiny_ckpt, "--prompt", "a cat", *small, "--lora", lora.path, "--lora-scale", "0.75",
                   "-o", tmp_path / "x.mp4")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        loaded[0].transformer.merged_lora.source == (lora.path, 0.75) and (tmp_path / "x.mp4").stat().st_size
    )
    (tmp_path / "empty").mkdir()
    proc = run_cli("generate", tiny_ckpt, "--prompt", "a cat", *small, "--lora", tmp_path / "empty",
                   "-o", tmp_path / "y.mp4")  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("worldserve generate: error: --lora: "), (
        proc.stderr
    )
    assert len(loaded) == 1


def test_fp8_quantises_the_merged_weights(tiny_ckpt, merged, lora):
    """--quantization fp8 with a static adapter: the e4m3 weights are the merged ones', quantised (the deltas
    are not lost to a quantisation before the merge)."""
    from worldserve.models.layers.fp8 import quantize_rowwise

    fp8 = _load(tiny_ckpt, lora, quantization="fp8-emulated")
    for name in ("qkv_proj", "gate_up_proj", "down_proj"):
        q = getattr(fp8.transformer.layers[1].gen, name)
        expected = quantize_rowwise(getattr(merged.transformer.layers[1].gen, name).weight)
        assert torch.equal(q.weight.float(), expected[0].float()) and torch.equal(q.weight_scale, expected[1])


def test_merge_pair_keeps_the_rows_rounding_would_change():
    """Row by row: a large delta merges (rounding adds only noise), one far below the weights' last bit would
    vanish and one of just over half a bit would nearly double (both stay unmerged, in the pair returned with
    the merged rows of B zeroed), a row without a delta is left as it is."""
    from worldserve.models.layers.lora import merge_pair

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 256, generator=g).bfloat16()
    weight[2] = 1.0  # (bf16's last bit at 1.0: 2^-7)
    a = torch.cat([torch.randn(1, 256, generator=g), torch.ones(1, 256)])  # [2, 256]
    b = torch.tensor([[0.3, 0.0], [1e-5, 0.0], [0.0, 0.51 * 2**-7], [0.0, 0.0]])  # [4, 2]
    before = weight.clone()
    left, worst = merge_pair(weight, (a, b), max_erasure=0.05)
    assert not torch.equal(weight[0], before[0]) and torch.equal(weight[1:], before[1:]) and worst <= 0.05
    assert left[0] is a and torch.equal(left[1], b * torch.tensor([[0.0], [1.0], [1.0], [0.0]]))
    exact = before.float() + b @ a  # (merged anyway, row 2's delta would come out 1.96x)
    assert torch.allclose((exact.bfloat16().float() - before.float())[2], torch.full((256,), 2**-7))
