"""The Reasoner's prefill: chat prompts (with their images / videos through the ViT) into paged K/V.

`UndPrefill(items)` runs several (prompt, generated tokens) items through the und tower in one pass: the
tokens of each item go into a new sequence of the shared paged pool (its K/V), image and video placeholder
rows take the vision encoder's embeddings and Qwen3-VL's deepstack features, and the final-normed hidden
state of every token comes back (the last row gives the next token's logits). A preempted chat's resume
passes the tokens it had generated, prefilled after its prompt at the positions their decode steps had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from worldserve.models.cosmos3.batch import UndBatch
from worldserve.models.cosmos3.vision import VisionEncoder
from worldserve.models.layers.paged_kv import PagedKVPool, PagedSequence
from worldserve.runner.chat_prompt import ChatPrompt


class UndPrefill:
    """Prefill passes of one Reasoner: its transformer, K/V pool, vision encoder and placeholder token ids."""

    def __init__(
        self, transformer: Any, pool: PagedKVPool, vision: VisionEncoder | None, *, image_token_id: int,
        video_token_id: int,
    ) -> None:  # fmt: skip
        self.transformer = transformer
        self.pool = pool
        self.vision = vision
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id

    @torch.inference_mode()
    def __call__(
        self, items: Sequence[tuple[ChatPrompt, Sequence[int]]]
    ) -> list[tuple[Tensor, PagedSequence, int]]:
        """prefill() of several (prompt, generated) items in ONE und pass (a prefill of short prompts is
        launch-bound: 32 of them cost about what one does). All or nothing: PoolExhausted takes no blocks."""
        model = self.transformer
        seqs: list[PagedSequence] = []
        try:
            for prompt, generated in items:
                seqs.append(self.pool.sequence())
                seqs[-1].reserve(len(prompt.input_ids) + len(generated) + 1)
            ids, positions, embeds, deepstack, rows, offset = [], [], [], [], [], 0
            visual = any(p.vision is not None or p.video is not None for p, _ in items)
            for prompt, generated in items:
                ids.append(
                    torch.tensor(prompt.input_ids + list(generated), dtype=torch.long, device=model.device)
                )
                after = prompt.next_position + torch.arange(len(generated), dtype=torch.float32)
                positions.append(torch.cat([prompt.positions, after.expand(3, -1)], dim=1))  # [3, N_i]
                if prompt.vision is not None or prompt.video is not None:
                    e, ds, r = self._visual_embeddings(ids[-1], prompt)
                    embeds.append(e)
                    deepstack.append(ds)
                    rows.append(r + offset)
                elif visual:
                    embeds.append(model.embed_tokens(ids[-1]))
                offset += ids[-1].numel()
            batch = UndBatch(
                input_ids=torch.cat(ids), positions=torch.cat(positions, dim=1).to(model.device),
                seq_lens=tuple(x.numel() for x in ids), inputs_embeds=torch.cat(embeds) if visual else None,
                deepstack=tuple(torch.cat(layer) for layer in zip(*deepstack, strict=True)),
                visual_rows=torch.cat(rows) if rows else None,
            )  # fmt: skip
            hidden = model.und_step(batch, seqs).split(list(batch.seq_lens))  # [N_i, d] each
        except BaseException:
            for seq in seqs:
                seq.release()
            raise
        return [
            (h, seq, prompt.next_position + len(generated))
            for h, seq, (prompt, generated) in zip(hidden, seqs, items, strict=True)
        ]

    def _visual_embeddings(
        self, ids: Tensor, prompt: ChatPrompt
    ) -> tuple[Tensor, tuple[Tensor, ...], Tensor]:
        """(token embeddings with the ViT rows in, deepstack features [M, d] each, visual rows [M]); image and
        video rows in sequence order, as Qwen3-VL joins them."""
        assert self.vision is not None
        model = self.transformer
        embeds = model.embed_tokens(ids)
        in_prompt = torch.arange(ids.numel(), device=ids.device) < len(prompt.input_ids)  # not generated ones
        is_img = (ids == self.image_token_id) & in_prompt
        is_vid = (ids == self.video_token_id) & in_prompt
        rows = (is_img | is_vid).nonzero().squeeze(1)  # [M]
        deepstack: list[Tensor] = []
        for inputs, mask in ((prompt.vision, is_img), (prompt.video, is_vid)):
            if inputs is None:
                continue
            vis, ds = self.vision.encode(inputs)  # [m, d], each [m, d]
            embeds = embeds.index_copy(0, mask.nonzero().squeeze(1), vis.to(model.dtype))
            joint = mask[rows]  # [M] bool: which of the visual rows are this modality's
            if not deepstack:
                deepstack = [vis.new_zeros(rows.numel(), vis.shape[1]) for _ in ds]
            for acc, feat in zip(deepstack, ds, strict=True):
                acc[joint] = feat
        return embeds, tuple(deepstack), rows
