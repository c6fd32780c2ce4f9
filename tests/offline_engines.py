"""What the offline Engine's test files share: the tiny checkpoint's small video fields and the CPU options."""

TINY = {"width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 2, "fps": 8}
"""A video of the tiny checkpoint that takes a fraction of a second on a CPU."""
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 2048, "max_batch_size": 2}
"""Engine options for the tiny checkpoint on a CPU, two requests a batch."""
