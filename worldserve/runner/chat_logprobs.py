"""Log-probabilities of the Reasoner's tokens: the `logprobs` of answer tokens and the `prompt_logprobs` of prompts.

`TokenTexts` decodes each token id's text once (the `token` of an entry and of its alternatives);
`batch_logprobs` computes the entries of several sessions' sampled tokens in one pass on the device
(Reasoner.step_all, ReasonerSession.advance); `prompt_logprobs` those of a prompt's tokens from its prefill's
hidden states (chat_admission.py). Device math over logits, apart from the session's text and stop handling
(runner/reasoner_session.py), which only hands the entries on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from worldserve.engine.outputs import TokenLogprob
from worldserve.sampling.tokens import host_to


class TokenTexts:
    """Each token id's text decoded alone (the `token` of a logprobs entry and its alternatives), decoded once
    per id: 32 chats with 5 alternatives each would otherwise take ~200 tokenizer calls a step."""

    def __init__(self, tokenizer: Any):
        self._decode = tokenizer.decode
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._decode([token])
        return text


def batch_logprobs(
    texts: TokenTexts, logits: Sequence[Tensor], tokens: Sequence[int], tops: Sequence[int]
) -> list[TokenLogprob]:
    """Each row's TokenLogprob: tokens[r]'s log-probability under logits[r] [V] with the tops[r] most likely
    tokens, all rows in one pass on the device and one read back (not a read per value). The alternatives are
    the batch's largest top-k cut to each row's count, as vLLM takes them: among tokens tied at a row's cut,
    which ones are listed may depend on the batch (their values do not)."""
    lp = torch.log_softmax(torch.stack([x.detach() for x in logits]).float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, host_to(list(tokens), torch.long, lp.device)[:, None])  # [R, 1]
    k = max(tops)
    vals, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [R, k]
    if lp.is_cuda:  # wait with the GIL released (.tolist() would hold it)
        torch.cuda.current_stream(lp.device).synchronize()
    rows = zip(tokens, tops, chosen[:, 0].tolist(), vals.tolist(), ids.tolist(), strict=True)
    return [
        TokenLogprob(token=texts(token), logprob=value, token_id=token, top_ids=tuple(row_ids[:top]),
                     top=tuple((texts(i), v) for v, i in zip(row_vals[:top], row_ids[:top], strict=True)))
        for token, top, value, row_vals, row_ids in rows
    ]  # fmt: skip


PROMPT_LOGPROB_ROWS = 256
"""Prompt positions whose logits are computed at once for prompt logprobs (~150 MB of float32 on Nano)."""


def prompt_logprobs(
    transformer: Any, texts: TokenTexts, ids: Sequence[int], hidden: Tensor, top: int
) -> tuple:
    """Each prompt token's TokenLogprob under the tokens before it, with `top` alternatives (the first
    token's logprob None): the prefill's final-normed hidden rows [N, d] through the LM head,
    PROMPT_LOGPROB_ROWS at a time (a row of logits is the vocabulary wide); only the chosen and top values
    leave the device."""
    out = [TokenLogprob(token=texts(ids[0]), logprob=None, token_id=ids[0])]
    for start in range(0, len(ids) - 1, PROMPT_LOGPROB_ROWS):
        end = min(start + PROMPT_LOGPROB_ROWS, len(ids) - 1)
        lp = torch.log_softmax(transformer.compute_logits(hidden[start:end]).float(), dim=-1)  # [r, V]
        targets = list(ids[start + 1 : end + 1])  # the token each row predicts
        chosen = lp.gather(1, host_to(targets, torch.long, lp.device)[:, None])  # [r, 1]
        ranks = ((lp > chosen).sum(-1) + 1).tolist()  # [r]: 1 = the most likely
        vals, alts = torch.topk(lp, top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())  # [r, top]
        rows = zip(targets, chosen[:, 0].tolist(), ranks, vals.tolist(), alts.tolist(), strict=True)
        for tok, value, rank, row_vals, row_alts in rows:
            alternatives = tuple((texts(a), v) for v, a in zip(row_vals, row_alts, strict=True))
            out.append(TokenLogprob(token=texts(tok), logprob=value, top=alternatives, token_id=tok,
                                    rank=rank, top_ids=tuple(row_alts)))  # fmt: skip
    return tuple(out)
