"""The context refusals worded once (worldserve/context_limits.py) as vLLM's renderer words them, used by the
Reasoner's own budget check (runner/chat_prompt.py `completion_budget`, reached by /v1/responses, in-process
and CLI callers) and its byte-size check before tokenizing; /v1/responses answers them with its own field.
"""

from __future__ import annotations

import httpx
import pytest

from worldserve.chat_params import ChatMessage, ChatParams
from worldserve.param_errors import ParamError, TextTooLong
from worldserve.runner.chat_prompt import completion_budget

HI = (ChatMessage(role="user", content="hi"),)
MODEL = "test-model"


def test_completion_budget_refuses_in_vllm_s_renderer_words():
    """A max_tokens past the whole context, a prompt and max_tokens past it together, and a prompt that fills
    it with no max_tokens (vLLM's default budget, the room, is 0) get vLLM's texts, parameter suffix included
    (the old words were "you requested T tokens (N in the messages, M in the completion)")."""
    with pytest.raises(ParamError) as err:
        completion_budget(ChatParams(messages=HI, max_tokens=5000), 10, 4096)
    assert err.value.param == "max_tokens"
    assert err.value.message == ("max_tokens=5000 cannot be greater than max_model_len=max_total_tokens=4096. "
                                 "Please request fewer output tokens. (parameter=max_tokens, value=5000)")  # fmt: skip
    with pytest.raises(ParamError) as err:
        completion_budget(ChatParams(messages=HI, max_tokens=100), 4000, 4096)
    assert err.value.param == "input_tokens"
    assert err.value.message == (
        "This model's maximum context length is 4096 tokens. However, you requested 100 output tokens and your "
        "prompt contains 4000 input tokens, for a total of 4100 tokens. Please reduce the length of the input "
        "prompt or the number of requested output tokens. (parameter=input_tokens, value=4000)"
    )
    with pytest.raises(ParamError) as err:
        completion_budget(ChatParams(messages=HI), 4096, 4096)
    assert err.value.param == "max_tokens"
    assert err.value.message == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    assert completion_budget(ChatParams(messages=HI), 4095, 4096) == 1
    assert completion_budget(ChatParams(messages=HI, max_tokens=96), 4000, 4096) == 96


def test_the_byte_size_check_is_worded_as_vllm_s_character_check(reasoner):
    """A text too large for the room max_tokens leaves, by its UTF-8 size alone: vLLM's character-check
    sentence, in bytes (what the bound counts), the limit the room's tokens can hold, naming the field."""
    prompts = reasoner.prompts
    per = prompts.text_bound.bytes_per_token
    text = "x" * ((4096 - 1000 + 64) * per + 1)
    with pytest.raises(TextTooLong) as err:
        prompts.build(ChatParams(messages=(ChatMessage(role="user", content=text),), max_tokens=1000),
                      max_tokens=4096)  # fmt: skip
    message = err.value.message
    assert err.value.param == "messages" and message.startswith(
        "This model's maximum context length is 4096 tokens. However, you requested 1000 output tokens and "
        "your prompt contains "
    ), message
    limit = (3096 + 64) * per
    assert (
        f"bytes in the messages (more than {limit} bytes, which is the upper bound for 3096 input tokens)"
        in message
    )
    assert message.endswith("(parameter=messages, value=" + message.split("contains ")[1].split(" ")[0] + ")")
    with pytest.raises(TextTooLong) as err:
        prompts.encode(text, max_tokens=4096 - 1000)
    assert "However, your prompt contains" in err.value.message and err.value.param == "prompt"


def test_responses_refuse_max_output_tokens_past_the_context_in_vllm_s_words(reasoner_url):
    """vLLM's Responses renderer names max_output_tokens (its TokenizeParams' max_output_tokens_param) before
    any other work; a prompt and budget past the context are refused by their token counts (input_tokens)."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 5000}
    r = httpx.post(reasoner_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_output_tokens" and err["type"] == "BadRequestError", err
    assert err["message"] == ("max_output_tokens=5000 cannot be greater than max_model_len=max_total_tokens=4096. "
                              "Please request fewer output tokens. (parameter=max_output_tokens, value=5000)")  # fmt: skip
    body = {"model": MODEL, "input": "hello " * 1500, "max_output_tokens": 3000}
    r = httpx.post(reasoner_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input_tokens", err
    assert "However, you requested 3000 output tokens and your prompt contains" in err["message"], err
    assert "(parameter=input_tokens, value=" in err["message"], err
