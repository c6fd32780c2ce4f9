"""bench/serve_chat.py --responses: the OpenAI Responses API against a running `worldserve serve` (serve_chat.py
starts it), with the official client: a text answer (streamed and not: time to first delta, tokens/s), a named
function call, a json_schema answer, and an image request whose prompt the Reasoner writes (revised_prompt).
Each check records whether the answer has the expected shape.
"""

from __future__ import annotations

import json
import time

import httpx

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}  # fmt: skip


def responses_checks(url: str, served: str, max_tokens: int) -> dict:
    from openai import OpenAI

    oai = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    out: dict = {}
    t0 = time.perf_counter()
    r = oai.responses.create(model=served, input="Describe a fox.", max_output_tokens=max_tokens)
    s = time.perf_counter() - t0
    out["text"] = {"status": r.status, "output_tokens": r.usage.output_tokens, "s": s,
                   "tok_s": r.usage.output_tokens / s, "ok": r.output[0].type == "message"}  # fmt: skip
    t0, first, kinds = time.perf_counter(), None, []
    for event in oai.responses.create(
        model=served, input="Describe a fox.", max_output_tokens=max_tokens, stream=True
    ):
        kinds.append(event.type)
        if first is None and event.type == "response.output_text.delta":
            first = time.perf_counter() - t0
    out["stream"] = {"events": len(kinds), "first_delta_s": first, "s": time.perf_counter() - t0,
                     "ok": kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")}  # fmt: skip
    named = oai.responses.create(model=served, input="Weather in Oslo?", tools=[TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    out["named_call"] = {
        "ok": named.output[0].type == "function_call" and "city" in json.loads(named.output[0].arguments)
    }
    fmt = {"type": "json_schema", "name": "city", "schema": TOOL["parameters"]}
    shaped = oai.responses.create(model=served, input="A city?", text={"format": fmt})
    out["json_schema"] = {"ok": set(json.loads(shaped.output_text)) == {"city"}}
    t0 = time.perf_counter()
    image = httpx.post(url + "/v1/images/generations", timeout=600, json={
        "prompt": "a fox", "size": "256x256", "num_inference_steps": 2, "extra_params": {"upsample_prompt": True}})  # fmt: skip
    revised = image.json()["data"][0]["revised_prompt"] if image.status_code == 200 else None
    out["image_upsampled"] = {"status": image.status_code, "s": time.perf_counter() - t0,
                              "ok": revised is not None and "subjects" in json.loads(revised)}  # fmt: skip
    print("responses checks:", {k: v["ok"] for k, v in out.items() if "ok" in v}, flush=True)
    return out
