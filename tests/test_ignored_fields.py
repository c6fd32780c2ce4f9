"""Request fields a JSON route ignores (a newer API's, or a misspelled one) are not errors, as in vLLM, but they are
named in one warning in vLLM's words (api/bodies.py log_ignored_fields): over HTTP on the image route, and for
the chat, completion and Responses models, whose aliases count as known."""

from __future__ import annotations

import logging

import pytest
from serving_helpers import asgi_server

from worldserve.api.bodies import IGNORED_NAMES_SHOWN, log_ignored_fields
from worldserve.api.chat_protocol import ChatCompletionRequest
from worldserve.api.completions_protocol import CompletionRequest
from worldserve.api.responses_protocol import ResponsesRequest

WARNING = "The following fields were present in the request but ignored"


@pytest.mark.anyio
async def test_the_image_route_names_what_it_ignores(tmp_path, caplog):
    async with asgi_server(tmp_path) as http:
        with caplog.at_level(logging.WARNING, logger="worldserve.api.bodies"):
            r = await http.post("/v1/images/generations", json={
                "prompt": "a fox", "size": "32x32", "num_inference_steps": 1, "sead": 3, "style_preset": "x",
            })  # fmt: skip
    assert r.status_code == 200, r.text
    [line] = [m for m in caplog.messages if WARNING in m]
    assert "'sead'" in line and "'style_preset'" in line and "'prompt'" not in line and "'size'" not in line


@pytest.mark.anyio
async def test_a_json_video_body_names_what_it_ignores(tmp_path, caplog):
    """A create request's misplaced fields (a top-level lora_path) are named, JSON body or form (vLLM-Omni's
    form parser ignores a form's in silence: the OpenAI SDK's nested extra_body keys had gone unnoticed)."""
    body = {
        "prompt": "a fox",
        "size": "32x32",
        "num_frames": 1,
        "num_inference_steps": 1,
        "lora_path": "/l/a",
    }
    async with asgi_server(tmp_path) as http:
        with caplog.at_level(logging.WARNING, logger="worldserve.api.bodies"):
            r = await http.post("/v1/videos", json=body)
            assert r.status_code == 200, r.text
            [line] = [m for m in caplog.messages if WARNING in m]
            assert "'lora_path'" in line and "'prompt'" not in line and "'num_frames'" not in line
            caplog.clear()
            r = await http.post("/v1/videos", data={k: str(v) for k, v in body.items()})
            assert r.status_code == 200, r.text
    [line] = [m for m in caplog.messages if WARNING in m]
    assert "'lora_path'" in line and "'prompt'" not in line and "'num_frames'" not in line


@pytest.mark.parametrize(
    ("model", "data", "ignored"),
    [
        (ChatCompletionRequest, {"messages": [], "max_tokens": 3, "spaces_between_special_tokens": False}, 1),
        (CompletionRequest, {"prompt": "x", "echo": True, "length_penalty": 1.0}, 1),
        (ResponsesRequest, {"input": "x", "max_output_tokens": 3, "instructions": "be brief"}, 0),
    ],
)
def test_known_fields_and_aliases_are_not_named(model, data, ignored, caplog):
    with caplog.at_level(logging.WARNING, logger="worldserve.api.bodies"):
        log_ignored_fields(model, data)
    assert sum(WARNING in m for m in caplog.messages) == ignored


def test_a_flood_of_fields_is_named_in_brief(caplog):
    data = {"messages": [], **{f"x{i:05d}" + "y" * 100: 1 for i in range(5000)}}
    with caplog.at_level(logging.WARNING, logger="worldserve.api.bodies"):
        log_ignored_fields(ChatCompletionRequest, data)
    [line] = caplog.messages
    assert f"(and {5000 - IGNORED_NAMES_SHOWN} more)" in line and len(line) < 2500
