"""Compile FlashAttention-4's SM90 forward ahead of time on a CPU-only machine, for the GPU machine to load.

FA4 is written in NVIDIA's CuTe Python DSL and compiles on first use; the DSL's compiler library is ~190 MB,
more than a device call can carry beside the serving wheels. Its kernels compile without a GPU (fake
tensors, target sm_90a), and each compiled function exports as a small TVM-FFI shared library that needs
only `apache-tvm-ffi` and the DSL's runtime library (`libcute_dsl_runtime.so`) to run. This script compiles
one kernel per spec, `TMxTN-cC[-ss][-rs][-gqa][-pN][-kN][-vN]` (tile_m x tile_n, cluster of C CTAs sharing K / V tiles by
TMA multicast: bench/fa4_sm90_kv_multicast.patch, which must be applied to the installed flash-attn-4;
`-ss`: P @ V with P through shared memory instead of registers; `-rs`: Q @ K^T with Q in registers (loaded
once a tile) instead of read from shared memory at every k-step; `-gqa`: the query heads of a K / V head
packed into one tile; `-pN`: persistent, N resident CTAs walking the tiles, `-p` = 132, an H100 / H200's SMs;
`-kN` / `-vN`: N shared-memory stages of K / of V, default 2 / as many as K), and writes

    OUT/<name>.so                    one TVM-FFI library per kernel (~65 kB), function <name>
    OUT/libcute_dsl_runtime.so.xz    the DSL runtime, for a machine without nvidia-cutlass-dsl-libs: unpack
                                     it there and name the file in $WORLDSERVE_CUTE_DSL_RUNTIME
    OUT/apache_tvm_ffi-*.whl         when --tvm-ffi-wheel names one (the device installs it)
    OUT/manifest.json                spec, tile, cluster, versions of each kernel

Every kernel: bf16, head dim 128, non-causal, intra-warpgroup overlap, the softmax LSE written; token
counts and head counts are runtime shapes, but the GQA ratio (query heads per K / V head, --qhead-per-kvhead,
Cosmos3's 32 / 8 = 4, also under Ulysses) is compiled in: the manifest records it and the loader runs a
kernel only at its ratio. The GPU side is
`worldserve/models/layers/fa4_cluster.py`: the product's gen kernel is the 128x176-c2 one, committed in
worldserve/models/layers/fa4_sm90/ (rebuild it with `--out worldserve/models/layers/fa4_sm90 --specs
128x176-c2`, then drop the runtime archive there); bench/sustained_rate.py --fa4-prebuilt and
bench/step_levers.py --fa4-prebuilt time other candidates. Here (a venv with torch, flash-attn-4 4.0.0b36
patched, nvidia-cutlass-dsl 4.8.1, triton):

    python bench/fa4_export.py --out .fa4 --specs 128x176-c1,128x176-c2          # ~3 s a kernel
"""

from __future__ import annotations

import argparse
import inspect
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SPEC_HELP = (
    "comma-separated TMxTN-cC[-ss][-rs][-gqa][-pN][-kN][-vN] specs, e.g. 128x176-c1,128x176-c2,192x112-c2-ss,"
    "128x176-c2-p,128x144-c2-v3"
)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel to compile: tile, cluster size, P's source for P @ V, GQA packing."""

    tile_m: int
    tile_n: int
    cluster_m: int
    p_in_smem: bool = False
    pack_gqa: bool = False
    persistent_sms: int = 0
    """Resident CTAs of a persistent kernel (0: one CTA per query tile)."""
    stages_k: int = 2
    """Shared-memory stages of K (FA4's default 2; V has as many unless stages_v says otherwise)."""
    stages_v: int = 0
    """Stages of V on their own ring (0: as K's)."""
    q_in_regs: bool = False
    """Q @ K^T as an RS WGMMA: Q from registers, K from shared memory."""

    @classmethod
    def parse(cls, spec: str) -> KernelSpec:
        """`128x176-c2[-ss][-rs][-gqa][-pN][-kN][-vN]` (ValueError naming the form otherwise)."""
        form = f"kernel spec must look like 128x176-c2[-ss][-rs][-gqa][-pN][-kN][-vN], got {spec!r}"
        parts = spec.strip().lower().split("-")
        if len(parts) < 2:
            raise ValueError(form)
        tile, cluster, *flags = parts
        persistent = [f for f in flags if f.startswith("p")]
        stages = {f[0]: f for f in flags if f[:1] in ("k", "v")}
        try:
            tm, tn = (int(x) for x in tile.split("x"))
            c = int(cluster.removeprefix("c"))
            sms = int(persistent[0].removeprefix("p") or 132) if persistent else 0
            sk, sv = (int(stages[r][1:]) if r in stages else d for r, d in (("k", 2), ("v", 0)))
        except ValueError:
            raise ValueError(form) from None
        known = {"ss", "rs", "gqa", *persistent, *stages.values()}
        if (
            not cluster.startswith("c")
            or set(flags) - known
            or len(persistent) > 1
            or len(flags) != len(set(flags))
        ):
            raise ValueError(form)
        if not 1 <= sk <= 4 or not 0 <= sv <= 4:
            raise ValueError(f"{spec!r}: 1-4 stages of K, 1-4 of V")
        if tm % 64 or not 64 <= tm <= 192 or tn % 16 or not 16 <= tn <= 256 or c not in (1, 2, 4):
            raise ValueError(f"{spec!r}: tile 64-192 rows (x64) by 16-256 keys (x16), cluster 1, 2 or 4")
        return cls(tm, tn, c, "ss" in flags, "gqa" in flags, sms, sk, sv if sv != sk else 0, "rs" in flags)

    @property
    def name(self) -> str:
        flags = (
            "_ss" * self.p_in_smem
            + "_rs" * self.q_in_regs
            + "_gqa" * self.pack_gqa
            + (f"_p{self.persistent_sms}" if self.persistent_sms else "")
            + (f"_k{self.stages_k}" if self.stages_k != 2 else "")
            + (f"_v{self.stages_v}" if self.stages_v else "")
        )
        return f"fa4_sm90_{self.tile_m}x{self.tile_n}_c{self.cluster_m}{flags}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output folder (git-excluded, e.g. .fa4)")
    ap.add_argument("--specs", default="128x176-c1,128x176-c2", help=SPEC_HELP)
    ap.add_argument("--qhead-per-kvhead", type=int, default=4, help="the GQA ratio compiled in (Cosmos3: 4)")
    ap.add_argument("--tvm-ffi-wheel", type=Path, help="an apache-tvm-ffi cp312 wheel to copy beside them")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = {s: KernelSpec.parse(s) for s in args.specs.split(",") if s}
    ratio = args.qhead_per_kvhead
    # Kernel selection and compile target without a GPU (FA4's documented CPU-only compilation).
    os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90a")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
    import torch
    from cutlass.cute.export import aot_config
    from flash_attn.cute import interface
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from torch._subclasses.fake_tensor import FakeTensorMode

    if "num_stages_v" not in inspect.signature(FlashAttentionForwardSm90.__init__).parameters:
        sys.exit("flash-attn-4 is not patched: apply bench/fa4_sm90_kv_multicast.patch (its header says how)")
    args.out.mkdir(parents=True, exist_ok=True)
    cache = interface._flash_attn_fwd.compile_cache.cache  # compile key -> compiled TVM-FFI function
    libdir = aot_config.get_libdir()
    manifest = {"flash_attn_4": _version("flash-attn-4"), "cutlass_dsl": _version("nvidia-cutlass-dsl"),
                "arch": "sm_90a", "kernels": {}}  # fmt: skip
    for spec, ks in specs.items():
        name = ks.name
        before = set(cache)
        t0 = time.perf_counter()
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):  # shapes are dynamic: any size compiles the same
                q = torch.empty(1, 1024, 8 * ratio, 128, dtype=torch.bfloat16, device="cuda")
                k, v = (torch.empty(1, 1024, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
                interface._flash_attn_fwd(
                    q, k, v, tile_mn=(ks.tile_m, ks.tile_n), mma_pv_is_rs=not ks.p_in_smem,
                    intra_wg_overlap=True, num_threads=128 * (1 + ks.tile_m // 64), pack_gqa=ks.pack_gqa,
                    return_lse=True, sm90_cluster_m=ks.cluster_m, sm90_persistent_sms=ks.persistent_sms,
                    sm90_num_stages=ks.stages_k, sm90_num_stages_v=ks.stages_v, sm90_mma_qk_is_rs=ks.q_in_regs,
                )  # fmt: skip
        except Exception as e:  # a tile the DSL refuses (shared memory, registers, layout): skip it
            print(f"{spec}: not compiled: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        (key,) = set(cache) - before
        obj = args.out / f"{name}.o"
        cache[key].export_to_c(str(obj), function_name=name)
        so = args.out / f"{name}.so"
        subprocess.run(
            ["g++", "-shared", "-o", str(so), str(obj), f"-L{libdir}", "-lcute_dsl_runtime"], check=True
        )
        obj.unlink()
        manifest["kernels"][name] = {"spec": spec, "tile_m": ks.tile_m, "tile_n": ks.tile_n,
                                     "cluster_m": ks.cluster_m, "p_in_smem": ks.p_in_smem,
                                     "pack_gqa": ks.pack_gqa, "persistent_sms": ks.persistent_sms,
                                     "stages_k": ks.stages_k, "stages_v": ks.stages_v or ks.stages_k, "q_in_regs": ks.q_in_regs,
                                     "qhead_per_kvhead": ratio,
                                     "compile_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
        print(f"{spec}: {so} ({so.stat().st_size} bytes, {time.perf_counter() - t0:.1f} s)", flush=True)
    runtime = Path(libdir) / "libcute_dsl_runtime.so"
    with lzma.open(args.out / "libcute_dsl_runtime.so.xz", "wb", preset=6) as f:
        f.write(runtime.read_bytes())
    if args.tvm_ffi_wheel is not None:
        shutil.copy2(args.tvm_ffi_wheel, args.out / args.tvm_ffi_wheel.name)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"wrote {len(specs)} kernels, the runtime and manifest.json under {args.out}")
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
