"""A downloaded body's `Content-Encoding` undone as it streams in (api/media_urls.py reads media URLs with it).

http.client asks for `identity`, but some servers compress regardless (an S3 object stored gzipped is served
so): vLLM's download (aiohttp), browsers, curl and httpx decode gzip and deflate, and so does this one. Each
chunk inflates to at most the `limit` the caller gives (what is left of the request's download budget, plus
one byte), so a small body that inflates to gigabytes (a compression bomb) is refused there, never held.

`deflate` is the zlib format (RFC 9110), but some servers send bare deflate data (RFC 1951, no zlib header)
under that name. The body's first bytes are tried as zlib (a gzip header is read too) and, when they are no
such header, read again as raw deflate (wbits -15): urllib3's and curl's fallback (aiohttp switches on the
first byte's compression-method nibble; a raw stream's first byte would need non-zero padding bits to pass
for a zlib header). The bytes held until that is judged are the header's two. A body that stops inside its
stream is refused, as aiohttp refuses a deflate one and Python's gzip and curl a gzip one. A gzip body of several members (files gzipped one after
another and joined, which `gzip -c a b` writes) is decoded whole, as Python's gzip, curl and browsers decode it
(zlib stops at the first member's end). Another encoding (br, zstd, ...) is an
UnsupportedEncoding; data that does not inflate is a zlib.error.
"""

from __future__ import annotations

import zlib

ZLIB_HEADER_BYTES = 2
"""A zlib header's length (CMF, FLG): zlib judges it as soon as it has both."""
GZIP_OR_ZLIB_WBITS = zlib.MAX_WBITS | 32
"""zlib's automatic header detection: a gzip or a zlib header, told apart by their bytes."""
RAW_DEFLATE_WBITS = -zlib.MAX_WBITS


class UnsupportedEncoding(ValueError):
    """A Content-Encoding this server does not decode (its name is the message)."""


class BodyDecoder:
    """One body's decompression, chunk by chunk. `raw_fallback` (Content-Encoding deflate): a body whose
    first bytes are no zlib header is read as raw deflate; `gzip`: every member of a multi-member body read."""

    def __init__(self, *, raw_fallback: bool, gzip: bool = False) -> None:
        self._inflater = zlib.decompressobj(GZIP_OR_ZLIB_WBITS)
        self._gzip = gzip
        """gzip: a member ended with bytes after it starts the next member."""
        self._head: bytearray | None = bytearray() if raw_fallback else None
        """The body's first bytes, kept until its format is judged (None: judged, or no fallback)."""
        self._received = False
        """Bytes came: a body that then stops inside its stream is refused at `finish` (aiohttp's check at the
        end, for deflate; Python's gzip, curl and browsers refuse a gzip body cut before its trailer: a cut
        form had run a job with the cut prompt)."""

    def take(self, chunk: bytes | None, limit: int) -> bytes:
        """`decode(chunk)`, or with None (the body has ended) `finish()`: how a reader feeds it."""
        return self.decode(chunk, limit) if chunk is not None else self.finish(limit)

    def decode(self, chunk: bytes, limit: int) -> bytes:
        """The next decompressed bytes, at most `limit` (>= 1) of them; zlib.error for data that does not
        inflate."""
        self._received = self._received or bool(chunk)
        if self._head is None:
            return self._members(self._inflater.decompress(chunk, limit), limit)
        self._head += chunk
        if len(self._head) < ZLIB_HEADER_BYTES:
            return b""
        return self._members(self._judge(limit), limit)

    def _members(self, out: bytes, limit: int) -> bytes:
        """`out` and what the gzip members after the ended one give, up to `limit` bytes in all."""
        while self._gzip and self._inflater.eof and self._inflater.unused_data and len(out) < limit:
            rest = self._inflater.unused_data
            self._inflater = zlib.decompressobj(GZIP_OR_ZLIB_WBITS)
            out += self._inflater.decompress(rest, limit - len(out))
        return out

    def finish(self, limit: int) -> bytes:
        """What is left once the body has ended: a body shorter than a zlib header is judged now; zlib.error
        for a body cut short (bytes received, its stream not ended: a one-byte body is one; a gzip member
        without its CRC / length trailer too)."""
        rest = self._judge(limit) if self._head else b""
        if self._received and not self._inflater.eof:
            raise zlib.error("the compressed stream ends before its end")
        return rest

    def _judge(self, limit: int) -> bytes:
        """The held first bytes decompressed as zlib (or gzip), else as raw deflate."""
        assert self._head is not None
        head, self._head = bytes(self._head), None
        try:
            return self._inflater.decompress(head, limit)
        except zlib.error:
            self._inflater = zlib.decompressobj(RAW_DEFLATE_WBITS)
            return self._inflater.decompress(head, limit)


def body_decoder(encoding: str | None) -> BodyDecoder | None:
    """The decoder of a body sent with this `Content-Encoding`, None for one sent as it is (none, or
    `identity`); a list of codings (RFC 9110 §8.4: "gzip, identity") is one coding and any `identity`s;
    UnsupportedEncoding for another coding, or for two stacked (not decoded here)."""
    names = [n for n in ((encoding or "").lower().replace(" ", "").split(",")) if n not in ("", "identity")]
    if not names:
        return None
    if len(names) == 1 and names[0] in ("gzip", "x-gzip", "deflate"):
        return BodyDecoder(raw_fallback=names[0] == "deflate", gzip=names[0] != "deflate")
    raise UnsupportedEncoding(encoding)
