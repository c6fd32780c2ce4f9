"""VideoParams.validate checks each field's type first (worldserve/param_types.py): a wrong type through the
public Python API is a ParamError naming the field (the keyword: `width`, `height`; the HTTP layer renames a side
that came in `size`), not a raw TypeError from a comparison, nor a value accepted to fail after the prompt's prefill (`width=64.0`,
`seed=1.5`) or to be used as it is (`num_inference_steps=2.5`, `generate_sound="yes"`). Numpy scalars are taken
wherever ints and floats are (as vLLM and torch take them), through a whole generation on the tiny checkpoint.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from worldserve import ParamError, VideoParams

SMALL = {"prompt": "a fox", "width": 64, "height": 48, "num_frames": 9, "num_inference_steps": 2}

REFUSED = [  # (field, value, the error's param, its message)
    ("width", "64", "width", "width must be an integer, got str"),
    ("width", 64.0, "width", "width must be an integer, got float"),
    ("width", True, "width", "width must be an integer, got bool"),
    ("height", None, "height", "height must be an integer, got None"),
    ("num_frames", "5", "num_frames", "num_frames must be an integer, got str"),
    ("num_frames", 5.0, "num_frames", "num_frames must be an integer, got float"),
    ("num_inference_steps", None, "num_inference_steps", "num_inference_steps must be an integer, got None"),
    ("num_inference_steps", "2", "num_inference_steps", "num_inference_steps must be an integer, got str"),
    ("num_inference_steps", 2.5, "num_inference_steps", "num_inference_steps must be an integer, got float"),
    ("guidance_scale", "6", "guidance_scale", "guidance_scale must be a number, got str"),
    ("guidance_scale", None, "guidance_scale", "guidance_scale must be a number, got None"),
    ("guidance_scale", True, "guidance_scale", "guidance_scale must be a number, got bool"),
    ("fps", "24", "fps", "fps must be a number, got str"),
    ("fps", None, "fps", "fps must be a number, got None"),
    ("flow_shift", "3", "flow_shift", "flow_shift must be a number, got str"),
    ("sound_duration", "1", "sound_duration", "sound_duration must be a number, got str"),
    ("max_sequence_length", "64", "max_sequence_length", "max_sequence_length must be an integer, got str"),
    ("max_sequence_length", None, "max_sequence_length", "max_sequence_length must be an integer, got None"),
    ("seed", None, "seed", "seed must be an integer, got None"),
    ("seed", "1", "seed", "seed must be an integer, got str"),
    ("seed", 1.5, "seed", "seed must be an integer, got float"),
    ("seed", np.float64(1.0), "seed", "seed must be an integer, got float64"),
    ("generate_sound", "yes", "generate_sound", "generate_sound must be a boolean, got str"),
    ("generate_sound", 1, "generate_sound", "generate_sound must be a boolean, got int"),
    ("negative_prompt", 3, "negative_prompt", "negative_prompt must be a string, got int"),
    ("add_duration_template", "no", "add_duration_template", "add_duration_template must be a boolean, got str"),
    ("guidance_interval", (1, 2, 3), "guidance_interval", "guidance_interval must be [lo, hi], two numbers, got 3 values"),
    ("guidance_interval", 500, "guidance_interval", "guidance_interval must be [lo, hi], two numbers, got int"),
    ("guidance_interval", ("1", 2), "guidance_interval", "guidance_interval must be a list of numbers, got an item of type str"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value", "param", "message"), REFUSED, ids=[f"{r[0]}={r[1]!r}" for r in REFUSED]
)
def test_a_wrong_type_is_a_param_error_naming_the_field(field, value, param, message):
    with pytest.raises(ParamError) as error:
        VideoParams(**{**SMALL, field: value}).validate()
    assert (error.value.param, error.value.message) == (param, message)


@pytest.mark.parametrize(("side", "value"), [("width", 100), ("height", 0), ("height", 1296)])
def test_a_bad_side_is_named_by_its_keyword_or_by_the_field_it_came_in(side, value):
    """VideoParams (the Python API's VideoPipeline / Engine) names the keyword; the routes' field_names map
    both sides to `size`, the field a WIDTHxHEIGHT came in."""
    with pytest.raises(ParamError) as error:
        VideoParams(**{**SMALL, side: value}).validate()
    assert (error.value.param, error.value.message.split("=")[0]) == (side, side)
    with pytest.raises(ParamError) as error:
        VideoParams(**{**SMALL, side: value}).validate_as({"width": "size", "height": "size"})
    assert error.value.param == "size"


def test_a_type_error_is_named_as_the_request_field_the_value_came_in():
    """validate_as (the API's) renames a type error as it renames a range error."""
    with pytest.raises(ParamError) as error:
        VideoParams(**{**SMALL, "seed": "1"}).validate_as({"seed": "extra_params.seed"})
    assert error.value.param == "extra_params.seed"


@pytest.mark.parametrize(
    ("field", "value"),
    [("fps", math.nan), ("fps", math.inf), ("guidance_scale", math.nan), ("guidance_scale", -math.inf),
     ("flow_shift", math.nan), ("sound_duration", math.inf), ("guidance_interval", (math.nan, 900.0))],
)  # fmt: skip
def test_nan_and_inf_are_refused_where_a_range_applies(field, value):
    with pytest.raises(ParamError) as error:
        VideoParams(**{**SMALL, field: value}).validate()
    assert error.value.param == field


NUMPY = [  # numpy scalars where ints and floats go (a bool is no number, but np.bool_ is a boolean)
    ("width", np.int64(64)), ("height", np.int32(48)), ("num_frames", np.int64(9)),
    ("num_inference_steps", np.int16(2)), ("seed", np.int64(3)), ("seed", np.uint32(7)),
    ("max_sequence_length", np.int64(512)), ("fps", np.float32(12.0)), ("fps", np.int64(12)),
    ("guidance_scale", np.float64(3.0)), ("flow_shift", np.float32(5.0)), ("sound_duration", np.float64(0.5)),
    ("guidance_interval", (np.float32(100.0), np.int64(900))), ("generate_sound", np.bool_(False)),
    ("condition_frame_indexes", (np.int64(0),)),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), NUMPY, ids=[f"{f}={type(v).__name__}" for f, v in NUMPY])
def test_numpy_scalars_are_accepted(field, value):
    VideoParams(**{**SMALL, field: value}).validate()


def test_python_ints_still_work_as_reals():
    VideoParams(
        **{**SMALL, "fps": 12, "guidance_scale": 3, "flow_shift": 5, "guidance_interval": [0, 1000]}
    ).validate()


def test_numpy_scalars_run_a_whole_generation_as_the_python_ints_do(ours_pipeline):
    """seed=np.int64(3) had passed validation, then failed after the prompt's prefill: torch's manual_seed
    takes no numpy integer ("an integer is required"). The same numbers as numpy scalars give the same frames."""
    plain = {**SMALL, "seed": 3, "fps": 8.0, "guidance_scale": 2.0, "generate_sound": False}
    as_numpy = {**plain, "width": np.int64(64), "height": np.int64(48), "num_frames": np.int64(9),
                "num_inference_steps": np.int64(2), "seed": np.int64(3), "fps": np.float32(8.0),
                "guidance_scale": np.float64(2.0)}  # fmt: skip
    want, _ = ours_pipeline.generate(VideoParams(**plain))
    got, _ = ours_pipeline.generate(VideoParams(**as_numpy))
    assert got.frames.shape == want.frames.shape == (9, 48, 64, 3)
    np.testing.assert_array_equal(got.frames, want.frames)


def test_sound_is_off_for_an_image_unless_asked_and_refused_when_asked(ours_pipeline):
    """VideoParams.generate_sound's docstring: None is off for num_frames == 1; True is a ParamError."""
    image = VideoParams(**{**SMALL, "num_frames": 1})
    assert ours_pipeline.has_sound and not ours_pipeline.sound_enabled(image)
    assert ours_pipeline.sound_enabled(VideoParams(**SMALL))
    with pytest.raises(ParamError) as error:
        ours_pipeline.validate(VideoParams(**{**SMALL, "num_frames": 1, "generate_sound": True}))
    assert error.value.param == "generate_sound"
