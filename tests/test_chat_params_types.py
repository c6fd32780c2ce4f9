"""ChatParams.validate checks each field's type first (worldserve/param_types.py): a wrong type is a ParamError
naming the request field, not a raw TypeError (`temperature="1"`), a RuntimeError in the sampler (`seed=1.5`) or
in the prompt's rendering (a message's `content=5`), nor accepted (`max_tokens=2.5`). A string `stop` is one stop
string, as vLLM's SamplingParams takes it (it had been iterated into "E", "N", "D"); a numpy integer seed samples
as the int it is.
"""

from __future__ import annotations

import numpy as np
import pytest

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart
from worldserve.param_errors import ParamError
from worldserve.params import INT64
from worldserve.sampling.tokens import TokenSampler

HELLO = (ChatMessage(role="user", content="Hello"),)

REFUSED = [  # (field, value, the error's param, its message)
    ("max_tokens", 2.5, "max_tokens", "max_tokens must be an integer, got float"),
    ("max_tokens", "16", "max_tokens", "max_tokens must be an integer, got str"),
    ("temperature", "1", "temperature", "temperature must be a number, got str"),
    ("temperature", None, "temperature", "temperature must be a number, got None"),
    ("top_p", "0.5", "top_p", "top_p must be a number, got str"),
    ("top_k", "5", "top_k", "top_k must be an integer, got str"),
    ("top_k", 5.0, "top_k", "top_k must be an integer, got float"),
    ("seed", 1.5, "seed", "seed must be an integer, got float"),
    ("seed", "1", "seed", "seed must be an integer, got str"),
    ("seed", True, "seed", "seed must be an integer, got bool"),
    ("presence_penalty", "0", "presence_penalty", "presence_penalty must be a number, got str"),
    ("repetition_penalty", None, "repetition_penalty", "repetition_penalty must be a number, got None"),
    ("min_p", "0.1", "min_p", "min_p must be a number, got str"),
    ("min_tokens", 1.0, "min_tokens", "min_tokens must be an integer, got float"),
    ("top_logprobs", "2", "top_logprobs", "top_logprobs must be an integer, got str"),
    ("stop", ("END", 5), "stop", "stop must be a list of strings, got an item of type int"),
    ("stop", 5, "stop", "stop must be a list, got int"),
    ("stop_token_ids", (1, 2.0), "stop_token_ids", "stop_token_ids must be a list of integers, got an item of type float"),
    ("bad_words", "bad", "bad_words", "bad_words must be a list, got str"),
    ("logprobs", "yes", "logprobs", "logprobs must be a boolean, got str"),
    ("ignore_eos", 1, "ignore_eos", "ignore_eos must be a boolean, got int"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value", "param", "message"), REFUSED, ids=[f"{r[0]}={r[1]!r}" for r in REFUSED]
)
def test_a_wrong_type_is_a_param_error_naming_the_field(field, value, param, message):
    with pytest.raises(ParamError) as error:
        ChatParams(messages=HELLO, **{field: value}).validate()
    assert (error.value.param, error.value.message) == (param, message)


@pytest.mark.parametrize(
    ("messages", "message"),
    [((ChatMessage(role="user", content=5),), "messages[0].content must be a string or a list of ChatParts, got int"),
     ((*HELLO, ChatMessage(role="user", content=("hi",))),
      "messages[1].content must be a string or a list of ChatParts, got tuple"),
     ((ChatMessage(role=None, content="hi"),), "messages[0].role must be a string, got None"),
     (({"role": "user", "content": "hi"},), "messages[0] must be a ChatMessage, got dict")],
)  # fmt: skip
def test_a_message_of_the_wrong_type_is_a_param_error_naming_messages(messages, message):
    with pytest.raises(ParamError) as error:
        ChatParams(messages=messages).validate()
    assert (error.value.param, error.value.message) == ("messages", message)


def test_raw_prompt_ids_must_be_integers():
    with pytest.raises(ParamError) as error:
        ChatParams(prompt_ids=(1, 2.0)).validate()
    assert error.value.param == "prompt"


def test_parts_are_accepted_as_a_tuple_or_a_list():
    for parts in ((ChatPart(type="text", text="hi"),), [ChatPart(type="text", text="hi")]):
        ChatParams(messages=(ChatMessage(role="user", content=parts),)).validate()


def test_a_string_stop_is_one_stop_string_as_in_vllm():
    params = ChatParams(messages=HELLO, stop="END").validate()
    assert params.stop == ("END",)
    assert ChatParams(messages=HELLO, stop=["END", "STOP"]).validate().stop == ["END", "STOP"]


NUMPY = [
    ("max_tokens", np.int64(8)), ("top_k", np.int32(5)), ("seed", np.int64(3)), ("temperature", np.float32(0.7)),
    ("top_p", np.float64(0.9)), ("min_p", np.float32(0.1)), ("repetition_penalty", np.float64(1.1)),
    ("stop_token_ids", (np.int64(7),)), ("logprobs", np.bool_(True)), ("temperature", 1),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), NUMPY, ids=[f"{f}={type(v).__name__}" for f, v in NUMPY])
def test_numpy_scalars_are_accepted(field, value):
    ChatParams(messages=HELLO, **{field: value}).validate()


def test_a_numpy_seed_samples_as_its_int_and_its_choices_wrap_as_int64():
    """torch's manual_seed refuses a numpy integer ("an integer is required"), and choice_seed's int64 wrap
    overflowed in numpy: the seed is kept as the int it is."""
    params = ChatParams(messages=HELLO, seed=np.int64(3)).validate()
    assert type(params.seed) is int and params.seed == 3
    seeds = [
        TokenSampler.of(p, prompt_ids=(1, 2)).generator.initial_seed() for p in (params, ChatParams(seed=3))
    ]
    assert seeds == [3, 3]
    last = ChatParams(messages=HELLO, seed=np.int64(INT64 - 1)).validate()
    assert [c.seed for c in last.choices(2)] == [INT64 - 1, -INT64]


def test_none_list_fields_are_empty_as_in_vllm():
    """vLLM's SamplingParams takes stop / stop_token_ids / bad_words None as none (they were refused)."""
    p = ChatParams(messages=(ChatMessage(role="user", content="hi"),), stop=None, stop_token_ids=None,
                   bad_words=None)  # fmt: skip
    p.validate()
    assert (p.stop, p.stop_token_ids, p.bad_words) == ((), (), ())
