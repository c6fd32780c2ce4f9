"""The Reasoner's prefill: chat prompts (with their images / videos through the ViT) into paged K/V.

`UndPrefill(items)` runs several (prompt, generated tokens) items through the und tower in one pass: the
tokens of each item go into a new sequence of the shared paged pool (its K/V), image and video placeholder
rows take the vision encoder's embeddings and Qwen3-VL's deepstack features, and the final-normed hidden
state of every token computed comes back (the last row gives the next token's logits). A preempted chat's
resume passes the tokens it had generated, prefilled after its prompt at the positions their decode steps had.

Prefix caching (`caching`, vLLM's automatic prefix caching): an item starts on the pool's cached blocks of
its longest cached prefix (runner/prefix_hashes.py keys; at least its last token is computed, for the
logits), and only the rest goes through the tower, attending to the cached K/V (also to blocks an earlier
item of the same pass computes: chats with a common prefix arriving together compute it once, as vLLM's step
does); the ViT runs only for the images and videos with rows left to compute, and takes the ViT outputs of
those seen recently from the encoder cache (encoder_cache.py). After the pass, its full blocks are registered for later chats
(`register`: also when a chat finishes or is preempted, with the tokens it generated). An item marked
`whole` (prompt logprobs want every prompt token's hidden state) is computed whole, as vLLM does.
Chunked prefill (`budget`, vLLM's): a pass computes at most that many tokens; an item left short keeps the
blocks of all its tokens, and `extend` computes its next chunk in a later step (runner/reasoner.py).
`computed` counts the tokens its passes computed (the Reasoner's step budget reads it: step_budget.py).
On a GPU the layers' q|k|v and o/MLP math run through the decode step's compiled copies (`math`, dynamic
shapes: one graph for every prompt length), and passes of up to 2,048 tokens replay them as piecewise CUDA
graphs (`graphs`, runner/prefill_graphs.py): eagerly a layer dispatches ~100 small ops, so a short prompt's
prefill was host-bound at ~35-50 ms on Nano's 36 layers whatever its length (bench/prefill_floor.py).
vLLM's prefix-cache counters: a new chat's lookup counts, a preempted chat's resume apart, and each
later choice of an n > 1 chat (a fork of the first one's K/V: `fork`) counts as vLLM's child request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from worldserve.models.cosmos3.batch import UndBatch
from worldserve.models.cosmos3.vision import VisionEncoder
from worldserve.models.layers.paged_kv import PagedKVPool, PagedSequence
from worldserve.runner.chat_prompt import ChatPrompt
from worldserve.runner.encoder_cache import EncoderCache, select_items
from worldserve.runner.prefill_graphs import PrefillGraphs
from worldserve.runner.prefix_hashes import block_hashes, shared_blocks
from worldserve.sampling.tokens import host_to

if TYPE_CHECKING:
    from worldserve.chat_params import ChatParams


class UndPrefill:
    """Prefill passes of one Reasoner: its transformer, K/V pool, vision encoder and placeholder token ids."""

    def __init__(
        self, transformer: Any, pool: PagedKVPool, vision: VisionEncoder | None, *, image_token_id: int,
        video_token_id: int, caching: bool = True, math: tuple | None = None, graphed: bool = False,
    ) -> None:  # fmt: skip
        self.transformer = transformer
        self.math = math  # (qkv, finish): the decode step's compiled layer math (dynamic shapes), or eager
        self.graphs = None  # the pass as piecewise CUDA graphs (`graphed`: CUDA, one rank, layers resident)
        if graphed and math is not None:
            self.graphs = PrefillGraphs(
                transformer, math, num_deepstack=vision.num_deepstack if vision else 0
            )
        self.pool = pool
        self.vision = vision
        self.encoder = EncoderCache(vision) if vision is not None else None  # ViT outputs of recent images
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.caching = caching
        self.computed = 0  # tokens computed by its passes so far

    @torch.inference_mode()
    def __call__(
        self, items: Sequence[tuple[ChatPrompt, Sequence[int]]], whole: Sequence[bool] = (),
        budget: int | None = None, resumed: Sequence[bool] = (),
    ) -> list[tuple[Tensor, PagedSequence, int]]:  # fmt: skip
        """prefill() of several (prompt, generated) items in ONE und pass (a prefill of short prompts is
        launch-bound: 32 of them cost about what one does): per item (final-normed hidden [n_i, d] of its
        computed tokens, the last ones, its sequence, next position). All or nothing: PoolExhausted takes no
        blocks. `whole[i]`: item i skips the prefix cache (all its tokens computed). `budget` (chunked
        prefill): the pass computes at most that many tokens (each item at least one), in item order; an item
        left short (its sequence's length below its tokens) holds the blocks of all its tokens, and `extend`
        computes the rest. `resumed[i]`: item i is a preempted chat's resume (its lookups counted apart, as
        vLLM's, also when it had generated nothing yet: preempted mid-prefill); an item with generated tokens
        is one."""
        bs = self.pool.block_size
        totals = [len(prompt.input_ids) + len(generated) for prompt, generated in items]
        # each item's block keys, once: its lookup's (all but its last token, always computed) and, after the
        # pass, its registration's
        keys = [
            block_hashes(p, g, bs, n) if self.caching else [] for (p, g), n in zip(items, totals, strict=True)
        ]
        seqs: list[PagedSequence] = []
        resumes = [bool(g) or (i < len(resumed) and resumed[i]) for i, (_, g) in enumerate(items)]
        try:
            for i in range(len(items)):  # every lookup before any allocation evicts
                seqs.append(self.pool.sequence())
                if self.caching and not (i < len(whole) and whole[i]):
                    # (a resume is counted apart, as vLLM counts it)
                    hits = self.pool.lookup(keys[i][: (totals[i] - 1) // bs], totals[i], preempted=resumes[i])
                    seqs[-1].adopt(hits)
            ends: list[int] = []
            left = budget
            for i, (seq, total) in enumerate(zip(seqs, totals, strict=True)):  # in pass order
                if self.caching and not (i < len(whole) and whole[i]):
                    if extra := self._computed_earlier(i, keys[i][: (total - 1) // bs], seqs, keys, ends):
                        seq.adopt(self.pool.share(extra))
                        self.pool.count_lookup(0, len(extra) * bs, preempted=resumes[i])
                seq.reserve(total + 1 - seq.length)
                todo = total - seq.length if left is None else max(1, min(total - seq.length, left))
                ends.append(seq.length + todo)
                left = None if left is None else left - todo
            hidden = self._pass(items, seqs, ends, keys)
        except BaseException:
            for seq in seqs:
                seq.release()
            raise
        return [
            (h, seq, prompt.next_position + len(generated))
            for h, seq, (prompt, generated) in zip(hidden, seqs, items, strict=True)
        ]

    @torch.inference_mode()
    def extend(self, prompt: ChatPrompt, generated: Sequence[int], seq: PagedSequence, budget: int) -> Tensor:
        """The next chunk of a sequence an earlier pass left short (chunked prefill): up to `budget` more of
        its tokens computed; the final-normed hidden [n, d] of those (the last row gives the next token's
        logits once the sequence holds every token). Its blocks were reserved when it started."""
        end = min(len(prompt.input_ids) + len(generated), seq.length + budget)
        # the keys of its blocks up to the chunk's end, for their registration after the pass
        keys = [block_hashes(prompt, generated, self.pool.block_size, end) if self.caching else []]
        return self._pass([(prompt, generated)], [seq], [end], keys)[0]

    def _pass(
        self, items: Sequence[tuple[ChatPrompt, Sequence[int]]], seqs: Sequence[PagedSequence],
        ends: Sequence[int], keys: Sequence[Sequence[bytes]],
    ) -> list[Tensor]:  # fmt: skip
        """One und pass computing tokens [seq.length, end) of each item into its sequence, its images' /
        videos' rows there through the ViT; then its full blocks registered. Hidden [n_i, d] per item."""
        model = self.transformer
        ids, positions, embeds, deepstack, rows, offset = [], [], [], [], [], 0
        vit = [self._vit_rows_left(p, s.length, e) for (p, _), s, e in zip(items, seqs, ends, strict=True)]
        visual = any(vit)
        for seq, (prompt, generated), end, vit_left in zip(seqs, items, ends, vit, strict=True):
            start = seq.length
            # pinned and non-blocking: no wait for the decode step queued before this pass
            every = host_to(prompt.input_ids + list(generated), torch.long, model.device)
            ids.append(every[start:end])
            after = prompt.next_position + torch.arange(len(generated), dtype=torch.float32)
            positions.append(
                torch.cat([prompt.positions, after.expand(3, -1)], dim=1)[:, start:end]
            )  # [3, n_i]
            if vit_left:
                e, ds, r = self._visual_embeddings(every, prompt, start, end)
                here = (r >= start) & (r < end)  # [M] the visual rows this pass computes
                embeds.append(e[start:end])
                deepstack.append(tuple(x[here] for x in ds))
                rows.append(r[here] - start + offset)
            elif visual:
                embeds.append(model.embed_tokens(ids[-1]))
            offset += ids[-1].numel()
        batch = UndBatch(
            input_ids=torch.cat(ids), positions=host_to(torch.cat(positions, dim=1), torch.float32, model.device),
            seq_lens=tuple(x.numel() for x in ids), inputs_embeds=torch.cat(embeds) if visual else None,
            deepstack=tuple(torch.cat(layer) for layer in zip(*deepstack, strict=True)),
            visual_rows=torch.cat(rows) if rows else None,
        )  # fmt: skip
        if self.graphs is not None and self.graphs.fits(batch):
            hidden = self.graphs(batch, seqs)
        else:
            hidden = model.und_step(batch, seqs, math=self.math)
        self.computed += sum(batch.seq_lens)
        bs = self.pool.block_size
        for seq, k in zip(seqs, keys, strict=True):  # its committed full blocks
            n = min(len(k), seq.length // bs)
            self.pool.register(seq.blocks[:n], k[:n])
        return list(hidden.split(list(batch.seq_lens)))  # [n_i, d] each

    def _computed_earlier(
        self, i: int, want: Sequence[bytes], seqs: Sequence[PagedSequence], keys: Sequence[Sequence[bytes]],
        ends: Sequence[int],
    ) -> list[int]:  # fmt: skip
        """The blocks past item i's cache hit, along its lookup keys `want`, that an earlier item j of this pass
        computes (its full blocks before ends[j], where a budget may cut it): the longest such run (block keys
        chain, so equal keys mean equal prefixes). vLLM counts blocks computed in the same step as hits, as
        here: in every layer an item's K/V are written before a later item's attention reads them."""
        bs = self.pool.block_size
        have = seqs[i].length // bs
        best, src = have, None
        for j in range(i):
            m = shared_blocks(want, keys[j], have, ends[j] // bs)
            if m > best:
                best, src = m, j
        return [] if src is None else seqs[src].blocks[have:best]

    def capture_all(self) -> None:
        """Capture the prefill's graphs of every token bucket (server start); a no-op without graphs."""
        if self.graphs is not None:
            self.graphs.capture_all()

    def fork(self, seq: PagedSequence, prompt: ChatPrompt, params: ChatParams) -> PagedSequence:
        """seq.fork() for another choice (`params`) of the same prompt, counted as vLLM counts the lookup of a
        later child request of an n > 1 one, which finds the full blocks of the first one's prompt (all but its
        last token) cached; not with prompt logprobs (no lookup)."""
        twin = seq.fork()
        if self.caching and params.prompt_logprobs is None:
            n = len(prompt.input_ids)
            self.pool.count_lookup(n, (n - 1) // self.pool.block_size * self.pool.block_size)
        return twin

    def register(self, prompt: ChatPrompt, generated: Sequence[int], seq: PagedSequence) -> None:
        """Offer `seq`'s full blocks (the K/V of prompt + generated, as far as committed) to the prefix cache."""
        if self.caching and seq.length >= self.pool.block_size:
            hashes = block_hashes(prompt, generated, self.pool.block_size, seq.length)
            self.pool.register(seq.blocks[: len(hashes)], hashes)

    def _vit_rows_left(self, prompt: ChatPrompt, start: int, end: int) -> bool:
        """Whether the prompt has image / video rows in [start, end) (the ViT must run for this item)."""
        if prompt.vision is None and prompt.video is None:
            return False
        left = torch.as_tensor(prompt.input_ids[start:end])
        return bool(((left == self.image_token_id) | (left == self.video_token_id)).any())

    def _visual_embeddings(
        self, ids: Tensor, prompt: ChatPrompt, cached: int, end: int
    ) -> tuple[Tensor, tuple[Tensor, ...], Tensor]:
        """(token embeddings with the ViT rows in, deepstack features [M, d] each, visual rows [M]); image and
        video rows in sequence order, as Qwen3-VL joins them. Only the images / videos with rows in
        [cached, end) go through the encoder: rows before it (and their deepstack features, left zero) are in
        cached blocks, and re-encoding an item the prefix cache holds whole (e.g. a long video, too large
        for the encoder cache, before a new turn's image) would be wasted; rows past `end` come in a later
        chunk (one cut by the chunk's end is encoded for both, the second time from the encoder cache)."""
        assert self.vision is not None and self.encoder is not None  # (both or neither: __init__)
        model = self.transformer
        embeds = model.embed_tokens(ids)
        in_prompt = torch.arange(ids.numel(), device=ids.device) < len(prompt.input_ids)  # not generated ones
        is_img = (ids == self.image_token_id) & in_prompt
        is_vid = (ids == self.video_token_id) & in_prompt
        rows = (is_img | is_vid).nonzero().squeeze(1)  # [M]
        deepstack: list[Tensor] = []
        for inputs, mask, token in ((prompt.vision, is_img, self.image_token_id),
                                    (prompt.video, is_vid, self.video_token_id)):  # fmt: skip
            if inputs is None:
                continue
            digests = [
                d for row, d in prompt.media if prompt.input_ids[row] == token
            ]  # this kind's, in order
            at = mask.nonzero().squeeze(1)  # [m] this kind's rows, item after item
            spans = torch.tensor([0, *inputs.tokens_per_image(self.vision.merge_size)]).cumsum(0).tolist()
            items = [
                i for i in range(len(spans) - 1) if at[spans[i + 1] - 1] >= cached and at[spans[i]] < end
            ]
            if not items:
                continue
            digests = [digests[i] for i in items] if len(digests) == len(spans) - 1 else []  # []: uncached
            vis, ds = self.encoder.encode(select_items(inputs, items), digests)  # [m', d], each [m', d]
            take = torch.cat([at[spans[i] : spans[i + 1]] for i in items])  # [m'] their rows
            embeds = embeds.index_copy(0, take, vis.to(model.dtype))
            where = torch.searchsorted(rows, take)  # [m'] their places among the visual rows
            if not deepstack:
                deepstack = [vis.new_zeros(rows.numel(), vis.shape[1]) for _ in ds]
            for acc, feat in zip(deepstack, ds, strict=True):
                acc[where] = feat
        return embeds, tuple(deepstack), rows
