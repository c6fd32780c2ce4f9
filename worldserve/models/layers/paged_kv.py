"""Paged K/V cache for the Reasoner's chats: one pool of fixed-size blocks shared by every sequence.

Why paged: a CUDA-graphed decode step needs every sequence's K/V at addresses that do not move between steps,
and many chats of unknown length must share a memory budget without fragmenting it (vLLM's PagedAttention).
`PagedKVPool` holds K and V for all layers as [layers, num_blocks, block_size, Hkv, D] tensors and a free list
of block ids; block 0 is never handed out (the scratch block that padded rows of a graphed decode batch write
into and read from). A `PagedSequence` owns a list of block ids (its block table) and a host-side length;
token t of the sequence lives in block `table[t // block_size]` at row `t % block_size`.

`PagedSequence` also implements the und step's KVCache protocol (models/layers/attention.py), so a prompt
prefill through `Cosmos3Transformer.und_step` writes straight into the pool; its attention then reads the
chunk's own K/V (a fresh sequence) or the gathered pages. Decode steps go through runner/und_decoder.py,
which writes the new token's K/V at `slot(t)` and attends with models/layers/paged_attention.py.

Blocks go back to the pool on `release()` (finished, cancelled or preempted chats), or when the sequence is
garbage-collected. `reserve()` raises `PoolExhausted` (and allocates nothing) when the free list is short.
`fork()` gives a second sequence over the same K/V (full blocks shared and reference-counted, the last
partial block copied): the choices of one `n > 1` chat completion prefill their prompt once.

Prefix caching (vLLM's automatic prefix caching): a full block whose K/V are committed can be registered
under a hash of its contents and everything before it (runner/prefix_hashes.py). When its last holder frees
it, it keeps its K/V and waits on an LRU list (`num_free` counts it: any allocation may take it back, the
least recently freed first, and then it leaves the cache); `lookup(hashes)` takes the longest run of cached
blocks that starts a new sequence's hashes, so a prompt sharing a prefix with an earlier one prefills only
the rest. A block's K/V are never written after it is full (sequences write past their length only), so a
cached block is as valid as when it was registered.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

DEFAULT_BLOCK_SIZE = 64
"""Tokens a block (64 x 8 heads x 128 x 2 bytes = 128 KiB of K and of V a layer on Cosmos3-Nano)."""


class PoolExhausted(RuntimeError):
    """The pool has fewer free blocks than a reserve() asked for."""


class PagedKVPool:
    """K/V blocks of every layer + the free list. Block 0 is the reserved scratch block."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a paged K/V pool needs at least 2 blocks (one is scratch), got {num_blocks}")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks  # sequences holding each block (forks share their full blocks)
        self._cached: dict[bytes, int] = {}  # prefix hash -> the block holding those K/V
        self._hash_of: dict[int, bytes] = {}  # block -> its prefix hash (registered blocks only)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.prefix_queries = 0  # tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of them, tokens found (vLLM's prefix_cache_hits)
        self.preempted_queries = self.preempted_hits = 0  # the same of resuming chats (vLLM: not exported)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K + V bytes one token takes over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or not)."""
        return len(self._hash_of)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the usable blocks hold (the scratch block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n blocks for new K/V: free ones first, then cached ones nobody holds (least recently freed first;
        they leave the prefix cache)."""
        if n > self.num_free:
            raise PoolExhausted(f"{n} K/V blocks wanted, {self.num_free} free of {self.num_blocks - 1}")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(b)]
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def lookup(self, hashes: Sequence[bytes], tokens: int, *, preempted: bool = False) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first, each now held once more by the
        caller (a block nobody held leaves the LRU list); the sequence's `tokens` count in prefix_queries, the
        tokens found in prefix_hits (vLLM's counters), or, for a `preempted` sequence resuming, in
        preempted_queries / _hits (vLLM keeps those apart)."""
        blocks = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
            blocks.append(b)
        self.count_lookup(tokens, len(blocks) * self.block_size, preempted=preempted)
        return blocks

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, are cached now (a peek: nothing held, nothing counted)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._cached:
            n += 1
        return n

    def count_lookup(self, tokens: int, hits: int, *, preempted: bool = False) -> None:
        """A sequence of `tokens` tokens looked up, `hits` of them found cached (vLLM's PrefixCacheStats.record)."""
        if preempted:
            self.preempted_queries += tokens
            self.preempted_hits += hits
        else:
            self.prefix_queries += tokens
            self.prefix_hits += hits

    def register(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Cache full, committed blocks under their prefix hashes (pairwise). A block already cached, or a hash
        another block already caches (the same K/V computed twice), is left as it is."""
        for b, h in zip(blocks, hashes, strict=False):
            if b not in self._hash_of and h not in self._cached:
                self._cached[h] = b
                self._hash_of[b] = h

    def share(self, blocks: list[int]) -> list[int]:
        """One more holder of `blocks` (a fork); they go back to the free list when the last one frees them."""
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """One holder fewer of each block; a block nobody holds goes back: to the free list, or, when cached,
        to the end of the LRU list (a sequence's last blocks first, so its first ones are evicted last)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer i's K and V pools, [num_blocks, block_size, Hkv, D] each."""
        return self.k[i], self.v[i]

    def sequence(self) -> PagedSequence:
        return PagedSequence(self)


class PagedSequence:
    """One sequence's blocks in a PagedKVPool; the und step's KVCache for its prefill."""

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self._length = 0
        self._rows: dict[tuple[int, int, str], Tensor] = {}  # slots() of the current chunk, by range
        self._finalizer = weakref.finalize(self, pool.free, self.blocks)  # same list object: freed on GC

    @property
    def length(self) -> int:
        """Tokens whose K/V are committed (host int)."""
        return self._length

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def reserve(self, num_new: int) -> None:
        """Blocks for `num_new` more tokens; PoolExhausted (nothing taken) when the pool is short."""
        need = self.pool.blocks_for(self._length + num_new) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.pool.allocate(need))

    def adopt(self, blocks: list[int]) -> None:
        """Extend a sequence of full blocks only (empty, or adopted ones) by full blocks holding its next
        tokens' K/V (a prefix-cache hit, PagedKVPool.lookup, or another sequence's, PagedKVPool.share: the
        caller holds them; this sequence frees them)."""
        if self._length != len(self.blocks) * self.pool.block_size:
            raise RuntimeError("adopt() needs a sequence of full blocks")
        self.blocks.extend(blocks)
        self._length = len(self.blocks) * self.pool.block_size
        self._rows.clear()

    def fork(self) -> PagedSequence:
        """A sequence with the same committed K/V: the full blocks shared, the partly filled last block copied
        (both sequences only ever write past their length, so a shared block is never written again): the
        n choices of one chat prefill their prompt once. PoolExhausted when no block is free for the copy."""
        bs = self.pool.block_size
        full, partial = divmod(self._length, bs)
        twin = PagedSequence(self.pool)
        if partial:
            (copy,) = self.pool.allocate(1)
            src = self.blocks[full]
            self.pool.k[:, copy] = self.pool.k[:, src]  # every layer's K and V of that block
            self.pool.v[:, copy] = self.pool.v[:, src]
            twin.blocks.extend(self.pool.share(self.blocks[:full]) + [copy])
        else:
            twin.blocks.extend(self.pool.share(self.blocks[:full]))
        twin._length = self._length
        return twin

    def release(self) -> None:
        """Hand every block back (the sequence is empty afterwards and may be refilled)."""
        self.pool.free(self.blocks)
        self.blocks.clear()
        self._rows.clear()
        self._length = 0

    def slot(self, t: int) -> int:
        """Flat row of token t in a layer's pool viewed as [num_blocks * block_size, Hkv, D]."""
        bs = self.pool.block_size
        return self.blocks[t // bs] * bs + t % bs

    def slots(self, start: int, end: int, device: torch.device) -> Tensor:
        """[end - start] long: flat rows of tokens start..end-1 (built once per chunk, not once per layer:
        the cache is dropped when the length or the blocks change)."""
        key = (start, end, str(device))
        if key not in self._rows:
            bs = self.pool.block_size
            table = torch.tensor(self.blocks, dtype=torch.long)
            t = torch.arange(start, end)
            self._rows[key] = (table[t // bs] * bs + t % bs).to(device)
        return self._rows[key]

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k/v [n, Hkv, D] after the committed tokens; return this layer's K/V [length + n, Hkv, D]."""
        end = self._length + k.shape[0]
        if end > self.capacity:
            raise RuntimeError(f"paged sequence full: {end} > {self.capacity} tokens; call reserve() first")
        kp, vp = (x.flatten(0, 1) for x in self.pool.layer(layer))  # [blocks * block_size, Hkv, D]
        rows = self.slots(self._length, end, k.device)
        kp.index_copy_(0, rows, k.to(kp.dtype))
        vp.index_copy_(0, rows, v.to(vp.dtype))
        if self._length == 0:
            return k, v  # a fresh sequence attends to its own chunk: no gather
        every = self.slots(0, end, k.device)
        return kp.index_select(0, every), vp.index_select(0, every)

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """Committed K/V of one layer, gathered: [length, Hkv, D] each."""
        kp, vp = (x.flatten(0, 1) for x in self.pool.layer(layer))
        every = self.slots(0, self._length, kp.device)
        return kp.index_select(0, every), vp.index_select(0, every)

    def advance(self, num_new: int) -> None:
        """Commit the chunk written by the last `write` of every layer."""
        if self._length + num_new > self.capacity:
            raise RuntimeError("advance past the reserved blocks")
        self._length += num_new
        self._rows.clear()
