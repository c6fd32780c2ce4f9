"""Stored responses of the Responses API (`store`, OpenAI's default): kept in this process's memory, most
recently used first, within a byte budget, so that `previous_response_id` can continue a conversation and
`GET` / `DELETE /v1/responses/{id}` (and its `/input_items`) find a response. vLLM keeps them in memory too (behind a flag, unbounded);
here the oldest are dropped past `--responses-store-mb` (default 256 MiB). A restart forgets them.

Each entry holds the conversation as the chat messages the response answered (its instructions left out, as
OpenAI does not carry them over) plus its output as assistant turns, and the response object itself. Its
output and input items are found by their ids too (`item`): clients that replay a conversation each turn may
name an earlier item (a function_call, a message; an input item by the id `input_items` listed, or its own)
by an `item_reference` instead of sending it again.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from worldserve.api.responses_input import chat_tool_call

ENTRY_OVERHEAD_BYTES = 512
"""An entry's memory besides its JSON: its id twice, the ordered dict's node, the tuple, its items' index."""


class ResponseStore:
    """Entries are kept as their JSON bytes (the conversation, the response), read back into fresh objects on
    each `get`: the budget is then the memory they take. Kept as dict trees, a response's Python objects had
    taken 4-7 times its JSON's length, so the default 256 MiB budget held ~1-2 GB (an audit's soak: 30-58 KB
    of RSS per ~8 KB response). No caller can change a stored entry through what it was given either."""

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        self.max_bytes = max_bytes
        # id -> (the conversation's JSON, the response's JSON, its output and input items' ids, its input items'
        # JSON)
        self._entries: OrderedDict[str, tuple[bytes, bytes, list[str], bytes]] = OrderedDict()
        # output or input item id -> the stored responses that hold it, oldest first (a client that sends an
        # earlier response's output back as input lists the same id again: deleting the later one leaves the
        # earlier one's item found)
        self._items: dict[str, list[str]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def put(
        self,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        inputs: list[dict[str, Any]] | None = None,
    ) -> None:
        """Keep `response` and the conversation it ends (`messages`: its input as chat messages, without its
        instructions), its output appended, and its input items as listed (`inputs`:
        api/responses_items.py); the least recently used entries go past the budget."""
        history = json.dumps([*messages, *output_messages(response["output"])]).encode()
        body = json.dumps(response).encode()
        listed = json.dumps(inputs or []).encode()
        items = [o["id"] for o in [*response["output"], *(inputs or ())] if "id" in o]
        with self._lock:
            self._drop(response["id"], self._entries.pop(response["id"], None))
            self._entries[response["id"]] = (history, body, items, listed)
            for item in items:
                self._items.setdefault(item, []).append(response["id"])
            self._bytes += _size(history, body, listed)
            while self._bytes > self.max_bytes and self._entries:
                self._drop(*self._entries.popitem(last=False))

    def get(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """(the conversation as chat messages, the response object), or None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
        return json.loads(entry[0]), json.loads(entry[1])

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        """A stored response's input items, oldest first, or None."""
        with self._lock:
            entry = self._entries.get(response_id)
        return None if entry is None else json.loads(entry[3])

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored response's output item by its id, else one of its input items (as listed), or None."""
        with self._lock:
            holders = self._items.get(item_id, [])
            entry = self._entries.get(holders[-1]) if holders else None  # (the latest that holds it)
        if entry is None:
            return None
        items = [*json.loads(entry[1])["output"], *json.loads(entry[3])]
        return next((o for o in items if o.get("id") == item_id), None)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            self._drop(response_id, entry)
            return entry is not None

    def _drop(self, response_id: str, entry: tuple[bytes, bytes, list[str], bytes] | None) -> None:
        """Forget a removed entry's bytes and items (under the lock)."""
        if entry is not None:
            self._bytes -= _size(entry[0], entry[1], entry[3])
            for item in entry[2]:
                holders = self._items.get(item, [])
                if response_id in holders:
                    holders.remove(response_id)
                if not holders:
                    self._items.pop(item, None)


def _size(history: bytes, body: bytes, inputs: bytes) -> int:
    return len(history) + len(body) + len(inputs) + ENTRY_OVERHEAD_BYTES


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat's assistant turns: its message text, its function calls as
    tool_calls (its reasoning items dropped, as vLLM skips a previous response's reasoning output; reasoning
    items sent in the input are kept, api/responses_input.py)."""
    text = "".join(c["text"] for o in output if o["type"] == "message" for c in o["content"])
    calls = [
        chat_tool_call(o["call_id"], o["name"], o["arguments"])
        for o in output
        if o["type"] == "function_call"
    ]
    if not text and not calls:
        return []
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
