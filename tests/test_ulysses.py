"""Ulysses sequence parallelism over 2 gloo CPU ranks (float32): the all-to-alls move exactly the right
blocks, and a sharded transformer forward (odd token count, so the padding path runs; CFG pair + an I2V item
with sound) gives every rank the single-process velocities."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2


def _init(rank: int, rendezvous: str):
    """A file rendezvous (no port to pick: a free port found here could be another xdist worker's store by the
    time rank 0 binds it)."""
    import torch.distributed as dist

    from worldserve.parallel.groups import ParallelGroup

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    return ParallelGroup(rank=rank, size=WORLD, group=None)


def _inputs(model):
    """The same GenBatch on every rank: a CFG pair (sound on one branch only) and an I2V item."""
    from worldserve.models.cosmos3.batch import GenBatch, GenItem

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 200, (n,), generator=g) for n in (7, 11, 5)]
    caches = model.prefill_und(ids)
    lat = [torch.randn(48, 3, 3, 5, generator=g) for _ in range(3)]
    snd = torch.randn(64, 5, generator=g)
    items = [
        GenItem(latents=lat[0], timestep=900, und_cache=caches[0], sound=snd),
        GenItem(latents=lat[1], timestep=900, und_cache=caches[1]),
        GenItem(latents=lat[2], timestep=500, und_cache=caches[2], clean_frames=(0,)),
    ]
    return GenBatch.pack(items, config=model.config, device="cpu")


def _rank(rank: int, rendezvous: str, ckpt: str, out_dir: str) -> None:
    """One rank of both checks (one spawn for the module: a spawned process spends seconds importing torch):
    the all-to-alls on a known tensor, then the sharded forward."""
    from worldserve.parallel import comm, ulysses
    from worldserve.weights.loader import load_transformer

    sp = _init(rank, rendezvous)
    full = torch.arange(6 * 4 * 3, dtype=torch.float32).reshape(6, 4, 3)  # [N, H, D], same on every rank
    mine = ulysses.shard(full, sp)  # my tokens, all heads
    heads = ulysses.seq_to_heads(mine, sp)  # all tokens, my heads
    back = ulysses.heads_to_seq(heads, sp)
    gathered = ulysses.gather(mine, 5, sp)
    torch.save(
        {"heads": heads, "back": back, "mine": mine, "gathered": gathered}, f"{out_dir}/a2a-r{rank}.pt"
    )
    model = load_transformer(ckpt, dtype=torch.float32, progress=False)
    out = model(_inputs(model), sp)
    torch.save({"video": list(out.video), "sound": list(out.sound)}, f"{out_dir}/forward-r{rank}.pt")
    comm.destroy_world()


@pytest.fixture(scope="module")
def ranks(tiny_ckpt, tmp_path_factory):
    """The folder of what the WORLD spawned ranks saved (`_rank`)."""
    out = tmp_path_factory.mktemp("ulysses")
    mp.start_processes(_rank, args=(str(out / "rendezvous"), str(tiny_ckpt), str(out)), nprocs=WORLD, start_method="spawn",
                       join=True)  # fmt: skip
    return out


def test_all_to_all_moves_the_right_blocks(ranks):
    full = torch.arange(6 * 4 * 3, dtype=torch.float32).reshape(6, 4, 3)
    for rank in range(WORLD):
        r = torch.load(ranks / f"a2a-r{rank}.pt")
        assert torch.equal(r["mine"], full[3 * rank : 3 * rank + 3])
        assert torch.equal(r["heads"], full[:, 2 * rank : 2 * rank + 2])  # all tokens, my 2 of 4 heads
        assert torch.equal(r["back"], r["mine"])
        assert torch.equal(r["gathered"], full[:5])


def test_sharded_forward_matches_one_rank(ranks, tiny_ckpt):
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    batch = _inputs(model)
    assert batch.positions.shape[1] % WORLD == 1  # odd: the last rank's block is padded
    ref = model(batch)
    for rank in range(WORLD):
        r = torch.load(ranks / f"forward-r{rank}.pt")
        for a, b in zip(r["video"], ref.video, strict=True):
            assert float((a - b).norm() / b.norm()) < 1e-5
        assert r["sound"][1] is None and r["sound"][2] is None
        torch.testing.assert_close(r["sound"][0], ref.sound[0], rtol=1e-4, atol=1e-5)


def test_heads_must_divide():
    from worldserve.parallel.groups import ParallelGroup
    from worldserve.parallel.ulysses import check_degree

    check_degree(2, heads=4, kv_heads=2)
    with pytest.raises(
        ValueError, match="--ulysses-degree 4 must divide num_attention_heads=4 and num_key_value_heads=2"
    ):
        check_degree(4, heads=4, kv_heads=2)
    assert ParallelGroup(rank=1, size=2).size == 2
