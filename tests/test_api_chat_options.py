"""POST /v1/chat/completions request options on a real uvicorn (tiny Reasoner): empty structured-output fields
ask for nothing (tests/test_api_structured_outputs.py has the constraints, tests/test_api_tool_calls.py the
tools),
`stream_options.continuous_usage_stats` puts the running usage on every streamed chunk, as vLLM does;
`mm_processor_kwargs` change the vision token counts, `chat_template_kwargs` reach the chat template (the
tiny tokenizer's template gets Qwen3's `enable_thinking` branch here), an assistant turn's `reasoning` reaches
the template (which renders it as Qwen3's does, in a think block), and images / videos that Qwen3-VL's
`smart_resize` cannot take are a 400 naming their part, before any model work.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from reasoner_helpers import EARLIER_THOUGHTS, THINKING_TEMPLATE, TURN_OPEN
from serving_helpers import serve_app

from worldserve.weights.tokenizer_fixture import CHAT_TEMPLATE

MODEL = "test-model"
HI = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def reasoner(tiny_ckpt):
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    tok.chat_template = THINKING_TEMPLATE
    return Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=4096)


@pytest.fixture(scope="module")
def url(reasoner, tmp_path_factory):
    """A uvicorn serving the tiny Reasoner (chat) over a FakeBackend engine; yields its base URL."""
    from worldserve.api.app import build_app
    from worldserve.config import SchedulerConfig
    from worldserve.engine.client import EngineClient
    from worldserve.engine.engine import Engine
    from worldserve.engine.fake_backend import FakeBackend
    from worldserve.engine.jobs import JobStore

    store = JobStore(tmp_path_factory.mktemp("chat-options") / "store")
    engine = Engine(FakeBackend(), store, SchedulerConfig(max_batch_size=1), encoder=lambda *a, **k: b"")
    client = EngineClient(engine, store, model_name=MODEL, max_queued_requests=16, chat_backend=reasoner)
    with serve_app(build_app(client, shutdown_timeout_s=1.0), name="test-chat-options-uvicorn") as base:
        yield base


def _stream(url: str, **body) -> list[dict]:
    """POST a streaming chat request -> the JSON payloads of its SSE events (checks the `[DONE]` ending)."""
    body = {"model": MODEL, "messages": HI, "stream": True, **body}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [({"guided_json": None}, 200, None), ({"structured_outputs": None, "guided_decoding_backend": None}, 200, None),
     ({"guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": "[ ]*"}, 200, None),
     ({"guided_regex": ""}, 200, None), ({"guided_choice": []}, 400, "guided_choice"),
     ({"structured_outputs": {}}, 400, "structured_outputs"),
     ({"guided_json": False}, 400, "guided_json"), ({"guided_regex": True}, 400, "guided_regex")],
)  # fmt: skip
def test_null_constraint_fields_ask_for_nothing_and_empty_ones_count(url, fields, status, param):
    """As vLLM counts them: null asks for nothing, nor do the guided-decoding options without a constraint;
    an empty value is a constraint (an empty regex: the empty text; an empty choice list or an empty
    structured_outputs: a 400); a boolean is no constraint, a 400 as in vLLM (false had been taken as none)."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == param
    elif fields.get("guided_regex") == "":
        assert r.json()["choices"][0]["message"]["content"] == ""


def test_continuous_usage_stats_on_every_chunk(url):
    """include_usage + continuous_usage_stats: every chunk carries {prompt, completion, total} so far; the
    counts grow to the final usage chunk's, which matches the non-streaming answer's usage."""
    kw = {"max_tokens": 6, "temperature": 1.0, "seed": 5}
    payloads = _stream(url, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
    assert all("usage" in p and p["usage"] is not None for p in payloads), payloads
    usages = [p["usage"] for p in payloads]
    prompt = usages[0]["prompt_tokens"]
    assert prompt > 0 and usages[0]["completion_tokens"] == 0 and usages[0]["total_tokens"] == prompt
    for u in usages:
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"], u
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] > 0
    # content chunks count the tokens decoded so far: at least one token per chunk with text
    content = [p for p in payloads if p["choices"] and p["choices"][0]["delta"].get("content")]
    assert all(p["usage"]["completion_tokens"] >= 1 for p in content)
    finish = [p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and payloads[-1]["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (a chunk's usage has null details too)
    assert [finish[0]["usage"][k] for k in counts] == [payloads[-1]["usage"][k] for k in counts]
    full = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, **kw}, timeout=60)
    assert {k: v for k, v in full.json()["usage"].items() if v is not None} == {
        k: v for k, v in payloads[-1]["usage"].items() if v is not None
    }


def test_continuous_usage_stats_with_n_choices(url):
    """n > 1, as vLLM: a choice's chunk carries the prompt (counted once) and that choice's tokens so far;
    the final usage chunk sums the choices."""
    kw = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3}
    payloads = _stream(url, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
    assert all(p.get("usage") for p in payloads)
    *chunks, final = payloads
    assert final["choices"] == []
    prompt = final["usage"]["prompt_tokens"]
    last: dict[int, int] = {}
    for p in chunks:
        (choice,) = p["choices"]
        u = p["usage"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
        assert u["completion_tokens"] >= last.get(choice["index"], 0)  # each choice's own running count
        last[choice["index"]] = u["completion_tokens"]
    assert sorted(last) == [0, 1, 2]
    assert final["usage"]["completion_tokens"] == sum(last.values())
    assert final["usage"]["total_tokens"] == prompt + sum(last.values())


@pytest.mark.parametrize(
    ("options", "usage_chunks"),
    [
        ({"continuous_usage_stats": True}, 0),  # vLLM: continuous usage needs include_usage
        ({"include_usage": False, "continuous_usage_stats": True}, 0),
        ({"include_usage": True}, 1),  # only the final, choice-less chunk
        ({"include_usage": True, "continuous_usage_stats": False}, 1),
    ],
)
def test_usage_chunks_without_continuous_stats(url, options, usage_chunks):
    """Without include_usage no chunk carries usage; with it but not continuous, only the last chunk."""
    payloads = _stream(url, stream_options=options, max_tokens=3, seed=2)
    with_usage = [p for p in payloads if "usage" in p]
    assert len(with_usage) == usage_chunks
    if usage_chunks:
        assert with_usage[0] is payloads[-1] and payloads[-1]["choices"] == []


def test_stream_options_without_stream_is_a_400(url):
    """vLLM refuses stream_options on a non-streaming request; so does this server."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "Stream options can only be defined when `stream=True`." in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "stream_options"


def test_empty_stream_options_without_stream_is_accepted(url):
    """vLLM's rule tests stream_options for truthiness: an empty object on a non-streaming request is fine."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, "stream_options": {}}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


# ---------------------------------------------------------------- media shapes, mm_processor_kwargs, templates
def _chat(url: str, content, **body) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": content}],
            **body}  # fmt: skip
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def _image_part(h: int, w: int, seed: int = 0) -> dict:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }


def _video_part(h: int, w: int, frames: int = 8) -> dict:
    from worldserve.media.video import encode_mp4

    clip = np.random.default_rng(1).integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
    data = base64.b64encode(encode_mp4(clip, 24.0)).decode()
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + data}}


def _prompt_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("h", "w"), [(10, 8000), (8000, 10), (1, 201), (3, 700)])
@pytest.mark.parametrize("stream", [False, True])
def test_images_smart_resize_cannot_take_are_a_400_naming_the_part(url, h, w, stream):
    """An aspect ratio over 200 (Qwen2-VL's smart_resize refuses it) is a 400 naming the part and the
    limit, streaming or not (it was a 500 from the chat worker); the chat still works afterwards."""
    content = [{"type": "text", "text": "What is it?"}, _image_part(h, w)]
    r = _chat(url, content, stream=stream)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].image_url" and err["type"] == "BadRequestError", err
    assert "aspect ratio" in err["message"] and "200" in err["message"] and f"{w}x{h}" in err["message"], err
    assert err["message"].startswith(f"Invalid {err['param']}: "), err  # (as every other media error)
    assert _prompt_tokens(_chat(url, [_image_part(40, 56)])) > 0


def test_tiny_and_extreme_but_allowed_images_work(url, reasoner):
    """1x1, 3x1 and ratios of exactly 200 are scaled up to the processor's minimum and answered; 1x201 is not."""
    for h, w in [(1, 1), (3, 1), (1, 200), (200, 1), (2, 400)]:
        assert _prompt_tokens(_chat(url, [_image_part(h, w)])) > 60, (h, w)
    assert _chat(url, [_image_part(1, 201)]).status_code == 400
    # the Reasoner itself (a caller that skips the API's check) answers a ParamError, not a ValueError
    from worldserve.chat_params import ChatMessage, ChatParams, ChatPart
    from worldserve.params import ParamError

    image = np.zeros((1, 300, 3), np.uint8)
    with pytest.raises(ParamError, match="aspect ratio") as info:
        reasoner.start(
            ChatParams(messages=(ChatMessage(role="user", content=(ChatPart(type="image", image=image),)),))
        )
    assert info.value.param == "messages"


def test_videos_smart_resize_cannot_take_are_a_400_naming_the_part(url):
    """A 4x1000 clip (ratio 250) is a 400 naming its part; a 2x2 clip is scaled up and answered."""
    r = _chat(url, [{"type": "text", "text": "hi"}, _video_part(4, 1000)])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].video_url" and "aspect ratio" in err["message"], err
    assert err["message"].startswith(f"Invalid {err['param']}: the video is 1000x4 pixels"), err
    assert _prompt_tokens(_chat(url, [_video_part(2, 2)])) > 0


def test_mm_processor_kwargs_set_the_pixel_budgets(url):
    """size / min_pixels / max_pixels (and images_kwargs) change the image's token count as Qwen3-VL's
    processor would; `size` reaches videos too, `fps` samples the video; the default is unchanged."""
    image = [_image_part(40, 56), {"type": "text", "text": "hi"}]
    default = _prompt_tokens(_chat(url, image))
    small = {"size": {"shortest_edge": 1024, "longest_edge": 4096}}
    tokens = _prompt_tokens(_chat(url, image, mm_processor_kwargs=small))
    # 40x56 -> 32x64 (2048 pixels, inside the budget): 1 x 2 x 4 patches -> 2 merged tokens, not 14 * 20 / 4
    assert tokens == default - 14 * 20 // 4 + 2, (default, tokens)
    for same in ({"min_pixels": 1024, "max_pixels": 4096}, {"images_kwargs": small},
                 {"size": {"longest_edge": 4096}, "min_pixels": 1024}):  # fmt: skip
        assert _prompt_tokens(_chat(url, image, mm_processor_kwargs=same)) == tokens, same
    assert _prompt_tokens(_chat(url, image, mm_processor_kwargs={"max_pixels": 1})) == default - 70 + 1
    video = [_video_part(64, 96, frames=24), {"type": "text", "text": "hi"}]
    plain = _prompt_tokens(_chat(url, video))
    assert _prompt_tokens(_chat(url, video, mm_processor_kwargs=small)) < plain
    assert _prompt_tokens(_chat(url, video, mm_processor_kwargs={"videos_kwargs": small})) < plain
    assert _prompt_tokens(_chat(url, video, mm_processor_kwargs={"fps": 8})) > plain
    assert _prompt_tokens(_chat(url, video, mm_processor_kwargs={"min_pixels": 1024})) == plain  # images only


@pytest.mark.parametrize(
    ("mm", "param", "needle"),
    [
        ({"do_resize": False}, "mm_processor_kwargs.do_resize", "not supported"),
        ({"images_kwargs": {"fps": 2}}, "mm_processor_kwargs.images_kwargs.fps", "not supported"),
        ({"videos_kwargs": 3}, "mm_processor_kwargs.videos_kwargs", "must be an object"),
        ({"size": {"height": 64, "width": 64}}, "mm_processor_kwargs.size", "shortest_edge"),
        ({"max_pixels": 0}, "mm_processor_kwargs", "[1, 16777216]"),
        ({"max_pixels": 2**25}, "mm_processor_kwargs", "[1, 16777216]"),
        ({"min_pixels": "big"}, "mm_processor_kwargs", "integers"),
        (
            {"min_pixels": 8192, "max_pixels": 4096},
            "mm_processor_kwargs",
            "min pixels 8192 > max pixels 4096",
        ),
        ({"fps": -1}, "mm_processor_kwargs", "fps must be > 0"),
        ({"num_frames": 4, "fps": 2}, "mm_processor_kwargs", "mutually exclusive"),
        ({"videos_kwargs": {"fps": 4}, "fps": 2}, "mm_processor_kwargs.fps", "twice"),
        ({"fps": True}, "mm_processor_kwargs.fps", "not a boolean"),
    ],
)
def test_bad_mm_processor_kwargs_are_a_400_naming_the_key(url, mm, param, needle):
    r = _chat(url, "hi", mm_processor_kwargs=mm)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    both = _chat(url, "hi", mm_processor_kwargs={"fps": 2}, media_io_kwargs={"video": {"fps": 4}})
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]
    for video in ([], "fast", {"speed": 2}):  # (an empty list was taken as no setting)
        r = _chat(url, "hi", media_io_kwargs={"video": video})
        assert r.status_code == 400 and r.json()["error"]["param"] == "media_io_kwargs", (video, r.text)


def test_the_servers_default_chat_template_kwargs_lie_under_the_requests(url, reasoner, tmp_path):
    """--default-chat-template-kwargs (vLLM's): every chat renders with them unless its own
    chat_template_kwargs set the same key; /tokenize's chat form too. A bad one stops the start naming it."""
    from worldserve.api.app import build_app
    from worldserve.api.settings import AppSettings
    from worldserve.commands.serve import template_defaults
    from worldserve.config import SchedulerConfig
    from worldserve.config_values import JsonObject
    from worldserve.engine.client import EngineClient
    from worldserve.engine.engine import Engine
    from worldserve.engine.fake_backend import FakeBackend
    from worldserve.engine.jobs import JobStore

    plain = _prompt_tokens(_chat(url, "hi"))
    off = _prompt_tokens(_chat(url, "hi", chat_template_kwargs={"enable_thinking": False}))
    store = JobStore(tmp_path / "store")
    engine = Engine(FakeBackend(), store, SchedulerConfig(max_batch_size=1), encoder=lambda *a, **k: b"")
    client = EngineClient(engine, store, model_name=MODEL, max_queued_requests=16, chat_backend=reasoner)
    settings = AppSettings(template_defaults=template_defaults(JsonObject('{"enable_thinking": false}')))
    with serve_app(
        build_app(client, settings, shutdown_timeout_s=1.0), name="test-template-defaults"
    ) as other:
        assert _prompt_tokens(_chat(other, "hi")) == off
        assert _prompt_tokens(_chat(other, "hi", chat_template_kwargs={"enable_thinking": True})) == plain
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(other + "/tokenize", json=body, timeout=60).json()["count"] == off
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: chat_template_kwargs.tokenize"):
        template_defaults(JsonObject('{"tokenize": false}'))


def test_chat_template_kwargs_reach_the_template(url):
    """enable_thinking=false renders Qwen3's empty think block (more prompt tokens, through the openai
    client's extra_body too); a key the template does not use changes nothing; apply_chat_template's own
    arguments this server sets are a 400 naming the key. The four vLLM passes the template from the request
    may come here too and win, as vLLM lays chat_template_kwargs over them: the same prompt as the request's
    own fields give; its switches must be booleans."""
    import openai

    plain = _prompt_tokens(_chat(url, "hi"))
    off = _prompt_tokens(_chat(url, "hi", chat_template_kwargs={"enable_thinking": False}))
    assert off > plain
    assert _prompt_tokens(_chat(url, "hi", chat_template_kwargs={"enable_thinking": True, "x": 1})) == plain
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    resp = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert resp.usage.prompt_tokens == off
    for key in ("tokenize", "chat_template", "messages", "return_dict"):
        r = _chat(url, "hi", chat_template_kwargs={key: False})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}", r.text
    bare = _prompt_tokens(_chat(url, "hi", add_generation_prompt=False))
    assert bare < plain
    assert _prompt_tokens(_chat(url, "hi", chat_template_kwargs={"add_generation_prompt": False})) == bare
    open_turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The sky is"}]
    switches = {"add_generation_prompt": False, "continue_final_message": True}
    own = _prompt_tokens(_chat(url, None, messages=open_turn, **switches))
    assert _prompt_tokens(_chat(url, None, messages=open_turn, chat_template_kwargs=switches)) == own
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    assert _prompt_tokens(_chat(url, "hi", chat_template_kwargs={"tools": [tool]})) > plain
    r = _chat(url, None, messages=open_turn, chat_template_kwargs={"continue_final_message": True})
    assert r.status_code == 400, r.text  # (with the request's add_generation_prompt, true: the switch named)
    assert r.json()["error"]["param"] == "chat_template_kwargs.continue_final_message", r.text
    r = _chat(url, "hi", chat_template_kwargs={"add_generation_prompt": "no"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt", r.text


EARLIER = [
    {"role": "user", "content": "Why is the sky blue?"},
    {
        "role": "assistant",
        "content": "Blue light scatters most.",
        "reasoning": "Rayleigh: short waves scatter.",
    },
    {"role": "user", "content": "And at sunset?"},
]


def _rendered(url: str, messages: list[dict]) -> tuple[str, int]:
    """(the prompt text, its token count) of `messages`, through /tokenize and /detokenize."""
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=30)
    return back.json()["prompt"], len(tokens)


def test_custom_roles_reach_the_template_as_vllm_passes_them(url):
    """vLLM takes any role (its CustomChatCompletionMessageParam; OpenAI's legacy `function` role too) and
    leaves it to the chat template, which here writes `<|im_start|>` + role; a chat with them answers."""
    import openai

    messages = [
        {"role": "user", "content": "What is 6 x 7?"},
        {"role": "function", "name": "calc", "content": "42"},
        {"role": "wizard", "content": "Forty-two."},
    ]
    text, count = _rendered(url, messages)
    assert "<|im_start|>function\n42<|im_end|>\n<|im_start|>wizard\nForty-two.<|im_end|>" in text, text
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    resp = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert resp.usage.prompt_tokens == count and resp.choices[0].message.role == "assistant"


def test_an_assistant_turns_reasoning_reaches_the_template(url):
    """vLLM's interleaved thinking: an assistant message's `reasoning` goes to the chat template (as
    `reasoning` and `reasoning_content`), here rendered in Qwen3's think block before that turn's answer; the
    chat completion's prompt is that prompt (the openai client). As in vLLM, `reasoning_content` on input is
    not read, nor is a user message's `reasoning`."""
    import openai

    text, count = _rendered(url, EARLIER)
    turn = "<|im_start|>assistant\n<think>\nRayleigh: short waves scatter.\n</think>\n\nBlue light scatters most."
    assert turn + "<|im_end|>\n<|im_start|>user\nAnd at sunset?" in text, text
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    resp = oai.chat.completions.create(model=MODEL, messages=EARLIER, max_tokens=1)
    assert resp.usage.prompt_tokens == count
    without = [EARLIER[0], {"role": "assistant", "content": EARLIER[1]["content"]}, EARLIER[2]]
    plain, fewer = _rendered(url, without)
    assert "<think>" not in plain and fewer < count
    old_name = [EARLIER[0], {**without[1], "reasoning_content": EARLIER[1]["reasoning"]}, EARLIER[2]]
    assert _rendered(url, old_name) == (plain, fewer)
    user = [{**EARLIER[0], "reasoning": "not a turn's thoughts"}, without[1], EARLIER[2]]
    assert _rendered(url, user) == (plain, fewer)


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_the_template_gets_the_thoughts_under_both_names(tiny_ckpt, key):
    """Templates read either name (Qwen3's `reasoning_content`, newer ones `reasoning`): vLLM sets both."""
    from transformers import AutoTokenizer

    from worldserve.chat_params import ChatMessage, ChatParams
    from worldserve.runner.chat_prompt import ChatPromptBuilder

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    tok.chat_template = CHAT_TEMPLATE.replace(
        TURN_OPEN, TURN_OPEN + EARLIER_THOUGHTS.replace("reasoning_content", key)
    )
    builder = ChatPromptBuilder(tok, None, None, image_token_id=-1, video_token_id=-2)
    messages = (
        ChatMessage(role="user", content="Q?"),
        ChatMessage(role="assistant", content="A.", reasoning="T."),
    )
    ids = builder.build(ChatParams(messages=messages)).input_ids
    assert "<|im_start|>assistant\n<think>\nT.\n</think>\n\nA.<|im_end|>" in tok.decode(ids)


@pytest.fixture(scope="module")
def url_with_defaults(reasoner, tmp_path_factory):
    """The same Reasoner behind a server with --media-io-kwargs '{"video": {"fps": 8}}' and
    --mm-processor-kwargs '{"max_pixels": 1}'."""
    from serving_helpers import serve_reasoner

    from worldserve.api.chat_options import MediaDefaults

    defaults = MediaDefaults({"video": {"fps": 8}}, {"max_pixels": 1})
    folder = tmp_path_factory.mktemp("chat-media-defaults")
    with serve_reasoner(
        reasoner, folder, model=MODEL, name="media-defaults-uvicorn", media_defaults=defaults
    ) as u:
        yield u


def test_server_media_defaults_lie_under_the_request_s_own(url, url_with_defaults):
    """--mm-processor-kwargs / --media-io-kwargs answer as if each request had sent them, and a request's own
    values win key by key (video sampling set by the request in one field sets it alone)."""
    image = [_image_part(40, 56), {"type": "text", "text": "hi"}]
    assert _prompt_tokens(_chat(url_with_defaults, image)) == _prompt_tokens(
        _chat(url, image, mm_processor_kwargs={"max_pixels": 1})
    )
    own = {"min_pixels": 1024, "max_pixels": 4096}
    assert _prompt_tokens(_chat(url_with_defaults, image, mm_processor_kwargs=own)) == _prompt_tokens(
        _chat(url, image, mm_processor_kwargs=own)
    )
    video = [_video_part(64, 96, frames=24), {"type": "text", "text": "hi"}]
    plain = lambda **kw: _prompt_tokens(_chat(url, video, **kw))  # noqa: E731
    served = lambda **kw: _prompt_tokens(_chat(url_with_defaults, video, **kw))  # noqa: E731
    assert served() == plain(media_io_kwargs={"video": {"fps": 8}}, mm_processor_kwargs={"max_pixels": 1})
    # the request's fps in mm_processor_kwargs: the server's media_io fps steps aside (no "not both" 400)
    assert served(mm_processor_kwargs={"fps": 2}) == plain(mm_processor_kwargs={"fps": 2, "max_pixels": 1})
    # the request's num_frames joins the server's fps in media_io_kwargs.video (the fewer frames)
    assert served(media_io_kwargs={"video": {"num_frames": 4}}) == plain(
        media_io_kwargs={"video": {"fps": 8, "num_frames": 4}}, mm_processor_kwargs={"max_pixels": 1}
    )
    bad = _chat(url_with_defaults, video, media_io_kwargs="fast")  # the request's own bad value: its 400
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "media_io_kwargs", bad.text
