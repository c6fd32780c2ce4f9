"""POST /v1/completions: OpenAI's legacy text completions on the Reasoner, as vLLM serves them (serving-api.md §11.3).

Request -> checks (served model name else 404; 1 <= n <= 16; `suffix` and a `best_of` other than n are
400s naming the field; structured outputs as the chat's: api/structured_fields.py) -> each prompt as token ids: a text is
tokenized raw, no chat template (`add_special_tokens`, default true, as vLLM), ids are taken as they are ->
`ChatParams(prompt_ids=...)` (choice j of a prompt samples with seed + j) -> `EngineClient.chat_many` starts
every choice of every prompt together, the chat's own path: the ChatWorker's continuous batching, the chat
metrics (engine/chat_metering.py `metered`), a client gone stops them (api/disconnect.py), 503 while shutting
down. The Reasoner checks the ids (outside the vocabulary, or vision placeholders: a 400 naming `prompt`);
the context is checked here as vLLM's renderer checks it, in its words (api/context_fit.py): a max_tokens past
the whole context before the prompts are read (a 400 naming `max_tokens`), then each prompt with max_tokens (a
400 naming `input_tokens`). api/completions_stream.py builds the answer: the `text_completion` object once every
choice has ended, or SSE chunks once the first choice has started (the others stream as the worker admits
them, as vLLM's do).
`echo` with `max_tokens: 0` answers each prompt's text alone, as vLLM does: one token is generated (so every
check of a generating request applies, and usage counts it, as vLLM's does) and left out of the text.
`echo` with `logprobs` (lm-eval's loglikelihood requests) also scores the prompt: each prompt token's
log-probability under the tokens before it (the first one's null), from the prefill's own logits, before the
generated tokens' entries; vLLM's `prompt_logprobs: k` gives the same as `choices[i].prompt_logprobs`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from worldserve.api.answer_fields import TokenView
from worldserve.api.bodies import openapi_body, read_model
from worldserve.api.chat import model_not_found
from worldserve.api.chat_stream import ChatStream, close_all, start_all
from worldserve.api.completions_protocol import CompletionRequest, CompletionResponse
from worldserve.api.completions_stream import Completion, collect, sse
from worldserve.api.context_fit import check_output_budget, check_prompt_fits
from worldserve.api.disconnect import unless_disconnected
from worldserve.api.errors import APIError
from worldserve.api.request_log import sampling
from worldserve.api.state import AppState, State
from worldserve.api.structured_fields import grammar_compiler, structured_output
from worldserve.api.tokenize import reasoner_prompts
from worldserve.chat_params import ChatParams, StructuredOutput
from worldserve.param_errors import InvalidRequest, ParamError
from worldserve.sampling.chat_defaults import NEUTRAL, ChatDefaults

if TYPE_CHECKING:
    from worldserve.runner.chat_prompt import ChatPromptBuilder

router = APIRouter(tags=["completions"])


def tokenize_prompts(
    prompts: ChatPromptBuilder, body: CompletionRequest, max_model_len: int | None = None
) -> list[tuple[tuple[int, ...], str | None]]:
    """Each prompt as (token ids, its text when `echo`) (blocking: tokenizes; a text longer than
    `max_model_len` tokens can hold is refused before); ParamError("prompt")."""
    given: Sequence[Any] = body.prompt
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        given = [given]  # one prompt: a text or one list of ids
    if not given:
        raise ParamError("prompt", "prompt must not be empty")
    out = []
    text: str | None
    for prompt in given:
        if isinstance(prompt, str):
            ids = prompts.encode(prompt, add_special_tokens=body.add_special_tokens, max_tokens=max_model_len)
            text = prompt
        else:
            ids = list(prompt)
            prompts.check_ids(ids, "prompt")
            text = prompts.decode(ids, param="prompt") if body.echo else None
        if not ids:
            raise ParamError("prompt", "the prompt must contain at least one token")
        out.append((tuple(ids), text if body.echo else None))
    return out


def chat_params(
    body: CompletionRequest,
    ids: tuple[int, ...],
    structured: StructuredOutput | None = None,
    bad_word_ids: tuple[tuple[int, ...], ...] | None = None,
    defaults: ChatDefaults = NEUTRAL,
) -> ChatParams:
    """One prompt's ChatParams: its ids, the request's sampling options (`defaults`' where it omits them) and
    structured output constraint (and its bad_words' tokens, when tokenized)."""
    scored = (body.logprobs if body.echo else None, body.prompt_logprobs_wanted(body.prompt_logprobs))
    wanted = [k for k in scored if k is not None]
    return ChatParams(  # the prompt's logprobs for echo + logprobs (as vLLM answers it) and prompt_logprobs
        prompt_ids=ids, max_tokens=body.max_tokens, max_tokens_bound=defaults.budget(body.max_tokens),
        **body.sampling_options(defaults),
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
        prompt_logprobs=max(wanted) if wanted else None, structured=structured, bad_word_ids=bad_word_ids,
    ).validate()  # fmt: skip


@router.post(
    "/v1/completions", response_model=CompletionResponse, openapi_extra=openapi_body(CompletionRequest)
)
async def create_completion(
    request: Request, st: State
) -> CompletionResponse | StreamingResponse | JSONResponse:
    """OpenAI text completion from the Reasoner (JSON body; `stream: true` answers server-sent events)."""
    body = await read_model(request, CompletionRequest, st.settings.max_upload_bytes)
    if body.model is not None and not st.serves(body.model):  # (None: not given, the served model)
        return model_not_found(body.model)
    if (refused := body.refused_streaming(body.prompt_logprobs)) is not None:
        raise InvalidRequest(*refused)  # (vLLM's request validators: "Bad Request")
    if (refused := body.refused()) is not None:
        raise APIError(400, refused[1], param=refused[0])
    prompts, max_model_len = reasoner_prompts(st)
    # vLLM's renderer refuses a budget past the whole context before it reads any prompt
    check_output_budget(body.max_tokens, "max_tokens", max_model_len)
    compiler = grammar_compiler(st.client.chat_worker)
    structured = await asyncio.to_thread(structured_output, body, None, compiler)  # a grammar compiles
    tokenized = await asyncio.to_thread(tokenize_prompts, prompts, body, body.text_bound(max_model_len))
    bad_word_ids = (
        await asyncio.to_thread(prompts.bad_word_ids, tuple(body.bad_words)) if body.bad_words else ()
    )
    echo_only = body.max_tokens == 0  # with echo (refused() made sure): the prompt alone, as vLLM answers it
    if echo_only:  # vLLM's way: one token generated (every check of a generating request applies) and dropped
        body = body.model_copy(update={"max_tokens": 1})
    # with truncate_prompt_tokens the Reasoner cuts each prompt first, then checks the cut (as vLLM)
    if body.truncate_prompt_tokens is None:
        for ids, _ in tokenized:
            check_prompt_fits(len(ids), body.max_tokens, max_model_len)
    choices = [
        choice
        for ids, _ in tokenized
        for choice in st.seeded(
            chat_params(body, ids, structured, bad_word_ids, st.chat_defaults)
        ).request_choices(body.n)
    ]
    echoes = await asyncio.to_thread(
        lambda: [_echoed(prompts, body, i, t, max_model_len) for i, t in tokenized]
    )
    sizes = [_kept_tokens(prompts, body, ids, max_model_len) for ids, _ in tokenized]
    opened: list[
        ChatStream
    ] = []  # the request's chat streams, to cancel if the client goes away at any point
    answer_id = body.answer_id("cmpl", request.headers.get("x-request-id"))
    work = _answer(st, body, choices, echoes, opened, echo_only, answer_id, sizes)
    return await unless_disconnected(request, work, lambda: close_all(opened))


def _kept_tokens(
    prompts: ChatPromptBuilder, body: CompletionRequest, ids: tuple[int, ...], max_model_len: int
) -> int:
    """How many of a prompt's tokens the Reasoner keeps: all, or with truncate_prompt_tokens the last ones
    it keeps (as it cuts them: -1 keeps max_model_len - max_tokens)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return len(ids)
    keep = prompts.truncation_size(keep, max_model_len, body.max_tokens)
    return keep if 0 < keep < len(ids) else len(ids)


def _echoed(
    prompts: ChatPromptBuilder,
    body: CompletionRequest,
    ids: tuple[int, ...],
    text: str | None,
    max_model_len: int,
) -> str | None:
    """A prompt's echo: its text, or with truncate_prompt_tokens the text of the tokens the Reasoner keeps
    (_kept_tokens), so the echo and its logprobs' offsets match."""
    kept = _kept_tokens(prompts, body, ids, max_model_len)
    if text is None or kept == len(ids):
        return text
    return prompts.decode(list(ids[-kept:]), param="prompt")


async def _answer(
    st: AppState, body: CompletionRequest, choices: list[ChatParams], echoes: list[str | None],
    opened: list[ChatStream], echo_only: bool, request_id: str, prompt_sizes: list[int],
) -> StreamingResponse | CompletionResponse:  # fmt: skip
    """Start every choice together, wait for the first event of each (the whole object) or of the first one
    alone (SSE: the worker admits the choices as decode slots free up, and one still queued must not hold
    back the others' chunks; each prompt's counts come with its choices' ChatStarted), then answer (its id
    `request_id`). A refusal or a bad prompt of a choice waited for answers the request (its envelope); a
    later choice's, in a stream, is its error event. `prompt_sizes`: each prompt's tokens as tokenized here."""
    streams, firsts = await start_all(
        st.client, choices, st.chat_meter(request_id), coalesce=not body.stream, opened=opened,
        first_only=body.stream,
    )  # fmt: skip
    c = Completion(
        request_id, int(time.time()), st.served_model_name, echoes=echoes, n=body.n, logprobs=body.logprobs,
        echo_only=echo_only, prompt_logprobs=body.prompt_logprobs, prompt_sizes=prompt_sizes,
        details=st.settings.prompt_tokens_details, view=TokenView.of(body, st.settings.tokens_as_ids),
    )  # fmt: skip
    for index, first in enumerate(firsts):
        c.started(index, first)
    if st.settings.request_log is not None:
        prompt = body.prompt if isinstance(body.prompt, str) else json.dumps(body.prompt)
        st.settings.request_log.received(c.request_id, prompt, {**sampling(choices[0]), "n": body.n},
                                prompt_tokens=sum(c.prompt_tokens))  # fmt: skip
    if body.stream:
        return StreamingResponse(
            sse(streams, c, *body.stream_usage(st.settings.force_include_usage)),
            media_type="text/event-stream",
        )
    return await collect(streams, c)
