"""HTTP content codings (RFC 9110 8.4), decoded with a bound so a small body cannot expand without
limit. Used to look inside a compressed response for an echo of the injected credential.

Decoding uses zlib and the brotli and zstandard packages mitmproxy already depends on; encoding
uses mitmproxy's own ``net.encoding``. Nothing here is cryptography.
"""

from __future__ import annotations

import io
import zlib

import brotli
import zstandard
from mitmproxy.net import encoding as mitm_encoding

#: The codings the broker can look inside ("x-gzip" is gzip, RFC 9110 8.4.1.3).
KNOWN = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd"})


class Undecodable(Exception):
    """The body cannot be decoded within the bound: an unknown coding, a corrupt stream, or more
    than ``limit`` bytes once decoded."""


def codings_of(content_encoding: str | None) -> list[str]:
    """The codings applied, in the order they were applied (``identity`` is no coding)."""
    if not content_encoding:
        return []
    return [c for c in (part.strip().lower() for part in content_encoding.split(",")) if c and c != "identity"]


def decode(body: bytes, codings: list[str], limit: int) -> bytes:
    """Undo ``codings`` (last applied first); raises :class:`Undecodable`."""
    for coding in reversed(codings):
        if coding not in KNOWN:
            raise Undecodable(f"unknown content coding {coding!r}")
        try:
            body = _DECODERS[coding](body, limit)
        except Undecodable:
            raise
        except Exception as exc:  # zlib.error, brotli.error, zstandard.ZstdError: a corrupt stream
            raise Undecodable(f"{coding}: {exc}") from None
    return body


def encode(body: bytes, codings: list[str]) -> bytes:
    """Apply ``codings`` in order (each must be one of :data:`KNOWN`)."""
    for coding in codings:
        body = mitm_encoding.encode(body, "gzip" if coding == "x-gzip" else coding)
    return body


def _over(limit: int) -> Undecodable:
    return Undecodable(f"more than {limit} bytes once decoded")


def _zlib(body: bytes, limit: int, wbits: int) -> bytes:
    out = bytearray()
    data = body
    while data:  # gzip allows several members one after another
        d = zlib.decompressobj(wbits)
        while data:
            out += d.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise _over(limit)
            data = d.unconsumed_tail
            if d.eof:
                break
        if not d.eof:
            raise Undecodable("the compressed stream ends early")
        data = d.unused_data
        if wbits != 16 + zlib.MAX_WBITS:  # only gzip has members; anything after a zlib stream is ignored
            break
    return bytes(out)


def _gzip(body: bytes, limit: int) -> bytes:
    return _zlib(body, limit, 16 + zlib.MAX_WBITS)


def _deflate(body: bytes, limit: int) -> bytes:
    # "deflate" is the zlib format, but some servers send raw deflate; accept both.
    try:
        return _zlib(body, limit, zlib.MAX_WBITS)
    except zlib.error:
        return _zlib(body, limit, -zlib.MAX_WBITS)


def _br(body: bytes, limit: int) -> bytes:
    d = brotli.Decompressor()
    out = bytearray()
    for start in range(0, len(body), 1024):  # small steps: one step's output stays bounded
        out += d.process(body[start:start + 1024])
        if len(out) > limit:
            raise _over(limit)
    if not d.is_finished():
        raise Undecodable("the compressed stream ends early")
    return bytes(out)


def _zstd(body: bytes, limit: int) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True)
    out = bytearray()
    while chunk := reader.read(min(65536, limit + 1 - len(out)) or 1):
        out += chunk
        if len(out) > limit:
            raise _over(limit)
    return bytes(out)


_DECODERS = {"gzip": _gzip, "x-gzip": _gzip, "deflate": _deflate, "br": _br, "zstd": _zstd}
