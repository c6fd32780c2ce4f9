"""Recently processed chat media, by content (vLLM's multimodal processor cache, `--mm-processor-cache-gb`).

A conversation sends its images and videos again with every turn (the OpenAI API is stateless), and two
users may ask about the same picture. Decoding a 720p JPEG, resizing it to the ViT's grid and hashing it costs
~30-40 ms of CPU a request; decoding and sampling a short MP4 hundreds. `ProcessorCache` keeps those results
under a key of the media's bytes (`content_key`) and whatever else decided them (the pixel budget, the video
sampling), least recently used first out past `max_bytes` (0: nothing kept). Values are never written
after they are kept: one object serves every request that finds it.

Kept here: the decoded image (api/chat_media.py), its resized uint8 patches and digest
(models/cosmos3/vision.py ImagePreprocessor), the decoded, sampled video (api/chat_media.py). The ViT's
outputs have their own cache on the device (runner/encoder_cache.py), the K/V of the prompt its own (the
prefix cache).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

DEFAULT_PROCESSOR_CACHE_GB = 4.0
"""vLLM's default --mm-processor-cache-gb (a 720p image takes ~5.4 MB: its pixels and its resized patches)."""


def content_key(data: bytes) -> bytes:
    """SHA-256 of media bytes: the cache's key of that content (~0.6 ms a megabyte; faster than BLAKE2 where
    the CPU has SHA instructions)."""
    return hashlib.sha256(data).digest()


class ProcessorCache:
    """Thread-safe LRU of processed media, bounded by the values' bytes (the API's worker threads share it)."""

    def __init__(self, max_bytes: int = int(DEFAULT_PROCESSOR_CACHE_GB * 2**30)) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.queries = self.hits = 0  # media items looked up / found (vLLM's mm_cache counters)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def enabled(self) -> bool:
        """Whether anything can be kept (--mm-processor-cache-gb 0: no; callers then hash no keys)."""
        return self.max_bytes > 0

    def get(self, key: Hashable, *, counted: bool = True) -> Any | None:
        """The value kept under `key` (now the most recently used), or None. `counted`: a lookup of a chat's
        media item (its decoded image or video), which the queries / hits counters count (vLLM's
        mm_cache_queries / mm_cache_hits, in items); a later stage's lookup of the same item passes False."""
        with self._lock:
            self.queries += counted
            item = self._items.get(key)
            if item is None:
                return None
            self.hits += counted
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        """Keep `value` (`nbytes` of memory) under `key`, dropping the least recently used past max_bytes; a
        value larger than the whole cache is not kept."""
        if nbytes > self.max_bytes:
            return
        with self._lock:
            if (old := self._items.pop(key, None)) is not None:
                self.bytes -= old[1]
            self._items[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, n) = self._items.popitem(last=False)
                self.bytes -= n
