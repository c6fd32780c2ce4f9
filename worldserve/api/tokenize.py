"""POST /tokenize and POST /detokenize: vLLM's tokenizer routes, on the Reasoner's tokenizer (serving-api.md §11.3).

/tokenize takes vLLM's two forms. The prompt form `{"prompt", "add_special_tokens": true, "return_token_strs"}`
tokenizes the text as /v1/completions does. The chat form `{"messages", "add_generation_prompt": true,
"continue_final_message": false, "add_special_tokens": false, "chat_template_kwargs", "mm_processor_kwargs",
...}` goes through the chat's own `build_params` (media loaded and checked as a chat completion loads them,
within the same video decode budget; a client leaving stops its videos' decoding, as a chat's) and the
Reasoner's ChatPromptBuilder, so its `count` is the `prompt_tokens` a chat completion of the same messages
reports, image and video placeholders expanded. Answer: `{"count", "max_model_len", "tokens",
"token_strs"}`. Neither form checks the context: a text past max_model_len is counted, as vLLM's /tokenize
counts it, unless its byte size alone shows no tokenization could fit it in max_model_len tokens (prompt.py
TextSizeBound, ~30x the context in real tokens): that is a 400 before tokenizing (a 40 MB prompt took minutes
and gigabytes of memory, and went on after its client left). /detokenize `{"tokens": [...]}` answers `{"prompt": text}` (special tokens kept); an id
outside the vocabulary is a 400 naming `tokens`. A `model` other than the served name is a 404 as in chat; a
server without the Reasoner answers these routes as chat answers then (400). Tokenizer and media work runs in
a worker thread, off the event loop. `reasoner_prompts` is the Reasoner access /v1/completions shares.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from worldserve.api.bodies import fits_context, openapi_body, read_json_object, read_model
from worldserve.api.chat import RequestOptions, build_params, model_not_found, request_options
from worldserve.api.chat_media import media_parts, prefetch_media
from worldserve.api.chat_protocol import UNTRUSTED_TEMPLATE, ChatCompletionRequest
from worldserve.api.completions_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeResponse,
)  # fmt: skip
from worldserve.api.disconnect import unless_disconnected
from worldserve.api.errors import APIError
from worldserve.api.state import AppState, State
from worldserve.engine.client import NO_REASONER
from worldserve.media.decode_budget import DecodeBudget
from worldserve.media.work_pool import on_request_pool
from worldserve.params import ParamError

if TYPE_CHECKING:
    from worldserve.runner.chat_prompt import ChatPromptBuilder

router = APIRouter(tags=["tokenize"])


def reasoner_prompts(st: AppState) -> tuple[ChatPromptBuilder, int]:
    """(the Reasoner's ChatPromptBuilder, its max_model_len); a 400, as chat answers, when there is none."""
    worker = st.client.chat_worker
    prompts = worker.backend.prompts if worker is not None else None
    if worker is None or prompts is None:  # (no worker: no prompts)
        raise APIError(400, NO_REASONER)
    max_model_len = worker.backend.max_model_len
    assert max_model_len is not None  # (a backend with a prompt builder is the Reasoner: a bounded context)
    return prompts, max_model_len


def _tokenize_chat(
    st: AppState, prompts: ChatPromptBuilder, body: TokenizeChatRequest, chat: ChatCompletionRequest, fetched: dict[str, bytes],
    options: RequestOptions, max_tokens: int, stop: threading.Event | None = None,
) -> list[int]:  # fmt: skip
    """The chat form's ids: the chat's params (`chat`, its media loaded, blocking; http(s) ones already
    `fetched`; its `options` checked; its videos within --max-video-decode-gpixels, their decoding ended
    by `stop`) through the Reasoner's builder (texts too big for `max_tokens` refused before tokenizing)."""
    params = build_params(
        chat, st.settings.allowed_local_media_path, fetched, options, prompts.media_cache,
        video_budget=DecodeBudget(st.settings.video_decode_pixels, stop),
    )  # fmt: skip
    prompt = prompts.build(params, add_special_tokens=body.add_special_tokens, max_tokens=max_tokens)
    return prompt.input_ids


@router.post(
    "/tokenize", response_model=TokenizeResponse,
    openapi_extra=openapi_body(TokenizePromptRequest, TokenizeChatRequest),
)  # fmt: skip
async def tokenize(request: Request, st: State) -> TokenizeResponse | JSONResponse:
    """vLLM's /tokenize: a prompt's (or a chat's rendered prompt's) token ids."""
    data = await read_json_object(request, st.settings.max_upload_bytes)
    chat = "messages" in data and "prompt" not in data
    fits_context("messages", st.max_model_len)(data)  # (before pydantic builds an object of each)
    body = (TokenizeChatRequest if chat else TokenizePromptRequest).model_validate(data)
    if body.model is not None and not st.serves(body.model):  # (None: not given, the served model)
        return model_not_found(body.model)
    prompts, max_model_len = reasoner_prompts(st)

    def encode() -> tuple[list[int], list[str] | None]:  # in a worker thread: long prompts take seconds
        if isinstance(body, TokenizeChatRequest):  # (chat)
            ids = _tokenize_chat(st, prompts, body, as_chat, fetched, options, max_model_len, stop)
        else:
            ids = prompts.encode(
                body.prompt, add_special_tokens=body.add_special_tokens, max_tokens=max_model_len
            )
        return ids, prompts.token_strs(ids) if body.return_token_strs else None

    fetched: dict[str, bytes] = {}
    stop = threading.Event()  # set when the client leaves: the media decoding stops
    if isinstance(body, TokenizeChatRequest):  # (chat)
        if body.chat_template is not None:
            raise ParamError("chat_template", UNTRUSTED_TEMPLATE)
        as_chat = body.as_chat()
        options = request_options(
            as_chat, media=st.settings.media_defaults, template_defaults=st.settings.template_defaults
        )
        fetched = await prefetch_media(as_chat, st.media, st.settings.mm_limits)
    # a chat form with media on the chat route's request pool (the default executor parses every route's large
    # bodies: a burst of video decodes here held them up)
    if chat and next(media_parts(as_chat), None) is not None:  # (watched: a video's decode takes seconds)
        ids, strs = await unless_disconnected(request, on_request_pool(encode, stop=stop))
    else:
        ids, strs = await asyncio.to_thread(encode)
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse, openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(request: Request, st: State) -> DetokenizeResponse | JSONResponse:
    """vLLM's /detokenize: the text of token ids."""
    body = await read_model(request, DetokenizeRequest, st.settings.max_upload_bytes)
    if body.model is not None and not st.serves(body.model):  # (None: not given, the served model)
        return model_not_found(body.model)
    prompts, _ = reasoner_prompts(st)
    return DetokenizeResponse(prompt=await asyncio.to_thread(prompts.decode, body.tokens, param="tokens"))
