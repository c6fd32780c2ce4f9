"""How a media download reaches its host (api/media_urls.py), within its deadline and away from private networks.

- `resolve(host, port, deadline)`: getaddrinfo on a thread of its own (it takes no timeout), waited for until
  the deadline; at most MAX_LOOKUPS in flight, so hosts whose DNS hangs cannot hold up the downloads of others.
- `blocked_address(ip)`: whether a download must not connect there (loopback, private, link-local: the cloud
  metadata service, ...) unless the operator named the host; the addresses judged are the ones connected to.
- `connect(host, addresses, https, deadline, held)`: each address in turn, TLS checked for https, every socket
  made put in `held` at once so that the deadline's timer (`expire`) can break a blocked connect, handshake
  or read.
- `time_left(deadline)`, `tls_context()`: the seconds left (TimeoutError once passed); the verifying context.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
import threading
import time

MAX_LOOKUPS = 64
"""Name lookups in flight at once. A lookup is waited for only until its download's deadline, but its thread
runs until the system resolver answers; past this bound a download fails at once instead of queueing behind
hung lookups (so hosts whose DNS hangs cannot hold up the downloads of other hosts)."""
_lookups = threading.BoundedSemaphore(MAX_LOOKUPS)


def connect(
    host: str, addresses: list, https: bool, deadline: float, held: list[socket.socket]
) -> socket.socket:
    """A socket connected to `host` at one of its `addresses` (resolve's; TLS-wrapped, certificate and name
    checked, for https) before `deadline`; every socket made goes into `held` at once, so the deadline's timer
    can break a connect or a handshake.

    Each address of the name is tried in turn (IPv6 ones where this host has no IPv6 too), each attempt and
    the handshake with the time left; a certificate that fails its check ends the download."""
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in addresses:
        sock = None
        try:
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            sock.settimeout(time_left(deadline))
            sock.connect(address)
            if https:
                sock = tls_context().wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
                held.append(sock)
                sock.settimeout(time_left(deadline))
                sock.do_handshake()
            return sock
        except ssl.SSLCertVerificationError:
            assert sock is not None  # (raised by the handshake: the socket exists)
            sock.close()
            raise
        except OSError as exc:
            if sock is not None:
                sock.close()
            if isinstance(exc, TimeoutError):
                raise
            error = exc
    raise error


BLOCKED_EXTRA_NETWORKS = tuple(
    ipaddress.ip_network(n) for n in ("100.64.0.0/10", "2002::/16", "64:ff9b::/96")
)
"""Refused beyond what `ipaddress` calls private: carrier-grade NAT, and IPv6 6to4 / NAT64 (they embed an
IPv4 destination)."""


def blocked_address(ip: str) -> bool:
    """Whether a media download must not connect to `ip` (unless its host is allowed by name): loopback,
    private (RFC 1918, fc00::/7), link-local (169.254.169.254, the cloud metadata service), reserved,
    multicast, unspecified, IPv6 site-local (fec0::/10), BLOCKED_EXTRA_NETWORKS; an IPv4-mapped IPv6 address
    judged as its IPv4 one."""
    addr = ipaddress.ip_address(ip.partition("%")[0])  # (an IPv6 address may carry a %scope)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return (
        addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_reserved or addr.is_multicast
        or addr.is_unspecified or getattr(addr, "is_site_local", False)
        or any(addr in net for net in BLOCKED_EXTRA_NETWORKS)
    )  # fmt: skip


def resolve(host: str, port: int, deadline: float) -> list:
    """getaddrinfo(host, port), waited for until `deadline` (getaddrinfo takes no timeout of its own, so it
    runs on a thread of its own, bounded by MAX_LOOKUPS)."""
    if not _lookups.acquire(blocking=False):
        raise OSError(f"more than {MAX_LOOKUPS} name lookups in flight")
    answer: list = []
    done = threading.Event()

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as exc:  # handed to the waiting download (gaierror, UnicodeError of a bad name...)
            answer.append(exc)
        finally:
            _lookups.release()
            done.set()

    threading.Thread(target=lookup, name="media-dns", daemon=True).start()
    if not done.wait(time_left(deadline)):
        raise TimeoutError
    if isinstance(answer[0], Exception):
        raise answer[0]
    return answer[0]


def time_left(deadline: float) -> float:
    """Seconds to `deadline`; TimeoutError when it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The system's default verifying context, built once (loading the CA store takes ~20 ms)."""
    return ssl.create_default_context()


def expire(held: list[socket.socket], expired: threading.Event) -> None:
    """The deadline: mark it, and break a blocked read (the reading thread then fails with an OSError)."""
    expired.set()
    for sock in held:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
