"""vLLM's token rules in the Reasoner's sampler (sampling/tokens.py): min_p, logit_bias, allowed_token_ids and
bad_words on random logits, one row at a time and batched beside rows without them; then the same options,
with skip_special_tokens, continue_final_message and use_beam_search, over real HTTP on the tiny Reasoner.
"""

from __future__ import annotations

import base64
import json
import logging

import httpx
import pytest
import torch
from serving_helpers import png_bytes

from worldserve.sampling.tokens import TokenSampler, sample_tokens

V = 64


def _logits(seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale


def test_min_p_keeps_only_tokens_near_the_most_likely():
    logits = _logits(scale=1.0)
    probs = logits.softmax(-1)
    kept = {i for i in range(V) if probs[i] >= 0.2 * probs.max()}
    drawn = {TokenSampler(temperature=1.0, min_p=0.2, seed=s).sample(logits) for s in range(300)}
    assert drawn <= kept and len(drawn) == len(kept) > 1
    # min_p on the temperature-scaled distribution: a higher temperature keeps more
    hot = {TokenSampler(temperature=2.0, min_p=0.2, seed=s).sample(logits) for s in range(300)}
    assert hot >= drawn and len(hot) > len(drawn)
    assert {TokenSampler(temperature=1.0, min_p=1.0, seed=s).sample(logits) for s in range(20)} == {
        int(logits.argmax())
    }


def test_logit_bias_and_allowed_token_ids():
    logits = _logits(1)
    low = int(logits.argmin())
    assert TokenSampler(temperature=0, logit_bias=((low, 100.0),)).sample(logits) == low
    top = int(logits.argmax())
    assert TokenSampler(temperature=0, logit_bias=((top, -100.0),)).sample(logits) != top
    allowed = (3, 17, 40)
    draws = {
        TokenSampler(temperature=1.5, allowed_token_ids=allowed, seed=s).sample(logits) for s in range(200)
    }
    assert draws == set(allowed)
    assert TokenSampler(temperature=0, allowed_token_ids=allowed).sample(logits) == max(
        allowed, key=lambda t: logits[t]
    )


def test_bad_words_ban_the_last_token_after_the_others():
    logits = torch.zeros(V)
    logits[5] = 10.0  # greedy would say 5, 5, 5, ...
    logits[6] = 9.0
    s = TokenSampler(temperature=0, bad_words=((7, 5), (6,)))  # "7 5" and "6" are banned
    assert s.sample(logits) == 5  # no 7 before it: 5 is fine
    forced = logits.clone()
    forced[7] = 20.0
    assert s.sample(forced) == 7  # now the output ends with 7 ...
    assert s.sample(logits) not in (5, 6)  # ... so 5 may not follow, and 6 never may
    assert s.sample(logits) == 5  # the output ends with something else again


def test_rules_batched_beside_plain_rows_equal_each_row_alone():
    kinds = [dict(temperature=0.9, min_p=0.1), dict(temperature=0), dict(temperature=1.0, logit_bias=((2, 5.0),)),
             dict(temperature=1.0, allowed_token_ids=(1, 2, 3, 60)), dict(temperature=0.7, top_k=5),
             dict(temperature=1.0, bad_words=((9,), (4, 4)))]  # fmt: skip
    logits = torch.stack([_logits(10 + i) for i in range(len(kinds))])
    alone = [TokenSampler(**kw, seed=3 + i) for i, kw in enumerate(kinds)]
    batched = [TokenSampler(**kw, seed=3 + i) for i, kw in enumerate(kinds)]
    for _ in range(8):
        together = sample_tokens(batched, logits)
        assert together == [s.sample(logits[i]) for i, s in enumerate(alone)]


MODEL = "test-model"
HI = [{"role": "user", "content": "Name a color."}]


def _post(url: str, route: str = "/v1/chat/completions", **body) -> httpx.Response:
    base = {
        "model": MODEL,
        "max_tokens": 8,
        **({"messages": HI} if route.endswith("chat/completions") else {}),
    }
    return httpx.post(url + route, json={**base, **body}, timeout=60)


def _token_ids(url: str, text: str) -> list[int]:
    return httpx.post(
        url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30
    ).json()["tokens"]


def test_options_over_http(reasoner_url):
    url = reasoner_url
    allowed = _token_ids(url, "red green blue")
    words = {
        httpx.post(url + "/detokenize", json={"tokens": [t]}, timeout=30).json()["prompt"] for t in allowed
    }
    for route in ("/v1/chat/completions", "/v1/completions"):
        chat = route.endswith("chat/completions")
        extra = {"logprobs": True} if chat else {"prompt": "A color:", "logprobs": 0}
        r = _post(url, route, allowed_token_ids=allowed, temperature=1.0, seed=1, ignore_eos=True, **extra)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        tokens = [e["token"] for e in lp["content"]] if chat else lp["tokens"]
        assert len(tokens) == 8 and set(tokens) <= words, tokens
    # logit_bias: +100 on one token makes a greedy chat repeat it
    token = _token_ids(url, " blue")[-1]
    r = _post(url, temperature=0, logit_bias={str(token): 100}, ignore_eos=True, max_tokens=4)
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["message"]["content"] == (
        httpx.post(url + "/detokenize", json={"tokens": [token] * 4}, timeout=30).json()["prompt"])  # fmt: skip
    # bad_words: that token's word never comes back, even pushed by a bias
    r = _post(url, temperature=0, logit_bias={str(token): 100}, bad_words=["blue"], max_tokens=6)
    assert "blue" not in r.json()["choices"][0]["message"]["content"]
    # min_p 1 keeps only the most likely token: a sampled chat equals the greedy one
    greedy = _post(url, temperature=0, max_tokens=6).json()["choices"][0]["message"]["content"]
    sampled = [_post(url, temperature=1.5, max_tokens=6, seed=s, min_p=1.0).json() for s in range(3)]
    assert {r["choices"][0]["message"]["content"] for r in sampled} == {greedy}


def test_special_tokens_and_continuing_a_message(reasoner_url):
    url = reasoner_url
    end = _token_ids(url, "<|im_end|>")
    assert len(end) == 1
    kw = {"temperature": 0, "logit_bias": {str(end[0]): 100}, "ignore_eos": True, "max_tokens": 2}
    assert _post(url, **kw).json()["choices"][0]["message"]["content"] == ""
    shown = _post(url, skip_special_tokens=False, **kw).json()["choices"][0]["message"]["content"]
    assert shown == "<|im_end|><|im_end|>"
    prefix = [*HI, {"role": "assistant", "content": "The color is"}]
    cont = _post(url, messages=prefix, continue_final_message=True, add_generation_prompt=False, max_tokens=1)
    fresh = _post(url, messages=prefix, max_tokens=1)
    assert cont.status_code == fresh.status_code == 200, cont.text
    assert (
        cont.json()["usage"]["prompt_tokens"] < fresh.json()["usage"]["prompt_tokens"]
    )  # left open: no new turn


def test_prompt_truncation_and_chat_echo(reasoner_url):
    url = reasoner_url
    long = "A red fox runs through a snowy forest at dawn. " * 20
    ids = _token_ids(url, long)
    whole = _post(url, "/v1/completions", prompt=long, max_tokens=1, temperature=0).json()
    cut = _post(
        url, "/v1/completions", prompt=long, max_tokens=1, temperature=0, truncate_prompt_tokens=10
    ).json()
    assert whole["usage"]["prompt_tokens"] == len(ids) and cut["usage"]["prompt_tokens"] == 10
    tail = _post(url, "/v1/completions", prompt=ids[-10:], max_tokens=1, temperature=0).json()
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]  # the last 10 tokens are what is kept
    # echo: the kept tokens' text, which the echoed logprobs' tokens and offsets describe (it had been the
    # whole prompt's text beside the kept tokens' logprobs)
    echoed = _post(url, "/v1/completions", prompt=long, max_tokens=1, temperature=0, truncate_prompt_tokens=10,
                   echo=True, logprobs=0).json()["choices"][0]  # fmt: skip
    kept = "".join(echoed["logprobs"]["tokens"][:10])
    assert echoed["text"].startswith(kept) and len(kept) < len(long) and long.endswith(kept)
    assert echoed["logprobs"]["text_offset"][9] == len(kept) - len(echoed["logprobs"]["tokens"][9])
    chat = _post(url, messages=[{"role": "user", "content": long}], max_tokens=1, truncate_prompt_tokens=12)
    assert chat.json()["usage"]["prompt_tokens"] == 12
    # -1: as many as leave room for max_tokens (vLLM's max_model_len - max_tokens; it was max_model_len,
    # which left none, so every prompt it had to cut was refused)
    context = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    over = _post(url, "/v1/completions", prompt=long * (context // len(ids) + 1), max_tokens=3,
                 truncate_prompt_tokens=-1)  # fmt: skip
    assert over.status_code == 200 and over.json()["usage"]["prompt_tokens"] == context - 3, over.text
    too_many = _post(url, "/v1/completions", prompt=long, max_tokens=3, truncate_prompt_tokens=context - 2)
    assert (
        too_many.status_code == 400 and f"max_tokens = {context - 3}" in too_many.json()["error"]["message"]
    )
    image = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    pic = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "?"}],
        }
    ]
    refused = _post(url, messages=pic, truncate_prompt_tokens=3)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens", (
        refused.text
    )
    prefix = [*HI, {"role": "assistant", "content": "The color is"}]
    kw = {
        "messages": prefix,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "temperature": 0,
    }
    plain = _post(url, **kw).json()["choices"][0]["message"]["content"]
    echoed = _post(url, echo=True, **kw).json()["choices"][0]["message"]["content"]
    assert echoed == "The color is" + plain
    with httpx.stream("POST", url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, "stream": True,
                                                                  "echo": True, **kw}, timeout=60) as r:  # fmt: skip
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == echoed
    # without add_generation_prompt the answer takes the last message's role, and echo repeats it whatever
    # it is (vLLM's rule: the last message is echoed when its role is the answer's); with it, a user turn is not
    user = {"messages": HI, "add_generation_prompt": False, "temperature": 0}
    answer = _post(url, echo=True, **user).json()["choices"][0]["message"]
    alone = _post(url, **user).json()["choices"][0]["message"]["content"]
    assert answer["role"] == "user" and answer["content"] == HI[-1]["content"] + alone
    assert _post(url, echo=True, messages=HI, temperature=0).json()["choices"][0]["message"]["content"] == (
        _post(url, messages=HI, temperature=0).json()["choices"][0]["message"]["content"])  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"min_p": 1.5}, "min_p", "less than or equal"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "out of vocabulary"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
        ({"allowed_token_ids": [1, 99999]}, "allowed_token_ids", "out of vocabulary"),
        ({"use_beam_search": True}, "use_beam_search", "not supported"),
        ({"priority": 3}, "priority", "Priority scheduling is not enabled"),
        ({"continue_final_message": True}, "continue_final_message", "Cannot set both"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
        ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", "cannot be greater than max_model_len"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "greater than or equal"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_bad_options_are_400s_naming_the_field(reasoner_url, route, body, param, needle):
    if route == "/v1/completions":
        if param == "continue_final_message":
            pytest.skip("a chat option")
        body = {**body, "prompt": "hi"}
    r = _post(reasoner_url, route, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and err["code"] == 400, err


def test_rules_that_leave_no_token_the_row_allowed_are_not_applied():
    """allowed_token_ids outside what the row still allows (a grammar's mask, the ends before min_tokens)
    would leave every score -inf and a meaningless draw: for that token the rules step aside."""
    logits = _logits(4)
    logits[:32] = float("-inf")  # e.g. a grammar allowing only ids 32..63
    for temperature in (0, 1.0):
        token = TokenSampler(temperature=temperature, allowed_token_ids=(3, 5), seed=0).sample(logits)
        assert token >= 32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rules_step_aside_only_in_the_rows_they_would_empty(device):
    """Batched: the row whose rules leave nothing keeps its scores (and the warning names it), the rows
    beside it keep their rules."""
    logits = _logits(4).repeat(3, 1)  # [3, V]
    logits[0, :32] = float("-inf")
    samplers = [TokenSampler(temperature=0, allowed_token_ids=(3, 5)),  # steps aside: 3 and 5 are -inf
                TokenSampler(temperature=0, allowed_token_ids=(40, 41), bad_words=((40,),)),  # only 41 is left
                TokenSampler(temperature=0)]  # fmt: skip
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # (no caplog: the GPU runs drop it)
    logger = logging.getLogger("worldserve.sampling.tokens")
    logger.addHandler(handler)
    try:
        tokens = sample_tokens(samplers, logits.to(device))
    finally:
        logger.removeHandler(handler)
    assert tokens == [int(logits[0].argmax()), 41, int(logits[2].argmax())]
    assert len(warnings) == 1 and "rows [0]" in warnings[0], warnings
    # every row restricted, a bias beside the rule that steps aside: that row's scores stay as they were
    biased = [TokenSampler(temperature=0, allowed_token_ids=(3, 5), logit_bias=((40, 100.0),)),
              TokenSampler(temperature=0, logit_bias=((7, 1000.0),))]  # fmt: skip
    assert sample_tokens(biased, logits[:2].to(device)) == [int(logits[0].argmax()), 7]


def test_chats_preempted_or_closed_let_go_of_their_batchs_counts():
    """A chat out of the batch keeps no reference to the batch's [P, V] counts slab (which would keep it
    alive); its counts come back from the host's when it samples again."""
    samplers = [TokenSampler(temperature=0, presence_penalty=1.0) for _ in range(3)]
    logits = _logits(5).repeat(3, 1)
    sample_tokens(samplers, logits)
    sample_tokens(samplers, logits)  # the slab of the three, in place
    slab = samplers[0]._counts[0]
    assert all(s._counts[0] is slab for s in samplers)
    samplers[2].drop_device_counts()
    assert samplers[2]._counts is None
    first = samplers[2].penalize(torch.zeros(V))  # rebuilt from output_counts: the two tokens it drew
    assert (first < 0).sum() == len(samplers[2].output_counts) > 0


def test_a_streamed_chat_tells_the_stop_string_it_hit(reasoner_url):
    """vLLM's stop_reason on the final streamed chunk, as the non-streamed answer has it."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 30, "stream": True, "guided_choice": ['ab"cd'],
            "stop": ['"']}  # fmt: skip
    with httpx.stream("POST", reasoner_url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = [e["choices"][0] for e in events if e["choices"]][-1]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == '"', last


def test_a_requests_own_chat_template_is_refused_as_vllm_refuses_it(reasoner_url):
    """vLLM refuses `chat_template` without --trust-request-chat-template (which worldserve refuses at startup):
    a 400 naming it on chat completions and /tokenize, never silently ignored."""
    r = _post(reasoner_url, chat_template="{{ raise_exception('boom') }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    r = httpx.post(reasoner_url + "/tokenize", json={"messages": HI, "chat_template": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
