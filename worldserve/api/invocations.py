"""POST /invocations, vLLM's SageMaker entry point: one route that answers a JSON body as the OpenAI route
its shape names. A body with `messages` is a chat completion (/v1/chat/completions), one with `prompt` a text
completion (/v1/completions), streamed or not as those routes answer; anything else is a 400 naming the
request types it could have been. vLLM leaves it open with --api-key (SageMaker's endpoint authenticates
its callers itself); here it needs the key as /v1 does (api/auth.py): it reaches the same Reasoner, which a
keyed server must not open by a second door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from worldserve.api.bodies import read_json_object_again
from worldserve.api.chat import create_chat_completion
from worldserve.api.completions import create_completion
from worldserve.api.errors import APIError
from worldserve.api.state import State

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse, StreamingResponse

    from worldserve.api.chat_protocol import ChatCompletionResponse
    from worldserve.api.completions_protocol import CompletionResponse

router = APIRouter(tags=["server"])

HANDLERS = (("messages", "ChatCompletionRequest", create_chat_completion),
            ("prompt", "CompletionRequest", create_completion))  # fmt: skip
"""(the key that names a body's type, that type's name in vLLM's refusal, its route), first match wins (a body
with both is a chat, as vLLM tries ChatCompletionRequest first)."""


@router.post("/invocations", response_model=None)  # (the answer is the chosen route's)
async def invocations(
    request: Request, st: State
) -> ChatCompletionResponse | CompletionResponse | StreamingResponse | JSONResponse:
    """The chat or text completion the JSON body is (SageMaker's invocation route)."""
    data = await read_json_object_again(request, st.settings.max_upload_bytes)
    for key, _, route in HANDLERS:
        if key in data:
            return await route(request, st)
    names = [name for _, name, _ in HANDLERS]
    raise APIError(400, f"Cannot find suitable handler for request. Expected one of: {names}")
