"""OpenAI's `GET /v1/responses/{id}/input_items` (the SDK's `responses.input_items.list`; vLLM serves none): a
stored response's input items, one page at a time.

`input_items` turns a request's `input` into the items OpenAI lists: a plain string is one user message, a
message's text content is an `input_text` part (`output_text` for an assistant's), every item has an id
(`msg_` / `fc_` / `fco_` / `rs_` and a hex, where the client sent none) and a message or call its status;
an item_reference is listed as the item it named (the request's input is resolved before this runs). The
store keeps them beside the response (api/responses_store.py), within its byte budget.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from worldserve.api.errors import APIError
from worldserve.api.responses_input import InputItem
from worldserve.api.state import State

router = APIRouter(tags=["responses"])

ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
"""The id prefix of an input item the client sent without one, by its type."""


def input_items(given: str | list[InputItem]) -> list[dict[str, Any]]:
    """The request's input as OpenAI lists it (module docstring)."""
    items = [InputItem(role="user", content=given)] if isinstance(given, str) else given
    listed = []
    for item in items:
        entry = item.model_dump(exclude_none=True)
        kind = entry["type"] = entry.get("type") or "message"
        if kind == "message" and isinstance(entry.get("content"), str):
            part = "output_text" if entry.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": entry["content"]}]
        entry.setdefault("id", f"{ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}")
        if kind in ("message", "function_call", "function_call_output"):
            entry.setdefault("status", "completed")
        listed.append(entry)
    return listed


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str, st: State, after: str | None = None, limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc", include: list[str] | None = Query(None),
) -> JSONResponse:  # fmt: skip
    """One page of the response's input items, newest first by default (OpenAI's `order` desc): up to `limit`
    after the item `after` (an id); `include` asks for fields this server's items carry already or never have
    (accepted, as OpenAI's optional extras)."""
    found = st.responses.input_items(response_id) if st.responses is not None else None
    if found is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    items = found if order == "asc" else found[::-1]
    ids = [item["id"] for item in items]
    if after is not None and after not in ids:
        raise APIError(404, f"Item with id '{after}' not found in response '{response_id}'.", param="after")
    window = items[ids.index(after) + 1 :] if after is not None else items
    page = window[:limit]
    return JSONResponse({
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(window) > len(page),
    })  # fmt: skip
