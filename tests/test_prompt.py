"""Prompt formatting (reference rules, cosmos3-model.md §5.2 / §12) and token ids against diffusers.

Token parity: diffusers' `Cosmos3OmniPipeline.tokenize_prompt` on the tiny checkpoint, with its own templates
and system prompt off, fed our formatted strings, must give exactly our ids (§13's parity settings).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from worldserve.models.cosmos3.prompt import (
    PromptEncoder,
    VideoShape,
    aspect_ratio_label,
    default_negative_prompt,
    format_negative_prompt,
    format_prompt,
    format_prompts,
)
from worldserve.params import ParamError, VideoParams

VIDEO_720 = VideoShape(height=720, width=1280, num_frames=189, fps=24.0)
IMAGE_720 = VideoShape(height=720, width=1280, num_frames=1, fps=24.0)
METADATA_720 = "The video is 7.9 seconds long and is of 24 FPS. This video is of 720x1280 resolution."
PROMPT_KEYS = (
    "subjects",
    "background_setting",
    "lighting",
    "aesthetics",
    "cinematography",
    "style_medium",
    "artistic_style",
    "context",
    "actions",
    "text_and_signage_elements",
    "segments",
    "transitions",
    "temporal_caption",
    "audio_description",
)


@pytest.fixture(scope="module")
def encoder(tiny_ckpt) -> PromptEncoder:
    return PromptEncoder.from_pretrained(tiny_ckpt)


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt):
    from diffusers import Cosmos3OmniPipeline

    return Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)


def diffusers_ids(pipeline, cond: str, uncond: str, shape: VideoShape, system: bool = False):
    return pipeline.tokenize_prompt(
        cond,
        uncond,
        num_frames=shape.num_frames,
        height=shape.height,
        width=shape.width,
        fps=shape.fps,
        use_system_prompt=system,
        add_resolution_template=False,
        add_duration_template=False,
    )


def test_plain_text_matches_doc_example():
    assert (
        format_prompt("A red fox runs through snow.", VIDEO_720)
        == f"A red fox runs through snow. {METADATA_720}"
    )
    assert format_prompt("  a cat...  ", VIDEO_720) == f"a cat. {METADATA_720}"
    params = VideoParams(prompt="a cat", negative_prompt="")
    assert format_prompts(params).cond == f"a cat. {METADATA_720}"
    assert format_prompts(params).uncond == METADATA_720  # empty negative: the sentences alone


def test_image_mode_has_no_duration_sentence():
    assert format_prompt("a cat", IMAGE_720) == "a cat. This image is of 720x1280 resolution."
    # Reference text2image default negative is "": only the SAME metadata sentence remains.
    assert format_negative_prompt(None, IMAGE_720) == "This image is of 720x1280 resolution."


def test_json_prompt_gets_metadata_injected():
    prompt = json.dumps({"subjects": [{"description": "a fox"}], "duration": "3s", "context": "snow \u00e9"})
    out = format_prompt(prompt, VIDEO_720)
    obj = json.loads(out)
    # Existing keys are overwritten in place; new ones appended in the reference's order.
    assert list(obj) == ["subjects", "duration", "context", "fps", "resolution", "aspect_ratio"]
    assert obj["duration"] == "7s" and obj["fps"] == 24.0
    assert obj["resolution"] == {"H": 720, "W": 1280} and obj["aspect_ratio"] == "16,9"
    assert out == json.dumps(obj)  # default separators, ASCII escapes
    assert "\\u00e9" in out
    image = json.loads(format_prompt(prompt, IMAGE_720))
    assert "duration" not in image and "fps" not in image and image["resolution"] == {"H": 720, "W": 1280}
    # A JSON array or string is plain text, as in the reference.
    assert format_prompt('["a", "b"]', VIDEO_720) == f'["a", "b"]. {METADATA_720}'


def test_aspect_ratio_labels():
    assert aspect_ratio_label(1280, 720) == "16,9"
    assert aspect_ratio_label(720, 1280) == "9,16"
    assert aspect_ratio_label(960, 960) == "1,1"
    assert aspect_ratio_label(1104, 832) == "4,3"
    assert aspect_ratio_label(832, 1104) == "3,4"
    assert aspect_ratio_label(832, 480) == "16,9"
    assert aspect_ratio_label(320, 256) == "4,3"


def test_default_negative_prompt_is_reference_json():
    text = default_negative_prompt()
    obj = json.loads(text)
    assert isinstance(obj, dict) and all(k in obj for k in PROMPT_KEYS)
    assert json.dumps(obj) == text  # serialised exactly as the reference loads it
    assert "\\u2014" in text and 14_000 < len(text) < 16_000
    uncond = format_negative_prompt(None, VIDEO_720)
    assert uncond == f"{text}. {METADATA_720}"
    assert format_prompts(VideoParams(prompt="a cat")).uncond == uncond
    # A user JSON negative is not injected: SAME sentences are appended to its text.
    assert format_negative_prompt('{"a": 1}', VIDEO_720) == f'{{"a": 1}}. {METADATA_720}'


@pytest.mark.parametrize(
    ("prompt", "negative", "shape"),
    [
        ("A red fox runs through snow.", None, VIDEO_720),
        (
            json.dumps({"subjects": [], "context": "caf\u00e9"}),
            "blurry",
            VideoShape(height=64, width=96, num_frames=17, fps=16.0),
        ),
        ("a cat", None, VideoShape(height=48, width=80, num_frames=1, fps=24.0)),
    ],
)
def test_token_ids_match_diffusers(pipeline, encoder, prompt, negative, shape):
    params = VideoParams(
        prompt=prompt,
        negative_prompt=negative,
        height=shape.height,
        width=shape.width,
        num_frames=shape.num_frames,
        fps=shape.fps,
        max_sequence_length=100_000,  # the tiny tokenizer is byte-level: ~15k tokens for the default negative
    )
    texts = format_prompts(params)
    cond, uncond = encoder.encode_params(params)
    assert (cond, uncond) == tuple(diffusers_ids(pipeline, texts.cond, texts.uncond, shape))
    tok = encoder.tokenizer
    assert cond[-2:] == [
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|vision_start|>"),
    ]
    assert cond[0] == tok.convert_tokens_to_ids("<|im_start|>")  # no BOS, no system turn


def test_system_prompt_option_matches_diffusers(pipeline, tiny_ckpt):
    encoder = PromptEncoder.from_pretrained(tiny_ckpt / "text_tokenizer", use_system_prompt=True)
    for shape in (VIDEO_720, IMAGE_720):
        cond_ref, _ = diffusers_ids(pipeline, "a cat", "", shape, system=True)
        assert encoder.encode("a cat", is_image=shape.is_image) == cond_ref


LONG_TEXT = " ".join(f"q{i}z" for i in range(300))  # digits and odd pairs: little for BPE to merge


def test_too_long_prompts_are_param_errors(encoder):
    short = dict(negative_prompt="", height=48, width=80, num_frames=9, fps=24.0)
    with pytest.raises(ParamError) as err:
        encoder.encode_params(VideoParams(prompt=LONG_TEXT, max_sequence_length=200, **short))
    assert err.value.param == "prompt"
    n = len(encoder.encode(format_prompts(VideoParams(prompt=LONG_TEXT, **short)).cond))
    assert f"{n} tokens" in err.value.message and "max_sequence_length=200" in err.value.message

    with pytest.raises(ParamError) as err:
        encoder.encode_params(
            VideoParams(prompt="a cat", **{**short, "negative_prompt": LONG_TEXT}, max_sequence_length=200)
        )
    assert err.value.param == "negative_prompt"
    # the default negative prompt is the server's: a cap set for the prompt does not refuse it
    cond, uncond = encoder.encode_params(
        VideoParams(prompt="a cat", height=48, width=80, num_frames=9, max_sequence_length=64)
    )
    assert len(cond) <= 64 < len(uncond)
    full = encoder.encode_params(VideoParams(prompt="a cat", height=48, width=80, num_frames=9))
    assert (cond, uncond) == full, "nothing cut either"
    # Without CFG the negative is not tokenized, so it cannot fail the request.
    cond, uncond = encoder.encode_params(
        VideoParams(prompt="a cat", num_frames=9, height=48, width=80), with_uncond=False
    )
    assert uncond is None and len(cond) < 4096


@pytest.mark.parametrize("duration,resolution", [(False, True), (True, False), (False, False)])
def test_template_switches_match_diffusers(pipeline, encoder, duration, resolution):
    """vLLM-Omni's extra_params use_duration_template / use_resolution_template: the prompt's sentences go
    as diffusers' add_duration_template / add_resolution_template leave them out."""
    from worldserve.params import VideoParams

    params = VideoParams(prompt="A red fox runs through snow", negative_prompt="blurry",
                         add_duration_template=duration, add_resolution_template=resolution)  # fmt: skip
    cond, uncond = encoder.encode_params(params)
    ref_cond, _ = pipeline.tokenize_prompt(
        params.prompt, "", num_frames=params.num_frames, height=params.height, width=params.width,
        fps=params.fps, use_system_prompt=False, add_duration_template=duration, add_resolution_template=resolution,
    )  # fmt: skip
    assert cond == list(ref_cond)
    text = encoder.tokenizer.decode(uncond)
    assert ("seconds long" in text) == duration and ("resolution" in text) == resolution


def test_json_prompt_without_templates_keeps_its_own_keys():
    from worldserve.models.cosmos3.prompt import format_prompt

    shape = VideoShape(height=720, width=1280, num_frames=189, fps=24.0, duration=False, resolution=False)
    out = json.loads(format_prompt('{"subjects": ["a fox"], "duration": "3s"}', shape))
    assert out == {"subjects": ["a fox"], "duration": "3s"}


def test_per_request_system_prompt(encoder, pipeline):
    params = VideoParams(prompt="a cat", use_system_prompt=True, add_duration_template=False,
                         add_resolution_template=False)  # fmt: skip
    cond, _ = encoder.encode_params(params, with_uncond=False)
    ref, _ = diffusers_ids(pipeline, "a cat", "", VIDEO_720, system=True)
    assert cond == list(ref)
    own = VideoParams(prompt="a cat", system_prompt="You render nature documentaries.").validate()
    cond, uncond = encoder.encode_params(own)
    assert "You render nature documentaries." in encoder.tokenizer.decode(cond)
    assert "You render nature documentaries." in encoder.tokenizer.decode(uncond)


def test_system_prompt_precedence_and_empty(encoder):
    """A system_prompt of your own wins over use_system_prompt=False; "" means no system message at all."""
    plain = encoder.encode_params(VideoParams(prompt="a cat"), with_uncond=False)[0]
    own = encoder.encode_params(VideoParams(prompt="a cat", use_system_prompt=False, system_prompt="Be brief."),
                                with_uncond=False)[0]  # fmt: skip
    assert "Be brief." in encoder.tokenizer.decode(own)
    empty = encoder.encode_params(VideoParams(prompt="a cat", use_system_prompt=True, system_prompt=""),
                                  with_uncond=False)[0]  # fmt: skip
    assert empty == plain
    long_system = VideoParams(prompt="a cat", system_prompt=LONG_TEXT, max_sequence_length=64)
    with pytest.raises(ParamError, match="system message included"):
        encoder.encode_params(long_system)


def test_texts_longer_than_any_tokenization_are_refused_without_tokenizing(encoder, monkeypatch):
    """A prompt with more bytes than max_sequence_length tokens can cover is refused up front (param named),
    before the tokenizer spends seconds on megabytes of text; texts that may fit still get tokenized."""
    calls = []
    real = encoder.tokenizer.apply_chat_template
    monkeypatch.setattr(
        encoder.tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    huge = "fox " * 2_000_000
    with pytest.raises(ParamError, match="bytes, more than max_sequence_length") as err:
        encoder.encode_params(VideoParams(prompt=huge), with_uncond=False)
    assert err.value.param == "prompt" and calls == []
    with pytest.raises(ParamError) as err:
        encoder.encode_params(VideoParams(prompt="a cat", negative_prompt=huge))
    assert err.value.param == "negative_prompt" and len(calls) == 1  # the prompt itself was tokenized
    assert encoder.text_bound.bytes_per_token >= max(len(t.encode()) for t in encoder.tokenizer.get_vocab())
    with pytest.raises(ParamError) as err:
        encoder.encode_params(VideoParams(prompt="a cat", system_prompt=huge), with_uncond=False)
    assert err.value.param == "system_prompt" and len(calls) == 1


@pytest.mark.parametrize(
    ("prompt", "negative"),
    [("A red fox runs through snow", "blurry, low quality"), ("A red fox runs through snow", ""),
     (" A red fox runs. ", "blurry "), ("a fox...", "  "),  # (as given: diffusers strips nothing)
     # a JSON prompt gets the sentences after its text, not fields injected (diffusers / vLLM-Omni inject none)
     ('{"caption": "a fox in snow", "duration": "3s"}', '{"quality": "blurry"}')],
)  # fmt: skip
@pytest.mark.parametrize("frames", [189, 1])
def test_inverse_negative_metadata_matches_diffusers(pipeline, encoder, prompt, negative, frames):
    """extra_params.negative_metadata_mode "inverse": both branches' ids equal diffusers' tokenize_prompt with
    its templates on (the prompt's sentences, their "is not" negations on the negative: vLLM-Omni's way), its
    texts as given (they had been stripped as the reference's are, which changed the ids of a text with
    leading or trailing spaces); "none" leaves the negative text alone; "same" (the default, the
    reference's) repeats the prompt's. A JSON prompt, which the reference's modes get fields injected into,
    is text here as in diffusers."""
    params = VideoParams(prompt=prompt, negative_prompt=negative, num_frames=frames,
                         negative_metadata="inverse")  # fmt: skip
    ours = encoder.encode_params(params)
    ref = pipeline.tokenize_prompt(
        params.prompt, negative, num_frames=frames, height=params.height, width=params.width, fps=params.fps,
        use_system_prompt=False, add_duration_template=True, add_resolution_template=True,
    )  # fmt: skip
    assert ours == (list(ref[0]), list(ref[1]))
    bare = format_prompts(dataclasses.replace(params, negative_metadata="none")).uncond
    assert bare == negative.strip()
    same = format_prompts(dataclasses.replace(params, negative_metadata="same")).uncond
    assert same.endswith(
        "This video is of 720x1280 resolution." if frames > 1 else "This image is of 720x1280 resolution."
    )
