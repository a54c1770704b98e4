"""HTTP content codings (RFC 9110 8.4), decoded with a bound so a small body cannot expand without
limit. Used to look inside a compressed response for an echo of the injected credential.

Decoding uses zlib and the zstandard package mitmproxy already depends on; encoding uses
mitmproxy's own ``net.encoding``. ``br`` is not decoded: brotli 1.1 (what mitmproxy 11 allows)
cannot bound one step's output, so a few kilobytes could take gigabytes. Nothing here is
cryptography.
"""

from __future__ import annotations

import io
import zlib

import zstandard
from mitmproxy.net import encoding as mitm_encoding

#: The codings the broker can look inside ("x-gzip" is gzip, RFC 9110 8.4.1.3).
KNOWN = frozenset({"gzip", "x-gzip", "deflate", "zstd"})
#: At most this many gzip members (each is a few bytes at least; many tiny ones cost time).
MAX_MEMBERS = 1024
#: At most this many codings stacked on one body: each is decoded, and encoded again after a
#: redaction, in turn; real servers apply one (two when a proxy compresses again).
MAX_CODINGS = 4
#: Codings a message may name: the ones this module knows of (any other name is the upstream's text).
NAMED_CODINGS = KNOWN | {"br", "chunked", "identity", "compress", "x-compress"}
_STEP = 64 * 1024


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
    if len(codings) > MAX_CODINGS:
        raise Undecodable(f"{len(codings)} codings stacked, more than the {MAX_CODINGS} the broker undoes")
    for coding in reversed(codings):
        if coding == "br":
            raise Undecodable("br cannot be decoded within a memory bound here")
        if coding not in KNOWN:
            raise Undecodable("a coding the broker does not know")  # its name is the upstream's text: never quoted
        try:
            body = _DECODERS[coding](body, limit)
        except Undecodable:
            raise
        except (zlib.error, zstandard.ZstdError, EOFError):  # a corrupt stream
            # The library's own wording ("Error -3 while decompressing data: ...") tells the agent
            # and the operator nothing more, and the reason is the broker's words only.
            raise Undecodable(f"{coding}: the compressed data is corrupt") from None
    return body


def decode_transfer(body: bytes, codings: list[str], limit: int) -> bytes:
    """Undo transfer ``codings`` (last applied first): :func:`decode`'s codings, and ``chunked``
    where it is not the last one (RFC 9112 6.1: a response may apply another coding after it and
    end at the close; the parser only undoes a final ``chunked``). Raises :class:`Undecodable`."""
    if len(codings) > MAX_CODINGS:
        raise Undecodable(f"{len(codings)} codings stacked, more than the {MAX_CODINGS} the broker undoes")
    for coding in reversed(codings):
        body = _dechunk(body, limit) if coding == "chunked" else decode(body, [coding], limit)
    return body


def _dechunk(body: bytes, limit: int) -> bytes:
    """The data of a chunked body: every chunk, the last chunk and the trailer section, nothing after."""
    out = bytearray()
    pos = 0
    while True:
        end = body.find(b"\r\n", pos)
        if end < 0:
            raise Undecodable("chunked: the body ends inside a chunk size line")
        size_text = body[pos:end].split(b";", 1)[0]
        if not size_text or len(size_text) > 16 or size_text.strip(b"0123456789abcdefABCDEF"):
            raise Undecodable("chunked: a chunk size that is not a hexadecimal number")
        size = int(size_text, 16)
        pos = end + 2
        if size == 0:
            break
        if pos + size + 2 > len(body) or body[pos + size:pos + size + 2] != b"\r\n":
            raise Undecodable("chunked: a chunk is cut short or not followed by CRLF")
        out += body[pos:pos + size]
        if len(out) > limit:
            raise _over(limit)
        pos += size + 2
    while True:  # the trailer section, up to its blank line
        end = body.find(b"\r\n", pos)
        if end < 0:
            raise Undecodable("chunked: the trailer section does not end")
        line, pos = body[pos:end], end + 2
        if not line:
            break
    if pos != len(body):
        raise Undecodable("chunked: data after the last chunk")
    return bytes(out)


def encode(body: bytes, codings: list[str]) -> bytes:
    """Apply ``codings`` in order (each must be one of :data:`KNOWN`)."""
    for coding in codings:
        body = mitm_encoding.encode(body, "gzip" if coding == "x-gzip" else coding)
    return body


def _over(limit: int) -> Undecodable:
    return Undecodable(f"more than {limit} bytes once decoded")


def _zlib(body: bytes, limit: int, wbits: int) -> bytes:
    """Input in steps of 64 KiB, output bounded per call: neither a bomb nor many tiny gzip
    members (each would copy the rest of the input) can take much memory or time."""
    out = bytearray()
    view = memoryview(body)
    pos, members = 0, 0
    while pos < len(view):
        members += 1
        if members > MAX_MEMBERS:
            raise Undecodable(f"more than {MAX_MEMBERS} gzip members")
        if members > 1 and wbits != 16 + zlib.MAX_WBITS:
            raise Undecodable("data after the end of the compressed stream")
        d = zlib.decompressobj(wbits)
        while not d.eof:
            if pos >= len(view):
                raise Undecodable("the compressed stream ends early")
            step = view[pos:pos + _STEP]
            pos += len(step)
            data: bytes | memoryview = step
            while data and not d.eof:
                out += d.decompress(data, limit + 1 - len(out))
                if len(out) > limit:
                    raise _over(limit)
                data = d.unconsumed_tail
        pos -= len(d.unused_data)  # the next member starts where this one ended
    return bytes(out)


def _gzip(body: bytes, limit: int) -> bytes:
    return _zlib(body, limit, 16 + zlib.MAX_WBITS)


def _deflate(body: bytes, limit: int) -> bytes:
    # "deflate" is the zlib format, but some servers send raw deflate; accept both.
    try:
        return _zlib(body, limit, zlib.MAX_WBITS)
    except zlib.error:
        return _zlib(body, limit, -zlib.MAX_WBITS)


def _zstd(body: bytes, limit: int) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True)
    out = bytearray()
    while chunk := reader.read(min(65536, limit + 1 - len(out)) or 1):
        out += chunk
        if len(out) > limit:
            raise _over(limit)
    return bytes(out)


_DECODERS = {"gzip": _gzip, "x-gzip": _gzip, "deflate": _deflate, "zstd": _zstd}
