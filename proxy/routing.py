"""Which route, if any, lets this agent make this request (default deny)."""

from __future__ import annotations

from dataclasses import dataclass

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
    candidates = [r for r in routes if r.matches_target(scheme, host, port) and r.matches_path(path_only)]
    mine = [r for r in candidates if agent in r.agents]
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
