"""Building Cosmos3Transformer on the meta device, the checkpoint -> fused-parameter map, and dtype rules.

- Nano builds on meta in bf16 with exactly checkpoint_keys.count_parameters parameters (~15.17B) but the
  action heads (checked, not loaded).
- Every checkpoint key it loads lands in a slice of one of our parameters with the checkpoint's shape, and the
  slices tile every parameter exactly once (q|k|v and gate|up fused), also per rank under tensor parallel.
- The loader path (meta -> to_empty -> load_checkpoint_tensor -> post_load) rebuilds the RoPE buffers and
  keeps time_embedder in float32; a bf16 model tracks the float32 one.
"""

from __future__ import annotations

import math

import pytest
import torch

from worldserve.models.cosmos3.batch import GenBatch, GenItem
from worldserve.models.cosmos3.checkpoint_keys import count_parameters, transformer_checkpoint_shapes
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.transformer import Cosmos3Transformer
from worldserve.models.cosmos3.weights import checkpoint_target
from worldserve.parallel.groups import ParallelGroup


def _build_meta(config, dtype=torch.bfloat16, tp=None):
    kw = {} if tp is None else {"tp": tp}
    with torch.device("meta"):
        return Cosmos3Transformer(config, dtype=dtype, **kw)


def test_nano_builds_on_meta_with_the_checkpoint_parameter_count():
    model = _build_meta(Cosmos3Config.nano())
    n = sum(p.numel() for p in model.parameters())
    action = sum(math.prod(s) for k, s in model.checkpoint_shapes().items() if k.startswith("action_"))
    assert n == count_parameters(Cosmos3Config.nano()) - action  # (the action heads are not loaded)
    assert action == 16_914_432 and not any(k.startswith("action_") for k in model.loaded_shapes())
    assert abs(n / 1e9 - 15.17) < 0.05
    assert all(p.is_meta for p in model.parameters())
    assert model.checkpoint_shapes() == transformer_checkpoint_shapes(model.config)
    assert {p.dtype for n, p in model.named_parameters() if n.startswith("time_embedder.")} == {torch.float32}
    assert {p.dtype for n, p in model.named_parameters() if not n.startswith("time_embedder.")} == {
        torch.bfloat16
    }


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("config", [Cosmos3Config.nano(), Cosmos3Config.tiny()], ids=["nano", "tiny"])
def test_checkpoint_keys_tile_our_parameters(config, tp_size):
    model = _build_meta(config, tp=ParallelGroup(rank=tp_size - 1, size=tp_size))
    params = dict(model.named_parameters())
    covered = {name: [] for name in params}
    for key, shape in model.loaded_shapes().items():
        t = checkpoint_target(key, config, tp_size)
        param = params[t.name]
        local = list(shape)
        if t.shard_dim is not None:
            local[t.shard_dim] //= tp_size
        rows = t.rows if t.rows is not None else param.shape[0]
        assert [rows, *param.shape[1:]] == local, key
        covered[t.name].append((t.offset, rows))
    for name, spans in covered.items():
        spans.sort()
        assert spans and spans[0][0] == 0, name
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:], strict=False)), name
        assert spans[-1][0] + spans[-1][1] == params[name].shape[0], name


def test_unknown_and_misshaped_keys_are_refused():
    config = Cosmos3Config.tiny()
    model = Cosmos3Transformer(config, dtype=torch.float32)
    with pytest.raises(KeyError):
        model.load_checkpoint_tensor("layers.0.self_attn.to_qkv.weight", torch.zeros(1))
    with pytest.raises(KeyError):
        model.load_checkpoint_tensor(f"layers.{config.num_hidden_layers}.mlp.up_proj.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="to_k"):
        model.load_checkpoint_tensor("layers.0.self_attn.to_k.weight", torch.zeros(3, config.hidden_size))


def test_loader_path_and_bf16_tracks_float32(tiny_ckpt):
    from worldserve.weights.loader import load_transformer

    f32 = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    bf16 = load_transformer(tiny_ckpt, dtype=torch.bfloat16, progress=False)
    fresh = Cosmos3Transformer(f32.config, dtype=torch.float32)
    assert torch.equal(f32.rotary_emb.inv_freq, fresh.rotary_emb.inv_freq)
    assert torch.equal(f32.rotary_emb.axis_of_slot, fresh.rotary_emb.axis_of_slot)
    assert bf16.time_embedder.linear_1.weight.dtype == torch.float32
    assert bf16.layers[0].gen.qkv_proj.weight.dtype == torch.bfloat16

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (21,), generator=g)
    latents, sound = torch.randn(48, 3, 3, 5, generator=g), torch.randn(64, 10, generator=g)
    outs = []
    for m in (f32, bf16):
        (cache,) = m.prefill_und([ids])
        item = GenItem(latents=latents, timestep=900, und_cache=cache, sound=sound, clean_frames=(0,))
        outs.append(m(GenBatch.pack([item], config=m.config, device="cpu")))
    assert outs[1].video[0].dtype == torch.bfloat16
    v32, v16 = outs[0].video[0], outs[1].video[0].float()
    assert ((v16 - v32).norm() / v32.norm()).item() < 5e-2
    assert torch.count_nonzero(outs[1].video[0][:, 0]) == 0


def _build_tp(root, tp):
    from worldserve.weights.loader import load_into, read_header

    folder = root / "transformer"
    with torch.device("meta"):
        model = Cosmos3Transformer(
            Cosmos3Config.from_json(folder / "config.json"), dtype=torch.float32, tp=tp
        )
    model = model.to_empty(device="cpu")
    load_into(model, read_header(folder, "diffusion_pytorch_model"), model.loaded_shapes(), progress=False)
    return model


def _cfg_forward(model):
    """cond + uncond (different prompt lengths), I2V with sound: all velocities flattened."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (21,), generator=g), torch.randint(0, 256, (9,), generator=g)]
    latents, sound = torch.randn(48, 3, 3, 5, generator=g), torch.randn(64, 10, generator=g)
    items = [
        GenItem(latents=latents, timestep=800, und_cache=c, sound=sound, clean_frames=(0,))
        for c in model.prefill_und(prompts)
    ]
    out = model(GenBatch.pack(items, config=model.config, device="cpu"))
    return torch.cat([v.flatten() for v in out.video] + [s.flatten() for s in out.sound])


def _tp_worker(rank, root, store, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        y = _cfg_forward(_build_tp(root, ParallelGroup(rank=rank, size=2, group=dist.group.WORLD)))
        if rank == 0:
            queue.put(y.numpy())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_2_over_gloo_equals_single(tiny_ckpt, tmp_path):
    """Column/row-parallel sharding + all_reduce on 2 CPU ranks reproduce the single-rank forward."""
    import torch.multiprocessing as mp

    from worldserve.parallel.groups import SINGLE

    ref = _cfg_forward(_build_tp(tiny_ckpt, SINGLE))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_worker, args=(r, tiny_ckpt, tmp_path / "store", queue)) for r in range(2)]
    for p in procs:
        p.start()
    y = torch.from_numpy(queue.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert ((y - ref).norm() / ref.norm()).item() <= 1e-5


def test_gen_batch_validates_its_items():
    config = Cosmos3Config.tiny()
    model = Cosmos3Transformer(config, dtype=torch.float32)
    empty = model.new_und_cache(4)
    full = model.new_und_cache(4)
    full.advance(4)
    ok = dict(latents=torch.zeros(48, 2, 2, 2), timestep=1, und_cache=full)
    GenBatch.pack([GenItem(**ok)], config=config, device="cpu")
    bad = [
        dict(ok, latents=torch.zeros(16, 2, 2, 2)),
        dict(ok, clean_frames=(2,)),
        dict(ok, sound=torch.zeros(32, 5)),
        dict(ok, und_cache=empty),
        dict(ok, fps=0.0),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            GenBatch.pack([GenItem(**kw)], config=config, device="cpu")
    with pytest.raises(ValueError):
        GenBatch.pack([], config=config, device="cpu")
