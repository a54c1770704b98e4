"""Which route, if any, lets this agent make this request (default deny)."""

from __future__ import annotations

import re
from dataclasses import dataclass
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
    if read != path_only and mine and not any(r.matches_path(read) for r in mine):
        return Refusal(
            Code.INVALID_TARGET,
            f"No route lets agent '{agent}' call {target} as an upstream may read it: decoded, and with each "
            f"segment cut at ';' (parameters, which servlet containers drop), NUL, '?' or '#', the path is "
            f"{read!r}, which no route of yours allows. Nothing was sent. Send the path without ';' parameters and "
            "without encoded NUL, '?', '#' or ';', or ask an operator for a route whose path allows them.",
        )
    mine = [r for r in mine if read == path_only or r.matches_path(read)]
    if not mine:
        return Refusal(
            Code.INVALID_TARGET,
            f"No route lets agent '{agent}' call {target}. Nothing was sent. "
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


#: Where a lenient upstream stops reading a path (a NUL, and once decoded the query or the
#: fragment), and where it stops reading a segment's name (its parameters, ``;``).
_PATH_END = re.compile("[\0?#]")
_SEGMENT_END = re.compile("[;\0?#]")


def fully_decoded(text: str) -> str:
    """``text`` percent-decoded, and again while that changes it (``%252e`` is ``.`` to an
    upstream that decodes twice). Each round shortens it, so this ends."""
    while "%" in text:
        decoded = unquote(text, errors="surrogateescape")
        if decoded == text:
            break
        text = decoded
    return text


def as_an_upstream_may_read(path: str) -> str:
    """``path`` as the most lenient common upstream may read it: each segment decoded
    (:func:`fully_decoded`) and its name cut at ``;`` (servlet containers drop parameters), the
    whole path cut at a NUL (where C servers stop) or a decoded ``?`` or ``#``. A route's glob must
    allow this reading too, or ``/files/secret.txt;.json`` would pass for ``/files/*.json`` and be
    served as ``/files/secret.txt``. The common path (no ``%``, no ``;``) is returned as it is."""
    if "%" not in path and ";" not in path:
        return path
    read = []
    for segment in path.split("/"):
        decoded = fully_decoded(segment)
        read.append(_SEGMENT_END.split(decoded, maxsplit=1)[0])
        if _PATH_END.search(decoded):
            break
    return "/".join(read)
