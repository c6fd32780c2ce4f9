"""Shared fixtures: offline Hugging Face, a session-wide tiny random checkpoint in the real layout.

`HF_HUB_OFFLINE=1` is forced before anything imports huggingface_hub, so no test can download;
`WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES=1` lets media downloads reach the tests' servers on loopback.
`tiny_ckpt` is written once per session with `make_tiny` (seed 0); tests that break or rewrite a
checkpoint copy it first (`tiny_copy`).
"""

from __future__ import annotations

import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the tests' media servers listen on loopback, which media downloads refuse by default; the tests of that
# refusal (test_media_urls.py) turn it back on
os.environ["WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from worldserve.weights.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "Cosmos3-Tiny", seed=0)


@pytest.fixture(scope="module")
def reasoner(tiny_ckpt):
    """The tiny checkpoint's Reasoner, float32 on the CPU, one per test module (a module may define its own)."""
    from reasoner_helpers import tiny_reasoner

    return tiny_reasoner(tiny_ckpt)


@pytest.fixture(scope="module")
def reasoner_url(reasoner, tmp_path_factory):
    """A uvicorn serving the module's `reasoner` (model name "test-model"); its URL."""
    from serving_helpers import serve_reasoner

    folder = tmp_path_factory.mktemp("reasoner-server")
    with serve_reasoner(reasoner, folder, model="test-model", name="test-reasoner-uvicorn") as url:
        yield url


@pytest.fixture(scope="module")
def reasoner_oai(reasoner_url):
    """The openai client of `reasoner_url`."""
    from openai import OpenAI

    return OpenAI(base_url=reasoner_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def tiny_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


@pytest.fixture(scope="session")
def ours_pipeline(tiny_ckpt):
    """Our VideoPipeline on the tiny checkpoint, float32 on the CPU (shared by the parity tests)."""
    from worldserve.runner.video_pipeline import VideoPipeline

    return VideoPipeline.from_pretrained(tiny_ckpt, device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def diffusers_pipeline(tiny_ckpt):
    """diffusers' Cosmos3OmniPipeline on the same files, float32 (the oracle)."""
    from diffusers import Cosmos3OmniPipeline

    return Cosmos3OmniPipeline.from_pretrained(tiny_ckpt, dtype=torch.float32)


@pytest.fixture
def anyio_backend():
    """The event loop of every `pytest.mark.anyio` test: asyncio (the server's)."""
    return "asyncio"
