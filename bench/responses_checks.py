"""bench/serve_chat.py --responses: the OpenAI Responses API against a running `worldserve serve` (serve_chat.py
starts it), over plain HTTP: a text answer (streamed and not: time to first delta, tokens/s), a named
function call, a json_schema answer, and an image request whose prompt the Reasoner writes (revised_prompt).
Each check records whether the answer has the expected shape.
"""

from __future__ import annotations

import json
import time

import httpx

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}  # fmt: skip


def _create(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/responses", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _text(resp: dict) -> str:
    return "".join(c["text"] for o in resp["output"] if o["type"] == "message" for c in o["content"])


def responses_checks(url: str, served: str, max_tokens: int) -> dict:
    """Plain HTTP (the GPU machine has no openai package; the tests run the official client)."""
    out: dict = {}
    t0 = time.perf_counter()
    r = _create(url, model=served, input="Describe a fox.", max_output_tokens=max_tokens)
    s = time.perf_counter() - t0
    tokens = r["usage"]["output_tokens"]
    out["text"] = {"status": r["status"], "output_tokens": tokens, "s": s, "tok_s": tokens / s,
                   "ok": r["output"][0]["type"] == "message"}  # fmt: skip
    t0, first, kinds = time.perf_counter(), None, []
    body = {"model": served, "input": "Describe a fox.", "max_output_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=600) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                kinds.append(json.loads(line[6:])["type"])
                if first is None and kinds[-1] == "response.output_text.delta":
                    first = time.perf_counter() - t0
    out["stream"] = {"events": len(kinds), "first_delta_s": first, "s": time.perf_counter() - t0,
                     "ok": kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")}  # fmt: skip
    named = _create(url, model=served, input="Weather in Oslo?", tools=[TOOL],
                    tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    call = named["output"][0]
    out["named_call"] = {"ok": call["type"] == "function_call" and "city" in json.loads(call["arguments"])}
    fmt = {"type": "json_schema", "name": "city", "schema": TOOL["parameters"]}
    shaped = _create(url, model=served, input="A city?", text={"format": fmt})
    out["json_schema"] = {"ok": set(json.loads(_text(shaped))) == {"city"}}
    t0 = time.perf_counter()
    image = httpx.post(url + "/v1/images/generations", timeout=600, json={
        "prompt": "a fox", "size": "256x256", "num_inference_steps": 2, "extra_params": {"upsample_prompt": True}})  # fmt: skip
    revised = image.json()["data"][0]["revised_prompt"] if image.status_code == 200 else None
    out["image_upsampled"] = {"status": image.status_code, "s": time.perf_counter() - t0,
                              "ok": revised is not None and "subjects" in json.loads(revised)}  # fmt: skip
    print("responses checks:", {k: v["ok"] for k, v in out.items() if "ok" in v}, flush=True)
    return out
