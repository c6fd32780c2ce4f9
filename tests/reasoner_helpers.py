"""Test helpers: the tiny Reasoner (with its own chat template, or THINKING_TEMPLATE, which renders an assistant
turn's earlier thoughts as Qwen3's does), and chats run to their end (greedy ones stepped together, as the chat
worker steps them, or one alone)."""

from __future__ import annotations

from worldserve.chat_params import ChatMessage, ChatParams
from worldserve.weights.tokenizer_fixture import CHAT_TEMPLATE

TURN_OPEN = "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
EARLIER_THOUGHTS = (
    "{%- if message['role'] == 'assistant' and message['reasoning_content'] is string -%}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}{%- endif -%}"
)
"""Qwen3's rendering of an assistant turn's earlier thoughts: a think block before its content."""
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(TURN_OPEN, TURN_OPEN + EARLIER_THOUGHTS) + (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)
"""The tiny template plus Qwen3's earlier thoughts (EARLIER_THOUGHTS) and its non-thinking branch (an empty
think block after the generation prompt)."""


def greedy_chats(reasoner, prompts, max_tokens: int, *, close: bool = False) -> list[list[int]]:
    """Start one greedy chat per prompt, step them together until all finish: each chat's token ids.
    `close`: close the sessions afterwards (frees their K/V and leaves the Reasoner's live count)."""
    sessions = [
        reasoner.start(ChatParams(messages=(ChatMessage(role="user", content=p),), max_tokens=max_tokens,
                                  temperature=0.0))
        for p in prompts
    ]  # fmt: skip
    live = list(sessions)
    while live:
        deltas = reasoner.step_all(live)
        live = [s for s, d in zip(live, deltas, strict=True) if d.finish_reason is None]
    if close:
        for s in sessions:
            s.close()
    return [s.token_ids for s in sessions]


def tiny_reasoner(ckpt, *, max_model_len: int = 4096, chat_template: str | None = None):
    """The Reasoner of the tiny checkpoint `ckpt`, float32 on the CPU (`chat_template`: instead of its own)."""
    import torch
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(ckpt / "text_tokenizer"))
    if chat_template is not None:
        tok.chat_template = chat_template
    return Reasoner.from_pretrained(ckpt, model, tok, max_model_len=max_model_len)


def run_to_end(reasoner, params):
    """(text, session) of one chat (or raw-prompt completion) started and stepped alone to its end."""
    session = reasoner.start(params)
    text = ""
    while session.finish_reason is None:
        text += session.step().text
    return text, session


def oracle_logits(reasoner, oracle, prompt, tokens):
    """transformers' Qwen3-VL logits [N + len(tokens), V] over the prompt (its media too) followed by
    `tokens`, in one forward with its own positions (get_rope_index)."""
    import torch

    seq = torch.tensor([prompt.input_ids + list(tokens)])
    kind = (seq == reasoner.image_token_id).int() + 2 * (seq == reasoner.video_token_id).int()
    kind[:, len(prompt.input_ids) :] = 0
    kw = {"mm_token_type_ids": kind}
    if prompt.vision is not None:
        kw.update(pixel_values=prompt.vision.pixel_values(), image_grid_thw=prompt.vision.grid_thw)
    if prompt.video is not None:
        kw.update(pixel_values_videos=prompt.video.pixel_values(), video_grid_thw=prompt.video.grid_thw)
    with torch.no_grad():
        return oracle(input_ids=seq, **kw).logits[0]
