"""Every documented limit of a video request's params (params.VideoParams.validate) is accepted exactly at
its edge and refused just past it, naming the field; --max-log-len cuts a logged negative prompt too. (Mutation checks found limits that only a value far inside or far
outside had exercised: `<= 20` turned into `< 20` passed every test.)"""

from __future__ import annotations

import logging
import math

import pytest

from worldserve.api.request_log import RequestLog
from worldserve.params import INT64, MAX_FPS, ParamError, VideoParams
from worldserve.resolution_tiers import MAX_SECONDS

SMALL = {"prompt": "a fox", "width": 64, "height": 48, "num_frames": 9}

EDGES = [  # (field, accepted at the edge, refused past it)
    ("num_inference_steps", (1, 200), (0, 201)),
    ("guidance_scale", (0.0, 20.0), (-1e-9, 20.000001, math.nan)),
    ("seed", (-INT64, INT64 - 1), (-INT64 - 1, INT64)),
    ("fps", (1.0, float(MAX_FPS)), (0.999, MAX_FPS + 0.001)),
    ("max_sequence_length", (1, 131072), (0, 131073)),
    ("guidance_interval", ((0.0, 0.0), (1000.0, 1000.0), (0.0, 1000.0)), ((500.0, 400.0), (-1.0, 10.0), (0.0, 1000.5))),
]  # fmt: skip


@pytest.mark.parametrize(("field", "accepted", "refused"), EDGES, ids=[e[0] for e in EDGES])
def test_each_limit_is_accepted_at_its_edge_and_refused_past_it(field, accepted, refused):
    for value in accepted:
        VideoParams(**SMALL, **{field: value}).validate()
    for value in refused:
        with pytest.raises(ParamError) as error:
            VideoParams(**SMALL, **{field: value}).validate()
        assert error.value.param == field, (value, error.value)


def test_sound_duration_runs_from_one_frame_to_the_longest_video():
    fps = 8.0
    for value in (1 / fps, float(MAX_SECONDS)):
        VideoParams(**SMALL, fps=fps, sound_duration=value).validate()
    for value in (1 / fps - 1e-6, MAX_SECONDS + 1e-6):
        with pytest.raises(ParamError, match="sound_duration"):
            VideoParams(**SMALL, fps=fps, sound_duration=value).validate()


def test_a_refused_value_is_quoted_as_it_came_not_rounded_into_range():
    """sound_duration just under 1 / fps had read "sound_duration=0.125 must be in [1 / fps, ...]" (the API's
    fps likewise: tests/test_api_bad_input.py)."""
    with pytest.raises(ParamError) as error:
        VideoParams(**SMALL, fps=8.0, sound_duration=1 / 8 - 1e-9).validate()
    assert "sound_duration=0.124999999" in str(error.value), str(error.value)


def test_max_log_len_cuts_the_logged_negative_and_system_prompts_too(caplog):
    with caplog.at_level(logging.INFO, logger="worldserve.requests"):
        RequestLog(max_len=10).video(
            "r", VideoParams(**SMALL, negative_prompt="blurry " * 100, system_prompt="SECRET " * 20)
        )
    line = caplog.records[-1].getMessage()
    assert "negative_prompt='blurry blu'" in line and "blurry " * 3 not in line, line
    assert "system_prompt='SECRET SEC'" in line and "SECRET " * 2 not in line, line  # (it was logged whole)
