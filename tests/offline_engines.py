"""What the offline Engine's test files share: the tiny checkpoint's small video fields and the CPU options."""

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
