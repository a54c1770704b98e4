"""Which route, if any, lets this agent make this request (default deny)."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache
from urllib.parse import unquote

from .config import Route
from .contract import Code
from .fingerprint import normalized_target


@dataclass(frozen=True, slots=True)
class Refusal:
    code: Code
    message: str
    #: The route that matched target, path and agent but not the method (UNSUPPORTED_ACTION).
    route: Route | None = None


def match_route(
    routes: list[Route], agent: str, scheme: str, host: str, port: int, method: str, path: str
) -> Route | Refusal:
    """The first route that matches target, path, agent and method; otherwise why not.

    The refusal never lists routes the agent may not use, so a wrong guess reveals nothing.
    """
    path_only = path.split("?", 1)[0] or "/"
    target = normalized_target(scheme, host, port, path_only)  # an IPv6 host in brackets
    read = as_an_upstream_may_read(path_only)
    candidates = [r for r in routes if r.matches_target(scheme, host, port) and r.matches_path(path_only)]
    mine = [r for r in candidates if agent in r.agents]
    if read != path_only and mine:
        # The route's glob, read the same way (its own '%2F' or ';' parameters decoded and cut
        # like the path's), must allow the reading too.
        leniently = [r for r in mine if fnmatchcase(read, _glob_read(r.path))]
        if not leniently:
            return Refusal(
                Code.INVALID_TARGET,
                f"No route lets agent '{agent}' call {target} as an upstream may read it: percent-decoded, each "
                f"segment cut at ';' (parameters, which servlet containers drop) and the whole at a NUL (where C "
                f"servers stop), the path is {read!r}, which no route of yours allows. Nothing was sent. Send the "
                "path without the ';' parameters or the encoded NUL, or ask an operator for a route whose path "
                "allows that reading.",
            )
        mine = leniently
    if not mine:
        # The target shown is normalized, without the host's trailing dot: say it was there.
        odd = (f" The host was written {host!r}, with a trailing dot, which no route names: send it without the dot."
               if host.endswith(".") else "")
        return Refusal(
            Code.INVALID_TARGET,
            f"No route lets agent '{agent}' call {target}.{odd} Nothing was sent. "
            "Use a target your routes allow, or ask an operator to add a route.",
        )
    for route in mine:
        if method.upper() in route.methods:
            return route
    allowed = sorted({m for r in mine for m in r.methods})
    return Refusal(
        Code.UNSUPPORTED_ACTION,
        f"{method.upper()} is not allowed on {target} (allowed: {', '.join(allowed)}). Nothing was sent.",
        mine[0],
    )


#: How many times :func:`fully_decoded` decodes: enough for a path encoded twice over
#: (``%25252e``); one encoded more deeply (``%2525``) is refused before any route is looked at.
DECODING_ROUNDS = 3


def fully_decoded(text: str) -> str:
    """``text`` percent-decoded, and again while that changes it, at most :data:`DECODING_ROUNDS`
    times (``%252e`` is ``.`` to an upstream that decodes twice); each round is linear."""
    for _ in range(DECODING_ROUNDS):
        if "%" not in text:
            break
        decoded = unquote(text, errors="surrogateescape")
        if decoded == text:
            break
        text = decoded
    return text


def as_an_upstream_may_read(path: str) -> str:
    """``path`` as a lenient common upstream may read it: each segment decoded
    (:func:`fully_decoded`) and its name cut at ``;`` (servlet containers drop a segment's
    parameters), the whole path cut at a NUL (where C servers stop). A route's glob must allow
    this reading too (read the same way), or ``/files/secret.txt;.json`` would pass for
    ``/files/*.json`` and be served as ``/files/secret.txt``. The common path (no ``%``, no ``;``)
    is returned as it is."""
    if "%" not in path and ";" not in path:
        return path
    read = []
    for segment in path.split("/"):
        decoded = fully_decoded(segment)
        read.append(decoded.split(";", 1)[0].split("\0", 1)[0])
        if "\0" in decoded:
            break
    return "/".join(read)


#: IIS's own escape, ``%u002e``: one UTF-16 code unit.
_IIS_ESCAPE = re.compile("%[uU]([0-9a-fA-F]{4})")
#: An overlong UTF-8 sequence (``%c0%ae`` is ``.`` in two bytes): invalid UTF-8, which a lenient
#: decoder still reads as the character its bits spell.
_OVERLONG = re.compile(rb"[\xc0\xc1][\x80-\xbf]|\xe0[\x80-\x9f][\x80-\xbf]|\xf0[\x80-\x8f][\x80-\xbf]{2}")
#: A segment name some server reads as ``.`` or ``..``: dots only, or dots then spaces and dots,
#: which Windows drops from the end of a name (``..%20``, ``...``).
_DOTS = re.compile(r"\.+[\s.]*")


def _iis(found: re.Match[str]) -> str:
    code = int(found.group(1), 16)
    return "\ufffd" if 0xD800 <= code <= 0xDFFF else chr(code)  # half a UTF-16 pair: no character


def _overlong(found: re.Match[bytes]) -> bytes:
    raw = found.group()
    code = raw[0] & (0x1F if len(raw) == 2 else 0x0F if len(raw) == 3 else 0x07)
    for byte in raw[1:]:
        code = code << 6 | byte & 0x3F
    return chr(code).encode("utf-8", "replace")  # a surrogate it spells is no character either


def hides_a_dot_segment(segment: str) -> bool:
    """Whether some upstream reads the path segment ``segment`` as, or as holding, ``.`` or
    ``..``, which it would resolve (RFC 3986 section 5.2.4) to a path the route's glob never saw.
    The readings: percent-decoded once or again (:func:`fully_decoded`), IIS's ``%uXXXX``,
    overlong UTF-8, Unicode compatibility forms (a fullwidth ``．``, ``․`` one dot leader), a
    backslash or a decoded slash as a separator, a name read up to ``;``, a NUL, ``?`` or ``#``,
    and trailing spaces or dots dropped."""
    decoded = fully_decoded(segment)
    if "%u" in decoded or "%U" in decoded:
        decoded = _IIS_ESCAPE.sub(_iis, decoded)
    if not decoded.isascii():
        raw = decoded.encode("utf-8", "surrogateescape")
        decoded = unicodedata.normalize("NFKC", _OVERLONG.sub(_overlong, raw).decode("utf-8", "replace"))
    for part in decoded.replace("\\", "/").split("/"):
        if _DOTS.fullmatch(_NAME_ENDS.split(part, 1)[0]):
            return True
    return False


#: Where a decoded segment's name ends for some server: ';' (parameters), a NUL, and a '?' or '#'
#: that an upstream which decodes before it splits the target reads as the query or fragment
#: (``..%3f`` is ``..`` to it). Only for dot-segments: as a cut of every path, it would refuse an
#: object key holding an encoded '?'.
_NAME_ENDS = re.compile("[;\0?#]")


@lru_cache(maxsize=None)  # keyed by the routes' globs only: as many as there are routes
def _glob_read(glob: str) -> str:
    return as_an_upstream_may_read(glob)
