"""--generation-config / --override-generation-config (sampling/chat_defaults.py): the values Reasoner requests
take for the sampling fields they omit, read as vLLM reads them (the model's generation_config.json, vLLM's
neutral values, another folder's file, the override's JSON on top), refused at start when bad, and applied over
real HTTP by chat, text completions and the Responses API (a request's own values win; max_new_tokens a default
budget, or a bound when it comes from a folder or the override)."""

from __future__ import annotations

import json
import logging

import pytest
from cli_helpers import run_cli
from reasoner_helpers import run_to_end
from serving_helpers import serve_reasoner

from worldserve.chat_params import ChatMessage, ChatParams
from worldserve.sampling.chat_defaults import NEUTRAL, ChatDefaults

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "eos_token_id": [1, 2], "max_new_tokens": 64, "min_p": None}  # fmt: skip


def _folder(path, values):
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(values))
    return path


def test_defaults_come_from_the_model_file_a_folder_or_the_override(tmp_path):
    model = _folder(tmp_path / "model", QWEN_LIKE)
    auto = ChatDefaults.load("auto", model)
    assert (auto.temperature, auto.top_p, auto.top_k, auto.repetition_penalty, auto.min_p) == (
        0.7,
        0.8,
        20,
        1.05,
        0.0,
    )
    assert (
        auto.max_tokens == 64 and auto.max_tokens_cap is None
    )  # the model's budget is a default, not a bound
    assert auto.budget(None) == 64 and auto.budget(500) is None
    assert auto.source == str(model / "generation_config.json")
    assert ChatDefaults.load("auto", tmp_path / "empty") == NEUTRAL  # no file: vLLM's neutral values
    assert ChatDefaults.load("vllm", model) == ChatDefaults(
        eos_token_ids=(1, 2)
    )  # its sampling values unread
    other = ChatDefaults.load(
        str(_folder(tmp_path / "other", {"temperature": 0.2, "max_new_tokens": 8})), model
    )
    assert other.temperature == 0.2 and other.top_k == 0 and other.max_tokens_cap == 8 == other.max_tokens
    assert (
        other.budget(500) == 8 and other.budget(None) == 8
    )  # a folder's max_new_tokens bounds every request
    over = ChatDefaults.load(
        "auto", model, {"temperature": 0.5, "max_new_tokens": 10, "top_p": None, "seed": 3}
    )
    assert over.temperature == 0.5 and over.top_p == 0.8 and over.max_tokens == 10 == over.max_tokens_cap
    assert over.source.endswith(" + --override-generation-config")  # (null and unknown keys: not read)
    assert (
        ChatDefaults.load("vllm", model, {"top_k": 5.0}).top_k == 5
        and ChatDefaults.load("vllm", None) == NEUTRAL
    )
    assert over.changed() == {"temperature": 0.5, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                              "max_tokens": 10, "max_tokens_cap": 10}  # fmt: skip


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a number >= 0, got -0.1"),
        ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= -1, got 2.5"),
        ({"min_p": 2}, "min_p must be a number in [0, 1], got 2"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0, got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
        ({"temperature": "hot"}, 'temperature must be a number >= 0, got "hot"'),
        ({"top_k": True}, "top_k must be an integer >= -1, got true"),
    ],
)
def test_a_value_the_sampler_cannot_take_is_refused_naming_its_file_or_flag(tmp_path, values, message):
    model = _folder(tmp_path / "model", values)
    with pytest.raises(ValueError) as error:
        ChatDefaults.load("auto", model)
    assert str(error.value) == f"{model / 'generation_config.json'}: {message}"
    with pytest.raises(ValueError) as error:
        ChatDefaults.load("vllm", model, values)
    assert str(error.value) == f"--override-generation-config: {message}"


def test_a_folder_without_the_file_or_a_broken_file_stops_the_start(tmp_path, caplog):
    from test_serve_compat_flags import parse_args

    from worldserve.commands import serve

    with pytest.raises(ValueError, match="--generation-config .*: no such folder"):
        ChatDefaults.load(str(tmp_path / "missing"), None)
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        ChatDefaults.load(str(tmp_path), None)
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        ChatDefaults.load(str(tmp_path), None)
    with pytest.raises(ValueError, match="--generation-config: empty"):
        serve.engine_config(parse_args("--generation-config", ""))
    with pytest.raises(SystemExit):  # argparse: not a JSON object (exit 2)
        parse_args("--override-generation-config", "[1]")
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):  # before anything binds or loads
        assert serve.run(parse_args("--generation-config", str(tmp_path / "missing"), "--port", "0")) == 2
        assert serve.run(parse_args("--override-generation-config", '{"top_p": 2}', "--port", "0")) == 2
    assert "no such folder" in caplog.text and "--override-generation-config: top_p must be" in caplog.text


def test_load_backend_reads_the_checkpoint_generation_config(tiny_copy, caplog):
    from worldserve.commands import serve_backend
    from worldserve.config import ModelConfig, ParallelConfig, ReasonerConfig, SchedulerConfig

    _folder(tiny_copy, {"temperature": 0.6, "top_k": 20, "max_new_tokens": 32})
    cfg = ModelConfig(model=str(tiny_copy), device="cpu", warmup_shapes="none")
    with caplog.at_level(logging.WARNING, logger="worldserve.serve"):
        reasoner = serve_backend.load_backend(
            cfg, ParallelConfig(), SchedulerConfig(), ReasonerConfig(max_model_len=4096)
        )[2]
    assert reasoner.sampling_defaults == ChatDefaults(
        temperature=0.6,
        top_k=20,
        max_tokens=32,
        source=str(tiny_copy / "generation_config.json"),
        given=frozenset({"temperature", "top_k", "max_tokens"}),
    )
    assert "take temperature 0.6, top_k 20, max_tokens 32 from" in caplog.text
    shown = run_cli("info", tiny_copy).stdout  # worldserve info shows what serve will take
    assert f"chats:      temperature=0.6, top_p=1.0, top_k=20, min_p=0.0, repetition_penalty=1.0, max_tokens=32 " \
           f"({tiny_copy / 'generation_config.json'})" in shown  # fmt: skip
    _folder(tiny_copy, {"top_p": 3})
    assert (
        "error=" in run_cli("info", tiny_copy).stdout and "top_p must be" in run_cli("info", tiny_copy).stdout
    )
    assert serve_backend.chat_defaults(ReasonerConfig(generation_config="vllm"), tiny_copy) == NEUTRAL


@pytest.fixture(scope="module")
def served(reasoner, tmp_path_factory):
    """(openai client, reasoner) of a real uvicorn whose Reasoner's defaults each test sets."""
    from openai import OpenAI

    with serve_reasoner(
        reasoner, tmp_path_factory.mktemp("defaults"), model="m", name="defaults-uvicorn"
    ) as url:
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), reasoner
    reasoner.sampling_defaults = NEUTRAL


def _direct(reasoner, text, **kw):
    return run_to_end(reasoner, ChatParams(messages=(ChatMessage(role="user", content=text),), **kw))


def test_chats_take_the_defaults_for_what_they_omit(served):
    oai, reasoner = served
    reasoner.sampling_defaults = ChatDefaults(temperature=0.0, max_tokens=3)
    messages = [{"role": "user", "content": "Tell me a story"}]
    first = oai.chat.completions.create(model="m", messages=messages, extra_body={"ignore_eos": True})
    again = oai.chat.completions.create(model="m", messages=messages, extra_body={"ignore_eos": True})
    greedy, _ = _direct(reasoner, "Tell me a story", max_tokens=3, temperature=0.0, ignore_eos=True)
    assert first.choices[0].message.content == again.choices[0].message.content == greedy  # greedy, no seed
    assert first.usage.completion_tokens == 3 and first.choices[0].finish_reason == "length"
    own = oai.chat.completions.create(model="m", messages=messages, max_tokens=5, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    sampled, _ = _direct(reasoner, "Tell me a story", max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    assert own.usage.completion_tokens == 5 and own.choices[0].message.content == sampled  # the request's win
    reasoner.sampling_defaults = ChatDefaults(temperature=0.0, max_tokens=3, max_tokens_cap=3)
    capped = oai.chat.completions.create(model="m", messages=messages, max_completion_tokens=50,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"


def test_min_tokens_past_the_bound_is_a_400_naming_it(served):
    import openai

    oai, reasoner = served
    reasoner.sampling_defaults = ChatDefaults(max_tokens=3, max_tokens_cap=3)
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                    extra_body={"min_tokens": 4})  # fmt: skip
    body = error.value.body
    assert body["param"] == "min_tokens" and "--generation-config bound" in body["message"]


def test_completions_and_responses_take_them_too(served):
    oai, reasoner = served
    reasoner.sampling_defaults = ChatDefaults(temperature=0.0, top_p=0.5, max_tokens=40, max_tokens_cap=4)
    done = oai.completions.create(model="m", prompt="Once upon a time", extra_body={"ignore_eos": True})
    ids = tuple(reasoner.tokenizer("Once upon a time")["input_ids"])
    text, _ = run_to_end(reasoner, ChatParams(prompt_ids=ids, max_tokens=4, temperature=0.0, ignore_eos=True))
    assert done.usage.completion_tokens == 4 and done.choices[0].text == text  # 16 by default, bound to 4
    resp = oai.responses.create(model="m", input="Tell me a story")
    assert resp.temperature == 0.0 and resp.top_p == 0.5 and resp.usage.output_tokens <= 4
    own = oai.responses.create(model="m", input="Tell me a story", temperature=0.9, top_p=1.0)
    assert own.temperature == 0.9 and own.top_p == 1.0


def test_the_generation_config_eos_ids_end_chats(tiny_ckpt, tmp_path):
    """vLLM stops on the generation config's eos_token_id too (under auto and vllm alike: the model's file; or
    the folder's): a chat whose greedy first token is one of them ends there, with finish_reason stop."""
    from reasoner_helpers import tiny_reasoner

    model = _folder(tmp_path / "model", {"eos_token_id": [5, 7], "temperature": 0.2})
    assert (
        ChatDefaults.load("auto", model).eos_token_ids
        == (5, 7)
        == ChatDefaults.load("vllm", model).eos_token_ids
    )
    other = _folder(tmp_path / "other", {"eos_token_id": 9})
    assert ChatDefaults.load(str(other), model).eos_token_ids == (9,)
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a list of them"):
        ChatDefaults.load("auto", _folder(tmp_path / "bad", {"eos_token_id": "</s>"}))
    import torch
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    params = ChatParams(
        messages=(ChatMessage(role="user", content="Tell me a story"),), max_tokens=3, temperature=0
    )
    plain = tiny_reasoner(tiny_ckpt)
    session, ids = plain.start(params), []
    while session.finish_reason is None:
        ids += session.step().token_ids
    assert ids and ids[0] not in plain.stop_token_ids and session.finish_reason == "length"
    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    stopping = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=4096,
                                        sampling_defaults=ChatDefaults(eos_token_ids=(ids[0],)))  # fmt: skip
    text, ended = run_to_end(stopping, params)
    assert ended.finish_reason == "stop" and text == "" and ids[0] in stopping.stop_token_ids
