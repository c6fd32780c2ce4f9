"""POST /v1/responses with `reasoning` input items (api/responses_input.py), over real HTTP with the `openai`
client, on a tiny Reasoner whose template renders an assistant turn's earlier thoughts as Qwen3's does (a think
block before the turn's answer): the items become the chat's assistant turns as vLLM makes them
(vllm-project/vllm#42189), so the rendered prompt equals the chat completion's of the merged messages and holds
the thoughts where the template puts them: a reasoning item and the message / function calls after it are one
turn; a second reasoning item, or one after a turn that has thoughts, opens a new turn; the first content part,
else the first summary part, is the text; encrypted content is a 400; a partial last item is continued; a
previous answer's reasoning and message items sent back as input keep its thoughts.
"""

from __future__ import annotations

import httpx
import pytest
from reasoner_helpers import THINKING_TEMPLATE, tiny_reasoner
from serving_helpers import serve_reasoner

openai = pytest.importorskip("openai")  # a test dependency (the GPU machine's image has none)

MODEL = "test-model"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
QUESTION = {"role": "user", "content": "Why is the sky blue?"}
FOLLOW_UP = {"role": "user", "content": "And at sunset?"}


def _thought(text: str, **fields) -> dict:
    return {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            **fields}  # fmt: skip


def _answer(text: str, **fields) -> dict:
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}], **fields}  # fmt: skip


@pytest.fixture(scope="module")
def url(tiny_ckpt, tmp_path_factory):
    reasoner = tiny_reasoner(tiny_ckpt, chat_template=THINKING_TEMPLATE)
    with serve_reasoner(reasoner, tmp_path_factory.mktemp("responses-reasoning"), model=MODEL,
                        name="test-responses-reasoning", reasoning_parser="qwen3") as base:  # fmt: skip
        yield base


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def prompts(monkeypatch) -> list[str]:
    """The texts the chat template renders (the server runs in this process), in order."""
    from worldserve.runner.chat_prompt import ChatPromptBuilder

    texts: list[str] = []
    render = ChatPromptBuilder._render

    def recorded(self, *args, **kwargs):
        texts.append(render(self, *args, **kwargs))
        return texts[-1]

    monkeypatch.setattr(ChatPromptBuilder, "_render", recorded)
    return texts


def _same_as_chat(oai, prompts: list[str], items: list, messages: list, **kw) -> str:
    """Answer `items` (Responses) and `messages` (chat, greedy): the same prompt, tokens and answer; the prompt."""
    r = oai.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=4, **kw)
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in kw.get("tools", ())
    ]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4,
                                       **({"tools": tools} if tools else {}))  # fmt: skip
    assert prompts[-2] == prompts[-1], prompts[-2:]
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    message = chat.choices[0].message
    assert r.output_text == (message.content or "") and [
        o.type for o in r.output if o.type == "reasoning"
    ] == (["reasoning"] if message.reasoning else [])
    return prompts[-1]


def test_a_reasoning_item_is_the_thoughts_of_the_answer_after_it(oai, prompts):
    """[reasoning, message]: one assistant turn, its thoughts in the think block before its answer (it was
    dropped before: the prompt had no thoughts); the first content part is the text, not the summary."""
    items = [QUESTION, _thought("Rayleigh: short waves scatter.", summary=[{"type": "summary_text", "text": "S"}]),
             _answer("Blue light scatters most."), FOLLOW_UP]  # fmt: skip
    text = _same_as_chat(oai, prompts, items, [
        QUESTION, {"role": "assistant", "content": "Blue light scatters most.",
                   "reasoning": "Rayleigh: short waves scatter."}, FOLLOW_UP])  # fmt: skip
    assert (
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>\nRayleigh: short waves "
        "scatter.\n</think>\n\nBlue light scatters most.<|im_end|>\n<|im_start|>user\nAnd at sunset?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text, text
    assert (
        text.count("<|im_start|>assistant") == 2 and "S" not in text.split("<think>")[1].split("</think>")[0]
    )


def test_thoughts_before_function_calls_are_one_turn(oai, prompts):
    """[reasoning (summary only), function_call, function_call]: one turn with the first summary part as its
    thoughts and both calls, then the tool turns."""
    summary = [{"type": "summary_text", "text": "Ask the tool."}, {"type": "summary_text", "text": "Twice."}]
    calls = [
        {"type": "function_call", "call_id": f"c{i}", "name": "get_weather", "arguments": "{}"}
        for i in (1, 2)
    ]
    items = [QUESTION, {"type": "reasoning", "id": "rs_1", "summary": summary}, *calls,
             *({"type": "function_call_output", "call_id": f"c{i}", "output": "Sunny."} for i in (1, 2))]  # fmt: skip
    chat_calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                  for i in (1, 2)]  # fmt: skip
    text = _same_as_chat(oai, prompts, items, [
        QUESTION, {"role": "assistant", "content": None, "reasoning": "Ask the tool.", "tool_calls": chat_calls},
        *({"role": "tool", "tool_call_id": f"c{i}", "content": "Sunny."} for i in (1, 2))], tools=[WEATHER])  # fmt: skip
    turn = text.split("<|im_start|>assistant\n")[1]
    assert (
        turn.startswith("<think>\nAsk the tool.\n</think>\n\n\n<tool_call>")
        and turn.count("<tool_call>") == 2
    )
    assert "Twice." not in text


def test_a_turn_takes_one_reasoning_item_and_one_answer(oai, prompts):
    """vLLM's merging rules: a reasoning item joins the assistant turn just before it when that turn has no
    thoughts yet (here after its answer), an answer joins a turn that has no answer yet; otherwise each opens
    a new assistant turn."""
    items = [
        QUESTION,
        _answer("A."),
        _thought("T1."),
        _thought("T2."),
        _answer("B."),
        _answer("C."),
        FOLLOW_UP,
    ]
    text = _same_as_chat(oai, prompts, items, [
        QUESTION, {"role": "assistant", "content": "A.", "reasoning": "T1."},
        {"role": "assistant", "content": "B.", "reasoning": "T2."}, {"role": "assistant", "content": "C."},
        FOLLOW_UP])  # fmt: skip
    turns = [t.split("<|im_end|>")[0] for t in text.split("<|im_start|>assistant\n")[1:]]
    assert turns == ["<think>\nT1.\n</think>\n\nA.", "<think>\nT2.\n</think>\n\nB.", "C.", ""], turns


def test_a_reasoning_item_alone_is_a_turn_of_thoughts(oai, prompts):
    """After a user message (or alone) a reasoning item is an assistant turn with its thoughts and no answer
    (vLLM's); one with no text has empty thoughts."""
    text = _same_as_chat(oai, prompts, [QUESTION, _thought("Hmm."), FOLLOW_UP],
                         [QUESTION, {"role": "assistant", "content": None, "reasoning": "Hmm."}, FOLLOW_UP])  # fmt: skip
    assert (
        "<|im_start|>assistant\n<think>\nHmm.\n</think>\n\n<|im_end|>\n<|im_start|>user\nAnd at sunset?"
        in text
    )
    r = oai.responses.create(model=MODEL, input=[{"type": "reasoning", "id": "rs_1", "summary": []}],
                             max_output_tokens=2)  # fmt: skip
    assert r.status in ("completed", "incomplete")
    assert prompts[-1].startswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<|im_end|>\n")


def test_a_partial_last_item_is_continued(oai, prompts):
    """A last message or reasoning item whose status is in_progress / incomplete is continued (vLLM's
    should_continue_final_message): no generation prompt after it; a completed one gets one."""
    oai.responses.create(model=MODEL, input=[QUESTION, _thought("Light."), _answer("The sky is", status="incomplete")],
                         max_output_tokens=2)  # fmt: skip
    assert prompts[-1].endswith("<|im_start|>assistant\n<think>\nLight.\n</think>\n\nThe sky is"), prompts[-1]
    oai.responses.create(
        model=MODEL, input=[QUESTION, _thought("Light.", status="in_progress")], max_output_tokens=2
    )
    assert not prompts[-1].endswith("<|im_start|>assistant\n") and "<think>\nLight.\n</think>" in prompts[-1]
    oai.responses.create(
        model=MODEL, input=[QUESTION, _thought("Light.", status="completed")], max_output_tokens=2
    )
    assert prompts[-1].endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_encrypted_reasoning_is_refused(url):
    """vLLM's "Encrypted content is not supported." (this server never encrypts its thoughts), naming the item."""
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"}
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": [QUESTION, item]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].encrypted_content", r.text
    assert r.json()["error"]["message"] == "Encrypted content is not supported."


def test_a_previous_answers_items_sent_back_keep_its_thoughts(oai, prompts):
    """A client replaying a conversation sends an answer's output items (its reasoning item, from
    --reasoning-parser, and its message) back as input: the next prompt has that turn's thoughts and answer."""
    regex = "<think>\\nLook at it\\.\\n</think>\\n\\nA fox\\."
    first = oai.responses.create(
        model=MODEL, input=[QUESTION], extra_body={"structured_outputs": {"regex": regex}}
    )
    assert [o.type for o in first.output] == ["reasoning", "message"]
    output = [o.model_dump(exclude_none=True) for o in first.output]
    text = _same_as_chat(oai, prompts, [QUESTION, *output, FOLLOW_UP], [
        QUESTION, {"role": "assistant", "content": first.output_text, "reasoning": "\nLook at it.\n"},
        FOLLOW_UP])  # fmt: skip
    assert "<|im_start|>assistant\n<think>\n\nLook at it.\n\n</think>\n\n\n\nA fox.<|im_end|>\n" in text, text
    named = oai.responses.create(model=MODEL, input=[QUESTION, *({"type": "item_reference", "id": o.id} for o in
                                 first.output), FOLLOW_UP], temperature=0, max_output_tokens=4)  # fmt: skip
    assert prompts[-1] == text and named.usage.input_tokens > 0


def test_errors_name_the_item_a_merged_turn_took_its_field_from(url):
    """A turn made of several items: an error in its answer's content names the message item, one in its
    second call the function_call item."""
    bad_image = {"type": "input_image", "image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}
    answer = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "A."}, bad_image],
    }
    calls = [
        {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": a}
        for i, a in ((1, "{}"), (2, "[" * 200 + "]" * 200))
    ]
    for items, param in (([QUESTION, _thought("T."), answer, FOLLOW_UP], "input[2].content[1].image_url"),
                         ([QUESTION, _thought("T."), *calls], "input[3].arguments")):  # fmt: skip
        r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": items}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
