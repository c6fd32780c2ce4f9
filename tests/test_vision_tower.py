"""Our ViT forward (models/cosmos3/vision_tower.py) against transformers' Qwen3VLVisionModel forward, float32 on
the CPU, on the weights of one model: images of several grids, a video's temporal patches, deepstack features."""

from __future__ import annotations

import pytest
import torch

from worldserve.models.cosmos3.vision_tower import VisionGeometry, VisionTower
from worldserve.weights.tiny import TINY_VISION_CONFIG


@pytest.fixture(scope="module")
def vit():
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    cfg = Qwen3VLVisionConfig(**{**TINY_VISION_CONFIG, "depth": 3, "num_position_embeddings": 144},
                              out_hidden_size=24)  # fmt: skip
    model = Qwen3VLVisionModel._from_config(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases (the init leaves them 1 / 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _inputs(grids):
    g = torch.tensor(grids)
    return torch.randn(int(g.prod(-1).sum()), 3 * 2 * 16 * 16), g


@pytest.mark.parametrize(
    "grids",
    [[[1, 4, 6]], [[1, 8, 4], [1, 2, 2], [1, 6, 10]], [[3, 4, 4]], [[1, 2, 4], [2, 6, 2]], [[1, 24, 2]]],
)
def test_equals_the_reference_forward(vit, grids):
    x, g = _inputs(grids)
    with torch.no_grad():
        ref = vit(x, grid_thw=g)
    merged, deepstack = VisionTower(vit).forward(x, g)
    torch.testing.assert_close(merged, ref.pooler_output, atol=2e-5, rtol=1e-5)
    assert len(deepstack) == len(ref.deepstack_features) == 2
    for ours, theirs in zip(deepstack, ref.deepstack_features, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_an_item_attends_within_itself_only(vit):
    """Two images encoded together give each one's rows as encoded alone (Qwen3-VL's cu_seqlens)."""
    x, g = _inputs([[1, 4, 6], [1, 6, 4]])
    tower = VisionTower(vit)
    both, _ = tower.forward(x, g)
    first, _ = tower.forward(x[:24], g[:1])
    second, _ = tower.forward(x[24:], g[1:])
    torch.testing.assert_close(both, torch.cat([first, second]), atol=1e-6, rtol=1e-6)


def test_geometry_lengths_and_merge_window_order():
    geo = VisionGeometry.of(torch.tensor([[2, 2, 4], [1, 2, 2]]), merge=2)
    assert geo.lengths == [8, 8, 4]  # a video's temporal patches attend to themselves
    rows, cols = geo.rows_cols(torch.device("cpu"))
    # first frame of a 2x4 grid in 2x2 windows: window (0, 0) then window (0, 1)
    assert rows[:8].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert cols[:8].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert rows[8:16].tolist() == rows[:8].tolist()  # the second frame repeats it


def test_a_vit_of_another_activation_is_refused(vit):
    vit.config.hidden_act = "silu"
    try:
        with pytest.raises(ValueError, match="hidden_act"):
            VisionTower(vit)
    finally:
        vit.config.hidden_act = "gelu_pytorch_tanh"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_on_cuda_matches_the_reference_and_compiles_once_for_all_sizes(vit):
    import copy

    from torch._dynamo.utils import counters

    model = copy.deepcopy(vit).to("cuda", torch.bfloat16)
    tower = VisionTower(model)
    tower.compile_math()
    for n, grids in enumerate(([[1, 4, 6]], [[1, 8, 10], [2, 2, 4]], [[1, 16, 12]])):
        x, g = _inputs(grids)
        x = x.to("cuda", torch.bfloat16)
        with torch.no_grad():
            ref = model(x, grid_thw=g.cuda())
        merged, deepstack = tower.forward(x, g)
        err = float((merged.float() - ref.pooler_output.float()).norm() / ref.pooler_output.float().norm())
        assert err < 2e-2, (grids, err)
        if n == 1:
            graphs = counters["stats"]["unique_graphs"]
        elif n > 1:  # a third size compiles nothing more (dynamic token counts)
            assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa3_attention_where_it_runs_matches_the_reference(vit):
    import copy

    from worldserve.models.layers.flash_attention import resolve_attention_backend

    model = copy.deepcopy(vit).to("cuda", torch.bfloat16)
    label, fn = resolve_attention_backend(None, torch.device("cuda"), torch.bfloat16, 32 // 2)
    if label != "fa3":
        pytest.skip("FA3 does not run here")
    x, g = _inputs([[1, 8, 10], [2, 2, 4]])
    x = x.to("cuda", torch.bfloat16)
    with torch.no_grad():
        ref = model(x, grid_thw=g.cuda())
    merged, _ = VisionTower(model, attention=fn).forward(x, g)
    err = float((merged.float() - ref.pooler_output.float()).norm() / ref.pooler_output.float().norm())
    assert err < 2e-2, err


def test_without_fa3_the_vit_takes_the_flash_first_sdpa(vit):
    """The ViT's items are as long as their images: where FA3 does not run it gets the SDPA that puts flash
    before cuDNN (a cuDNN graph build for every new image size: layers/attention.py)."""
    from worldserve.models.cosmos3.vision import VisionEncoder
    from worldserve.models.layers.attention import any_shape_sdpa_attention

    encoder = VisionEncoder(vit)
    assert encoder.tower.attention is any_shape_sdpa_attention
    assert encoder.set_attention_backend("TORCH_SDPA") == "sdpa"
    assert encoder.tower.attention is any_shape_sdpa_attention


@pytest.mark.parametrize(("n_out", "n_in"), [(44, 48), (80, 48), (1, 6), (6, 6), (13, 5), (2, 2)])
def test_the_bilinear_matrix_is_f_interpolates_align_corners_resample(n_out, n_in):
    from worldserve.models.cosmos3.vision_tower import bilinear_matrix

    x = torch.randn(3, n_in, dtype=torch.float32)
    ref = torch.nn.functional.interpolate(x[None], size=n_out, mode="linear", align_corners=True)[0]
    m = bilinear_matrix(n_out, n_in, torch.device("cpu"))
    torch.testing.assert_close(x @ m.t(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(m.sum(1), torch.ones(n_out))
