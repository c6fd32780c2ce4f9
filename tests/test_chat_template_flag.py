"""`--chat-template` (vLLM's flag): the value read as a file or as the template itself (vLLM's rules), refused
before the model loads when unreadable or no Jinja, checked on a plain message when the Reasoner starts, and
every chat rendered with it over real HTTP (the tiny Reasoner behind uvicorn; /tokenize shows the prompt)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from serving_helpers import serve_reasoner
from test_serve_compat_flags import config

from worldserve.runner.chat_template import load_chat_template

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[answer] {% endif %}"
)


def test_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert (
        load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    )  # escapes
    with pytest.raises(ValueError, match=r"^--chat-template: the supplied chat template \(/no/such/t.jinja\) "
                                         r"looks like a file path, but it failed to be opened"):  # fmt: skip
        load_chat_template("/no/such/t.jinja")
    path.write_text("  \n")
    with pytest.raises(ValueError, match="^--chat-template: the chat template is empty$"):
        load_chat_template(str(path))
    with pytest.raises(
        ValueError, match=r"^--chat-template: the chat template is not valid Jinja \(line 1\)"
    ):
        load_chat_template("{% for m in messages %}{{ m }}")  # no endfor


def test_the_flag_is_read_before_the_model_loads(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    chat = config("--chat-template", str(path)).reasoner
    assert chat.chat_template == str(path) and chat.chat_template_text == TEMPLATE
    again = dataclasses.replace(chat, max_model_len=4096)  # (a rebuilt config reads the template again)
    assert again.chat_template_text == TEMPLATE
    assert config().reasoner.chat_template_text is None
    with pytest.raises(ValueError, match="looks like a file path, but it failed to be opened"):
        config("--chat-template", str(tmp_path / "missing.jinja"))


def test_a_template_that_fails_on_a_plain_message_stops_the_start(reasoner, tiny_ckpt):
    from worldserve.runner.reasoner import Reasoner

    with pytest.raises(
        ValueError, match="^--chat-template: the chat template fails on a plain user message: "
    ):
        Reasoner.from_pretrained(tiny_ckpt, reasoner.transformer, reasoner.tokenizer,
                                 chat_template="{{ raise_exception('not this one') }}")  # fmt: skip


@pytest.fixture(scope="module")
def templated_url(reasoner, tiny_ckpt, tmp_path_factory):
    from worldserve.runner.reasoner import Reasoner

    templated = Reasoner.from_pretrained(
        tiny_ckpt, reasoner.transformer, reasoner.tokenizer, chat_template=TEMPLATE
    )
    with serve_reasoner(templated, tmp_path_factory.mktemp("tpl"), model="m", name="template-uvicorn") as url:
        yield url


def test_chats_are_rendered_with_the_template(templated_url, reasoner):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    expected = "[system] Be brief.\n[user] Hello there\n[answer] "
    ids = httpx.post(
        f"{templated_url}/tokenize", json={"model": "m", "messages": messages}, timeout=60
    ).json()
    assert ids["tokens"] == reasoner.tokenizer(expected, add_special_tokens=False)["input_ids"]
    default = reasoner.prompts.build(
        dataclasses.replace(reasoner_params(messages), max_tokens=None), add_special_tokens=False
    )
    assert ids["tokens"] != default.input_ids  # (the checkpoint's own template renders something else)
    answer = httpx.post(f"{templated_url}/v1/chat/completions", timeout=60,
                        json={"model": "m", "messages": messages, "max_tokens": 2}).json()  # fmt: skip
    assert answer["usage"]["prompt_tokens"] == len(ids["tokens"])


def reasoner_params(messages):
    from worldserve.chat_params import ChatMessage, ChatParams

    return ChatParams(messages=tuple(ChatMessage(role=m["role"], content=m["content"]) for m in messages))
