"""bench/serve_chat.py --structured: the same chats over HTTP free and under a JSON schema (structured outputs),
and a named and an auto tool call, against a running `worldserve serve` (serve_chat.py starts it).

SCENE_SCHEMA's documents cannot close before 64 objects (bench/structured_decode.py's SCHEMA), so every
constrained chat runs to max_tokens as the free ones do.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from structured_decode import SCHEMA

SCENE_SCHEMA = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}}
"""The response_format of the constrained chats."""


def structured_chats(
    url: str, served: str, args: argparse.Namespace, chat: Callable, http: httpx.Client
) -> dict:
    """The same chats free and under SCENE_SCHEMA (response_format json_schema), at each --concurrency:
    tokens/s both ways. The grammar costs llguidance's host-side mask every step and its unpacking on the
    GPU, besides the same decode step."""
    out: dict = {}
    for c in (int(x) for x in args.concurrency.split(",")):
        for label, extra in (("free", None), ("json_schema", {"response_format": SCENE_SCHEMA})):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                outs = list(pool.map(lambda i, e=extra: chat(url, served, args.max_tokens, i, e), range(c)))
            wall = time.perf_counter() - t0
            tokens = sum(o["tokens"] for o in outs)
            out[f"{c}_{label}"] = {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                                   "per_chat_tok_s": min(o["tokens"] / o["s"] for o in outs)}  # fmt: skip
        out[f"{c}_ratio"] = out[f"{c}_json_schema"]["tok_s"] / out[f"{c}_free"]["tok_s"]
        print(f"{c} chats: json_schema / free tokens/s = {out[f'{c}_ratio']:.3f}", flush=True)
    out["tool_calls"] = tool_chats(url, served, http)
    return out


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}}}}}  # fmt: skip


def tool_chats(url: str, served: str, http: httpx.Client) -> dict:
    """A named tool choice (output constrained to the tool's schema) and an auto one whose <tool_call> block a
    regex forces (a random model writes none): their wall time and whether each came back as a valid call."""
    forced = (
        '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Oslo|Rome)"\\}\\}\\n</tool_call>'
    )
    out = {}
    for label, extra in (("named", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
                         ("auto", {"structured_outputs": {"regex": forced}})):  # fmt: skip
        body = {"model": served, "max_tokens": 256, "seed": 0, "tools": [WEATHER_TOOL],
                "messages": [{"role": "user", "content": "Weather in Oslo?"}], **extra}  # fmt: skip
        t0 = time.perf_counter()
        r = http.post(url + "/v1/chat/completions", json=body, timeout=600)
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        calls = (choice.get("message") or {}).get("tool_calls") or []
        try:
            ok = len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]).get("city") in (
                "Oslo",
                "Rome",
            )
        except ValueError:  # cut by max_tokens
            ok = False
        out[label] = {"status": r.status_code, "s": time.perf_counter() - t0, "valid_call": ok,
                      "finish_reason": choice.get("finish_reason")}  # fmt: skip
    print(f"tool calls: {out}", flush=True)
    return out
