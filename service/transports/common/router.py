"""Routing for a transport without a router of its own (Ray's ingress).

`Router` reads the route templates of `service.codecs.routes.ENDPOINTS` the way aiohttp's router
does (the aiohttp transport keeps that one: see `service.transports.http.app.create_app`), so
both transports route every request alike: `{name}` matches one path segment, `{name:regex}` matches
`regex`, the first endpoint in table order wins, and a method a path does not have is 405 with
`Allow` (HEAD included: aiohttp adds no HEAD to an `add_route("GET", ...)` route either).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.codecs.base import Endpoint


def template_regex(template: str) -> re.Pattern[str]:
    """The regex of a route template (`{bot_id:[^{}/:]+}` included: braces inside a
    parameter's regex nest)."""
    out, i = [], 0
    while i < len(template):
        char = template[i]
        if char != "{":
            out.append(re.escape(char))
            i += 1
            continue
        depth, j = 1, i + 1
        while depth:
            if j == len(template):
                raise ValueError(f"unbalanced '{{' in route template {template!r}")
            depth += {"{": 1, "}": -1}.get(template[j], 0)
            j += 1
        name, _, pattern = template[i + 1:j - 1].partition(":")
        out.append(f"(?P<{name}>{pattern or '[^{}/]+'})")
        i = j
    return re.compile("".join(out))


def route_template(template: str) -> str:
    """A route template as traces name it (OpenTelemetry's `http.route`, aiohttp's
    `canonical`): each parameter without its regex (`/v2/models/{bot_id}/infer`)."""
    out, i = [], 0
    while i < len(template):
        if template[i] != "{":
            out.append(template[i])
            i += 1
            continue
        depth, j = 1, i + 1
        while depth and j < len(template):
            depth += {"{": 1, "}": -1}.get(template[j], 0)
            j += 1
        out.append("{" + template[i + 1:j - 1].partition(":")[0] + "}")
        i = j
    return "".join(out)


@dataclass(frozen=True)
class Match:
    """The outcome of routing one request: the endpoint and its path parameters or, when none
    matched, the methods the path has (none: 404; some: 405 with `Allow`)."""

    endpoint: Endpoint | None
    params: dict[str, str] = field(default_factory=dict)
    allowed: tuple[str, ...] = ()


class Router:
    """Method + path -> endpoint."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self._routes = [(template_regex(e.path), e) for e in endpoints]

    def match(self, method: str, path: str) -> Match:
        allowed: list[str] = []
        for regex, endpoint in self._routes:
            hit = regex.fullmatch(path)
            if hit is None:
                continue
            if endpoint.method == method:
                return Match(endpoint, hit.groupdict())
            if endpoint.method not in allowed:
                allowed.append(endpoint.method)
        return Match(None, {}, tuple(allowed))
