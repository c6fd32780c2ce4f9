"""The offline Engine's per-request `lora` (generate_video, generate_image) on the tiny random checkpoint (CPU,
float32, enable_lora): a `LoraRequest`, or the HTTP routes' / vLLM-Omni's `lora` object as a dict, read by the
routes' own parser (api/lora_field.py `parse_lora`); anything else a ParamError naming `lora` saying what it
takes.
"""

from __future__ import annotations

import pytest
from offline_engines import TINY, engine_fixture
from pipeline_helpers import write_random_adapter

OPTIONS = {
    "device": "cpu",
    "dtype": "float32",
    "max_model_len": 1024,
    "max_batch_size": 2,
    "enable_lora": True,
}
IMAGE = {"width": 64, "height": 64, "num_inference_steps": 2, "seed": 5}


engine = engine_fixture(OPTIONS)


@pytest.fixture(scope="module")
def adapter(tiny_ckpt, tmp_path_factory):
    return write_random_adapter(tmp_path_factory.mktemp("adapter"), tiny_ckpt, rank=4, alpha=4.0, std=0.5)


def test_a_dict_runs_as_the_lora_request_it_names(engine, adapter):
    """{"name", "path", "scale"} (the HTTP shape; vLLM-Omni's other keys too) makes the video the LoraRequest
    makes, and not the base model's."""
    from worldserve.params import LoraRequest

    fields = {**TINY, "seed": 3}
    own = engine.generate_video("a fox", lora=LoraRequest("x", adapter, 1.0), **fields)
    assert (
        engine.generate_video("a fox", lora={"name": "x", "path": adapter, "scale": 1}, **fields).video
        == own.video
    )
    vllm_omni_keys = {"lora_name": "x", "local_path": adapter}  # (scale: 1.0 by default)
    assert engine.generate_video("a fox", lora=vllm_omni_keys, **fields).video == own.video
    assert engine.generate_video("a fox", **fields).video != own.video
    # a list of prompts with the keyword: every item's adapter (batched together: compared with the same list)
    listed = engine.generate_video(["a fox", "a cat"], lora={"name": "x", "path": adapter}, **fields)
    requested = engine.generate_video(["a fox", "a cat"], lora=LoraRequest("x", adapter, 1.0), **fields)
    assert [out.video for out in listed] == [out.video for out in requested]
    assert all(out.params.lora == LoraRequest("x", adapter, 1.0) for out in listed)


def test_a_dict_naming_a_missing_adapter_is_the_models_error_naming_lora(engine, tmp_path):
    """Parsed first (its path made absolute, as the route's), then refused where a LoraRequest naming nothing is:
    the model's check, a ParamError naming `lora`."""
    from worldserve import ParamError

    missing = str(tmp_path / "no-adapter")
    for call in (engine.generate_video, engine.generate_image):
        fields = TINY if call is engine.generate_video else IMAGE
        with pytest.raises(ParamError, match="no such file or folder on the server") as err:
            call("a fox", lora={"name": "x", "path": missing, "scale": 1}, **fields)
        assert err.value.param == "lora" and "expected a JSON object" not in str(err.value)


@pytest.mark.parametrize(
    "lora, said",
    [({"name": "x"}, "both name and path are required"),
     ({"name": "x", "path": "/a", "scale": "big"}, "scale must be a finite number"),
     ({"name": "x", "path": "https://host/a"}, "not a URL")],
)  # fmt: skip
def test_a_bad_dict_is_refused_as_the_route_refuses_it(engine, lora, said):
    from worldserve import ParamError
    from worldserve.api.lora_field import parse_lora

    with pytest.raises(ParamError, match=said):
        parse_lora(lora)
    for call, fields in ((engine.generate_video, TINY), (engine.generate_image, IMAGE)):
        with pytest.raises(ParamError, match=said) as err:
            call("a fox", lora=lora, **fields)
        assert err.value.param == "lora"


@pytest.mark.parametrize("lora", ["/adapters/style", ["x", "/a"], 3])
def test_anything_else_is_refused_saying_what_lora_takes(engine, lora):
    from worldserve import ParamError

    for call, fields in ((engine.generate_video, TINY), (engine.generate_image, IMAGE)):
        with pytest.raises(
            ParamError, match="lora must be a worldserve.params.LoraRequest or a dict such as"
        ) as err:
            call("a fox", lora=lora, **fields)
        assert err.value.param == "lora"


def test_generate_image_takes_the_dict_too(engine, adapter):
    from worldserve.params import LoraRequest

    own = engine.generate_image("a fox", lora=LoraRequest("x", adapter, 1.0), **IMAGE)[0].image
    same = engine.generate_image("a fox", lora={"name": "x", "path": adapter}, **IMAGE)[0].image
    assert same.tobytes() == own.tobytes()
    assert engine.generate_image("a fox", **IMAGE)[0].image.tobytes() != own.tobytes()


def test_a_video_params_lora_may_be_the_dict(engine, adapter):
    """A whole VideoParams whose lora is the dict runs as its LoraRequest."""
    from worldserve import VideoParams
    from worldserve.params import LoraRequest

    fields = {**TINY, "seed": 3}
    own = engine.generate_video("a fox", lora=LoraRequest("x", adapter, 1.0), **fields)
    params = VideoParams(prompt="a fox", lora={"name": "x", "path": adapter}, **fields)  # type: ignore[arg-type]
    assert engine.generate_video(params).video == own.video


def test_an_engine_without_enable_lora_refuses_a_requests_adapter_in_its_own_words(tmp_path):
    """Without enable_lora the refusal names the Engine's option (the server's names --enable-lora): for
    generate_video's and generate_image's requests alike, before any model work."""
    from worldserve import ParamError
    from worldserve.offline.image_requests import image_params
    from worldserve.offline.video_requests import video_params

    lora = {"name": "x", "path": str(tmp_path)}
    with pytest.raises(ParamError) as video:
        video_params("a fox", {"lora": lora}, defaults={})
    with pytest.raises(ParamError) as image:
        image_params("a fox", 1, {"lora": lora})
    for refused in (video.value, image.value):
        assert refused.param == "lora"
        assert "off on this Engine: build it with enable_lora=True" in str(refused), refused


def test_numpy_scales_are_numbers_and_a_wrong_type_is_named():
    """A numpy scalar scale (as every other numeric field takes) is a Python float, in a dict or a LoraRequest;
    a string in a LoraRequest is refused as a wrong type, not as "not finite, got 1"."""
    import numpy as np

    from worldserve import ParamError
    from worldserve.api.lora_field import parse_lora
    from worldserve.params import LoraRequest

    for scale in (np.float32(0.5), np.int64(1), np.float64(0.25)):
        for lora in (parse_lora({"name": "x", "path": "/a", "scale": scale}), LoraRequest("x", "/a", scale)):
            assert type(lora.validate().scale) is float and lora.scale == float(scale)
    with pytest.raises(ParamError, match="lora scale must be a number, got str"):
        LoraRequest("x", "/a", "1").validate()  # type: ignore[arg-type]
    with pytest.raises(ParamError, match="must be a finite number, got nan"):
        LoraRequest("x", "/a", np.float32("nan")).validate()
