"""http(s) media URLs in requests, downloaded by the server (serving-api.md §4.3 for video references,
§11.2 for chat parts), as vLLM-Omni and vLLM do.

`MediaFetcher.fetch(url, ...)` downloads in a worker thread with the standard library (no new dependency;
`fetch_blocking` on a thread that may block),
within a total deadline (`timeout_s`: vLLM-Omni's 60 s for references; vLLM's `VLLM_IMAGE_FETCH_TIMEOUT` /
`VLLM_VIDEO_FETCH_TIMEOUT` for chat media) and the upload limit (`--max-upload-mb`), following redirects
unless `VLLM_MEDIA_URL_ALLOW_REDIRECTS=0`. Every failure is a ParamError (400) naming the field, with
vLLM-Omni's wording: `Invalid image_reference.image_url: failed to download image.`, `... server returned
HTTP 404.`, `... redirect response was rejected ...`.

Security: like vLLM, any host is fetched unless `--allowed-media-domains` names the allowed ones (then any
other host, redirects included, is a 400). A server that fetches URLs reaches whatever its network reaches
(SSRF): deployments that take requests from untrusted clients should set the allowlist.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from worldserve import __version__
from worldserve.params import ParamError

CHUNK = 1 << 20


def is_http_url(url: str) -> bool:
    return url.startswith(("http://", "https://"))


class _Refused(Exception):
    """A redirect the policy does not follow (its message is the client-facing reason)."""


@dataclass(frozen=True, slots=True)
class MediaFetcher:
    max_bytes: int
    """The largest download accepted (the server's upload limit)."""
    allowed_domains: tuple[str, ...] = ()
    """Hosts media may come from (a host or any subdomain of it); empty: any host."""
    allow_redirects: bool = True

    def check(self, url: str, param: str, what: str | None = None) -> None:
        """ParamError(param) unless `url` is http(s) with a host the allowlist admits."""
        what = what or param
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ParamError(param, f"Invalid {what}: must be an http(s) URL or data URL.")
        host = parts.hostname.lower()
        if self.allowed_domains and not any(
            host == d or host.endswith("." + d) for d in self.allowed_domains
        ):
            raise ParamError(
                param, f"Invalid {what}: host {host!r} is not in the server's --allowed-media-domains."
            )

    async def fetch(
        self, url: str, *, param: str, kind: str, timeout_s: float, what: str | None = None
    ) -> bytes:
        """The body at `url`, downloaded off the event loop; `kind` is the media ("image", "video"), `what`
        names the URL in messages (default `param`; e.g. "image_reference.image_url" for the field
        "image_reference"). ParamError(param) (a 400) on any failure."""
        self.check(url, param, what)
        return await asyncio.to_thread(
            self.fetch_blocking, url, param=param, kind=kind, timeout_s=timeout_s, what=what
        )

    def fetch_blocking(
        self, url: str, *, param: str, kind: str, timeout_s: float, what: str | None = None
    ) -> bytes:
        """`fetch` on the calling thread."""
        what = what or param
        self.check(url, param, what)
        fetcher = self

        class Redirects(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, req, fp, code, msg, headers, newurl):
                if not fetcher.allow_redirects:
                    raise _Refused(
                        f"Invalid {what}: redirect response was rejected (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)."
                    )
                fetcher.check(newurl, param, what)
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        opener = urllib.request.build_opener(Redirects)
        request = urllib.request.Request(url, headers={"User-Agent": f"worldserve/{__version__}"})
        deadline = time.monotonic() + timeout_s
        try:
            with opener.open(request, timeout=timeout_s) as resp:
                declared = resp.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise ParamError(param, self._too_large(what, kind))
                chunks, size = [], 0
                while chunk := resp.read(CHUNK):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ParamError(param, self._too_large(what, kind))
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    chunks.append(chunk)
        except ParamError:
            raise
        except _Refused as exc:
            raise ParamError(param, str(exc)) from None
        except urllib.error.HTTPError as exc:
            raise ParamError(param, f"Invalid {what}: server returned HTTP {exc.code}.") from None
        except (urllib.error.URLError, OSError, ValueError, TimeoutError):
            raise ParamError(param, f"Invalid {what}: failed to download {kind}.") from None
        return b"".join(chunks)

    def _too_large(self, what: str, kind: str) -> str:
        return (
            f"Invalid {what}: the {kind} is larger than this server's {self.max_bytes >> 20} MB upload limit."
        )


def allowed_domains(values: Sequence[str] | None) -> tuple[str, ...]:
    """`--allowed-media-domains` values (space- or comma-separated) as lower-case hosts."""
    hosts = [h.strip().lower().lstrip(".") for v in values or () for h in v.split(",")]
    return tuple(h for h in hosts if h)
