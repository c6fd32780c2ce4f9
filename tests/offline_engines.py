"""What the offline Engine's test files share: the tiny checkpoint's small video fields, the CPU options and
the module-scoped `engine` / `served` fixtures built from them."""

import pytest

TINY = {"width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 2, "fps": 8}
"""A video of the tiny checkpoint that takes a fraction of a second on a CPU."""
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 2048, "max_batch_size": 2}
"""Engine options for the tiny checkpoint on a CPU, two requests a batch."""


def served_backend(engine):
    """What `worldserve serve` loads for `engine`'s options (serve_backend.load_backend: the video pipeline, a
    memory reader, the Reasoner), loaded on its own: routes compared with the Engine answer from it, as a
    server would (not from the Engine's own model)."""
    from worldserve.commands.serve_backend import load_backend

    config = engine.config
    return load_backend(config.model, config.parallel, config.scheduler, config.reasoner, config.lora)


def engine_fixture(options=OPTIONS):
    """A module-scoped `engine` fixture: worldserve.Engine on the tiny checkpoint with `options`, closed after
    the module's tests (`engine = engine_fixture()` in a test file)."""

    @pytest.fixture(scope="module")
    def engine(tiny_ckpt):
        from worldserve import Engine

        with Engine(tiny_ckpt, **options) as engine:
            yield engine

    return engine


def served_fixture():
    """A module-scoped `served` fixture: `served_backend` of the module's `engine`."""

    @pytest.fixture(scope="module")
    def served(engine):
        return served_backend(engine)

    return served
