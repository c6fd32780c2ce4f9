#!/usr/bin/env bash
# Device kits with the product's attention kernels: FlashAttention-3 (`fa3-fwd`) and the FA4 cluster kernel's
# runtime (apache-tvm-ffi + the CuTe DSL's libcute_dsl_runtime.so from nvidia-cutlass-dsl-libs-cu13), which
# `bench/device_wheels.sh`'s .whl/ leaves out for size: without them an H100 / H200 run measures SDPA, not
# what `worldserve serve` runs (the forty-third and forty-fourth sessions' device runs). Each kit is one
# tar.xz of unpacked wheels (git-ignored .kit/; a call carries 64 MiB, the 5 MiB repo included):
#   .kit/bench.tar.xz (56 MiB): the kernels + diffusers, Pillow, PyAV (the decode phase's mux): `worldserve bench`,
#                               bench/step_levers.py, bench/sustained_rate.py and the like, with diffusers beside;
#   .kit/serve.tar.xz (57 MiB): the kernels + the serving stack of .whl/ (FastAPI, uvicorn, PyAV, ...):
#                               bench/serve_video.py, bench/serve_chat.py at the product's kernels.
# On the device (carry the one kit file, e.g. [".kit/bench.tar.xz"]: both together are over the limit):
#   mkdir -p /tmp/site && xz -dc .kit/bench.tar.xz | tar -C /tmp/site -xf - && export PYTHONPATH=/tmp/site:. \
#     WORLDSERVE_CUTE_DSL_RUNTIME=/tmp/site/libcute_dsl_runtime.so NCCL_NVLS_ENABLE=0 \
#     TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Usage: bash bench/device_kits.sh [bench|serve]   (default: bench; serve needs .whl/ from device_wheels.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-bench}"
grep -qx '/.kit/' .git/info/exclude || echo '/.kit/' >> .git/info/exclude
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
download() {  # CPython 3.12 x86-64 wheels into $work/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform linux_x86_64 -d "$work/wheels" "$@"
}
mkdir -p "$work/wheels" "$work/site"
download apache-tvm-ffi==0.1.15.post2 nvidia-cutlass-dsl-libs-cu13==4.8.1 fa3-fwd==0.0.3
ls "$work"/wheels/fa3_fwd-*.whl "$work"/wheels/apache_tvm_ffi-*.whl > /dev/null  # (no sdist slipped in)
unzip -q -j "$work"/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl 'nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so' \
  -d "$work/site"
rm "$work"/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl
case "$kind" in
  bench)
    download diffusers==0.42.1 pillow==13.0.0 importlib_metadata==10.2.0 zipp==4.1.2 av==18.1.0 ;;
  serve)
    [ -d .whl ] || { echo "run bash bench/device_wheels.sh first" >&2; exit 1; }
    for w in .whl/*.whl; do
      case "$(basename "$w")" in  # (the tests' and diffusers' wheels stay in .whl/)
        diffusers-*|peft-*|pytest*|pluggy-*|iniconfig-*|execnet-*|pygments-*) ;;
        *) cp "$w" "$work/wheels/" ;;
      esac
    done ;;
  *) echo "usage: $0 [bench|serve]" >&2; exit 2 ;;
esac
for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$work/site"; done
mkdir -p .kit
tar -C "$work/site" -cf - . | xz -T0 -9 > ".kit/$kind.tar.xz.part"
mv ".kit/$kind.tar.xz.part" ".kit/$kind.tar.xz"  # (a failed run leaves no truncated kit)
du -h ".kit/$kind.tar.xz"
