"""Layerwise offload: same-layout blocks kept in (pinned) host memory, streamed into a few device slots.

`BlockStreamer(blocks, device, slots=2)` packs every parameter and buffer of each block into one flat host
buffer per block (pinned on CUDA) and re-points the block's tensors at views of device slot `i % slots`: so
blocks i and i + slots share device memory and only `slots` blocks occupy the GPU at a time. Running block i
inside `with streamer.use(i):` makes sure its bytes are in its slot, and issues the host->device copy of
block i + 1 on a side stream, where it overlaps block i's compute; the copy into a slot waits for the last
block that used the slot to finish (CUDA events, no host syncs). Block n - 1 prefetches block 0 (when
they map to different slots), so the next forward of a denoising loop starts with its first block resident.

The tensors keep their identity, shapes, strides and dtypes (only their storage moves), so code that holds
them, torch.compile'd graphs included, runs unchanged. On a CPU device the same aliasing runs with plain
synchronous copies (tests; it saves no memory there). Blocks must be fully loaded (and quantised, if at all)
before they are packed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

ALIGN = 256
"""Byte alignment of every tensor inside a packed block (cuBLAS / Triton / FA3 want >= 16)."""


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def _tensors(block: nn.Module) -> list[tuple[str, Tensor]]:
    """Every parameter and buffer of `block` (None buffers skipped), in a stable order."""
    named = list(block.named_parameters()) + [(n, b) for n, b in block.named_buffers() if b is not None]
    return sorted(named, key=lambda item: item[0])


def block_layout(block: nn.Module) -> tuple[list[_Entry], int]:
    """Where each of `block`'s tensors sits in its packed buffer, and the buffer's bytes (ALIGN-padded)."""
    entries, offset = [], 0
    for name, t in _tensors(block):
        if not t.is_contiguous():
            raise ValueError(f"layerwise offload needs contiguous tensors; {name} is not")
        nbytes = t.numel() * t.element_size()
        entries.append(_Entry(name, tuple(t.shape), t.dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def _view(buffer: Tensor, e: _Entry) -> Tensor:
    return buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)


def pinned_chunks(count: int, nbytes: int) -> list[tuple[int, int]]:
    """[(chunk bytes, blocks in it)] for `count` blocks of `nbytes`: PyTorch's pinned-memory allocator rounds
    every allocation up to a power of two (368 MiB blocks would pin 512 MiB each), so blocks are packed
    greedily into power-of-two chunks; the waste stays under one block per chunk."""
    chunks = []
    while count:
        size = 1 << ((count * nbytes).bit_length() - 1)  # the largest power of two <= what is left
        if size < nbytes:
            size = 1 << (nbytes - 1).bit_length()  # the smallest that holds one block
        k = min(count, size // nbytes)
        chunks.append((size, k))
        count -= k
    return chunks


def _host_buffers(count: int, nbytes: int, pin: bool) -> tuple[list[Tensor], int]:
    """`count` uint8 host buffers of `nbytes`, views into power-of-two chunks (pinned when `pin`; the same
    layout unpinned on a CPU device, so that the tests run it), and the bytes allocated for them."""
    views, total = [], 0
    chunks = pinned_chunks(count, nbytes)
    for size, k in chunks:
        try:
            chunk = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as e:  # cudaHostAlloc failed: not enough free (lockable) host RAM
            need = sum(c for c, _ in chunks) / 2**30
            raise RuntimeError(
                f"layerwise offload could not pin {size / 2**30:.1f} GiB of host memory ({need:.1f} GiB in all "
                f"for these {count} blocks): free host RAM, or run without --enable-layerwise-offload ({e})"
            ) from e
        views += [chunk[j * nbytes : (j + 1) * nbytes] for j in range(k)]
        total += size
    return views, total


class BlockStreamer:
    """Blocks of one layout in host memory, `slots` of them resident on `device` at a time (see module doc)."""

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device, *, slots: int = 2) -> None:
        if not blocks:
            raise ValueError("no blocks to offload")
        if slots < 2:
            raise ValueError(
                f"layerwise offload needs >= 2 device slots (one computing, one loading), got {slots}"
            )
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if cuda and self.device.index is None:  # streams and events want an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots = min(slots, len(blocks))
        self.entries, self.block_bytes = block_layout(blocks[0])
        self.slots = [
            torch.empty(self.block_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(self.num_slots)
        ]
        self.host, self.pinned_bytes = _host_buffers(len(blocks), self.block_bytes, pin=cuda)
        for i, (block, host) in enumerate(zip(blocks, self.host, strict=True)):
            entries, _ = block_layout(block)
            if entries != self.entries:
                raise ValueError(
                    f"block {i} differs in layout from block 0; layerwise offload needs identical blocks"
                )
            tensors = dict(_tensors(block))
            with torch.no_grad():
                for e in self.entries:
                    _view(host, e).copy_(tensors[e.name])
                    tensors[e.name].data = _view(
                        self.slots[i % self.num_slots], e
                    )  # the old storage is freed
        self._copy_stream = None
        if cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
            # The slots' memory may have served tensors whose kernels are still queued on the compute stream,
            # and the allocator must not hand it on while a copy still writes it (after the streamer is gone).
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            for slot in self.slots:
                slot.record_stream(self._copy_stream)
        self._resident: list[int | None] = [
            None
        ] * self.num_slots  # block whose copy was issued into each slot
        self._loaded: list[torch.cuda.Event | None] = [None] * self.num_slots  # that copy's completion
        self._freed: list[torch.cuda.Event | None] = [None] * self.num_slots  # last compute reading the slot

    def __len__(self) -> int:
        return len(self.host)

    @property
    def device_bytes(self) -> int:
        """Device memory the streamed blocks occupy (all slots)."""
        return self.num_slots * self.block_bytes

    @property
    def host_bytes(self) -> int:
        """The blocks' bytes in host memory (`pinned_bytes`: what was allocated for them)."""
        return len(self.host) * self.block_bytes

    @contextmanager
    def use(self, i: int) -> Iterator[None]:
        """Run block i inside: its bytes are on the device when the body's kernels run; block i + 1 loads meanwhile."""
        slot = i % self.num_slots
        self._load(i)
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[slot])
        following = (i + 1) % len(self.host)
        if following % self.num_slots != slot:  # not the wrap-around of an odd count onto this very slot
            self._load(following)
        try:
            yield
        finally:  # also after an error: kernels of this block may still be queued
            if self._copy_stream is not None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._freed[slot] = event

    def _load(self, i: int) -> None:
        """Issue block i's host->device copy into its slot unless it is already there."""
        slot = i % self.num_slots
        if self._resident[slot] == i:
            return
        self._resident[slot] = i
        if self._copy_stream is None:
            self.slots[slot].copy_(self.host[i])
            return
        with torch.cuda.stream(self._copy_stream):
            if self._freed[slot] is not None:
                self._copy_stream.wait_event(self._freed[slot])  # the slot's previous block has finished
            self.slots[slot].copy_(self.host[i], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
            self._loaded[slot] = event
