"""Text-to-image requests as VideoParams: what POST /v1/images/generations (api/images.py) and the offline
Engine's `generate_image` (offline/image_requests.py) both make of a prompt, `n` and the fields given.

The fields given (VideoParams names; None: not given) go over Cosmos3's T2I defaults (params.IMAGE_DEFAULTS,
vLLM-Omni's: 1024x1024, 50 steps, guidance 7.0 inside [400, 1000], flow shift 3.0 or the server's
--flow-shift, the default max sequence length); one frame, no sound; a random seed when none is given; image i
seeded `choice_seed(seed, i)` (seed, seed + 1, ...), as vLLM-Omni seeds its num_outputs_per_prompt.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from worldserve.params import DEFAULT_MAX_SEQUENCE_LENGTH, IMAGE_DEFAULTS, VideoParams, choice_seed


def text_to_image_params(
    prompt: Any, n: int, given: Mapping[str, Any], *, default_flow_shift: float | None = None,
    names: Mapping[str, str] = MappingProxyType({}),
) -> list[VideoParams]:  # fmt: skip
    """The `n` images' VideoParams: `given` over the T2I defaults (`default_flow_shift`: the server's
    --flow-shift, over T2I's 3.0), validated (a ParamError renamed through `names`, validate_as's), image i
    seeded choice_seed(seed, i)."""
    values: dict[str, Any] = {
        "width": IMAGE_DEFAULTS.width, "height": IMAGE_DEFAULTS.height,
        "num_inference_steps": IMAGE_DEFAULTS.num_inference_steps, "guidance_scale": IMAGE_DEFAULTS.guidance_scale,
        "flow_shift": IMAGE_DEFAULTS.flow_shift if default_flow_shift is None else default_flow_shift,
        "guidance_interval": IMAGE_DEFAULTS.guidance_interval, "max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH,
        **{name: value for name, value in given.items() if value is not None},
        "num_frames": 1, "generate_sound": False,
    }  # fmt: skip
    if values.get("seed") is None:
        values["seed"] = random.randrange(2**32)
    base = VideoParams(prompt=prompt, **values).validate_as(names)
    return [base] + [dataclasses.replace(base, seed=choice_seed(base.seed, i)) for i in range(1, n)]
