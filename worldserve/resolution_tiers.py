"""Cosmos3's resolution policy: the sizes, frame counts and flow shifts a generation may take.

Width and height must be multiples of 16; the pixel area picks the model's tier (256p / 480p / 720p, the
largest being 1280x720-sized) and each tier caps num_frames as cosmos-framework does (400 / 300 / 200). Any
multiple-of-16 size inside the 720p area is accepted (diffusers accepts any); an image (num_frames 1) may go
up to the 1024x1024 area (vLLM-Omni's text-to-image default), with the 720p tier's default flow shift (the
images route passes 3.0). An I2V request without a size takes its image's aspect ratio at the 720p area.

Separate from params.py, which holds the request (VideoParams) and checks it field by field: these are the
model's limits and defaults by size, which the API (api/video_fields.py) and the CLI also read.
"""

from __future__ import annotations

import math

from worldserve.param_errors import ParamError, shown

# (tier name, max pixel area, max frames, default flow shift). Areas: 320x256, 640x640, 1280x720.
RESOLUTION_TIERS: tuple[tuple[str, int, int, float], ...] = (
    ("256", 320 * 256, 400, 3.0),
    ("480", 640 * 640, 300, 5.0),
    ("720", 1280 * 720, 200, 10.0),
)
MAX_SIDE = 1280
SIZE_MULTIPLE = 16
MAX_SECONDS = max(tier[2] for tier in RESOLUTION_TIERS)
"""No tier makes a longer video (its most frames at the lowest fps, 1)."""
IMAGE_MAX_AREA = 1024 * 1024
"""Images (num_frames 1) may go up to 1024x1024, vLLM-Omni's Cosmos3 text-to-image default (above the 720p area)."""


MIN_FLOW_SHIFT, MAX_FLOW_SHIFT = 1e-3, 100.0
"""The flow shifts taken (Cosmos3 uses 3-10; below ~1e-11 the shifted float32 sigmas underflow to 0 and no
schedule exists, which failed a job after it was accepted)."""
FLOW_SHIFT_RANGE = f"[{MIN_FLOW_SHIFT:g}, {MAX_FLOW_SHIFT:g}]"


def flow_shift_ok(value: float) -> bool:
    """Whether `value` is a flow shift in [MIN_FLOW_SHIFT, MAX_FLOW_SHIFT] (a request's, or --flow-shift)."""
    return math.isfinite(value) and MIN_FLOW_SHIFT <= value <= MAX_FLOW_SHIFT


def resolution_tier(width: int, height: int) -> tuple[str, int, int, float]:
    area = width * height
    for tier in RESOLUTION_TIERS:
        if area <= tier[1]:
            return tier
    raise ParamError(
        "width",  # (the area of both sides: VideoParams' width, which the routes name as the field it came in)
        f"size {width}x{height} is above the model's largest resolution tier (720p: at most "
        f"{RESOLUTION_TIERS[-1][1]} pixels, e.g. 1280x720, 960x960, 720x1280)",
    )


def check_side(name: str, value: int, param: str | None = None) -> None:
    """A ParamError naming `param` (default: the side's own name, `width` or `height`: VideoParams' fields;
    the HTTP routes name the field the side came in, `size`, through VideoParams.field_names) unless `value`
    is a multiple of SIZE_MULTIPLE in [16, MAX_SIDE]."""
    if value < SIZE_MULTIPLE or value % SIZE_MULTIPLE or value > MAX_SIDE:
        why = f" (it is above {MAX_SIDE})" if value > MAX_SIDE and value % SIZE_MULTIPLE == 0 else ""
        raise ParamError(
            param or name,
            f"{name}={shown(value)} must be a multiple of {SIZE_MULTIPLE} in [16, {MAX_SIDE}]{why}",
        )


def aspect_size(src_width: int, src_height: int) -> tuple[int, int]:
    """(width, height) for an I2V request that gives no size (serving-api.md §4.3): the image's aspect
    ratio at the 720p pixel area, each side rounded down to a multiple of 16; for an image wider (taller)
    than 16:9 (9:16) the long side is capped at MAX_SIDE and the short one follows the ratio."""
    ratio = src_width / src_height
    area = RESOLUTION_TIERS[-1][1]
    width, height = math.sqrt(area * ratio), math.sqrt(area / ratio)
    shrink = min(1.0, MAX_SIDE / width, MAX_SIDE / height)
    return _floor_to_multiple(width * shrink), _floor_to_multiple(height * shrink)


def _floor_to_multiple(side: float) -> int:
    return max(SIZE_MULTIPLE, int(side) // SIZE_MULTIPLE * SIZE_MULTIPLE)


V2V_FLOW_SHIFT = 10.0
"""Video-to-video's default flow shift at every size (vLLM-Omni's COSMOS3_V2V_DEFAULT_FLOW_SHIFT; serving-api.md
§4.2, §4.4)."""


def default_flow_shift(width: int, height: int) -> float:
    """10 at 720p, 5 at 480p, 3 at 256p (the training shift table); 10 for the images above the 720p area."""
    area = width * height
    return next((tier[3] for tier in RESOLUTION_TIERS if area <= tier[1]), RESOLUTION_TIERS[-1][3])
