#!/usr/bin/env bash
# The serving and test packages the GPU machine lacks (its image has torch, transformers, safetensors, numpy,
# jinja2, huggingface_hub; /work/.library/device/README.md), downloaded here as CPython 3.12 x86-64 wheels
# into .whl/ (git-ignored; 58 MiB with the repo under the 64 MiB a call carries). A `run` then carries
# [".whl"] and starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
#     NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# and e.g. `python3 -m pytest -q -m gpu -rs tests/...`. Left out for size: openai, uvloop, hypothesis,
# accelerate (no gpu test needs them), and FlashAttention-3 / FA4's runtime (their tests skip without them;
# bench/device_kits.sh packs them, with diffusers or with the serving stack, for runs at the product's kernels).
# Versions are this venv's (`pip freeze`); a new pin there means a new one here.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
platforms=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
packages=(
  annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 attrs==26.1.0 av==18.1.0 click==8.5.1
  diffusers==0.42.1 distro==1.9.0 execnet==2.1.2 fastapi==0.165.0 h11==0.16.0 httpcore==1.0.9 httpx==0.29.0
  importlib_metadata==10.2.0 iniconfig==2.3.1 jiter==0.19.0 jsonschema==4.26.0 opentelemetry-api==1.45.3
  jsonschema-specifications==2025.9.1 llguidance==1.9.1 peft==0.21.2 pillow==13.0.0 pluggy==1.7.0
  prometheus_client==0.26.0 psutil==7.2.2 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0
  pytest==9.2.0 pytest-xdist==3.8.0 python-multipart==0.0.34 referencing==0.37.0 rpds-py==2026.9.1
  sniffio==1.3.1 sortedcontainers==2.4.0 starlette==1.10.0 typing-inspection==0.4.5 uvicorn==0.55.0
  websockets==17.4 zipp==4.1.2
)
rm -rf .whl && mkdir .whl
for pkg in "${packages[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$pkg"
done
du -sh .whl
