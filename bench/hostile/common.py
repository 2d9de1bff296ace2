"""What the hostile-tenant attacks share (`bench.hostile.attacks`,
`bench.hostile.connections`): the `Outcome` of an attack (A's answers by label, violations),
the `Attack` record and its `failures`, and the client helpers (a session, an answer's label,
a form of images, a loop of clients for a while)."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bench.hostile.world import World
from service.core.errors import HEAD_TIMEOUT_ERROR

MIB = 1 << 20


@dataclass
class Outcome:
    """What A got (`answers`: label -> count) and what went wrong beyond A's answers."""

    answers: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def add(self, label: str, n: int = 1) -> None:
        self.answers[label] += n

    def unexpected(self, allowed: frozenset[str]) -> dict[str, int]:
        """A's answers outside `allowed` (a label is allowed when it is listed, or its status
        alone is)."""
        return {k: v for k, v in self.answers.items()
                if k not in allowed and k.split(" ")[0] not in allowed}


@dataclass(frozen=True)
class Attack:
    """One attack: its name (the bench's target keys: `isolation_<name>_p50`), what it does,
    the labels A may get, `run(world, seconds) -> Outcome`, and `required`: groups of labels
    of which A must get at least one each (the defence was reached, not just never tried)."""

    name: str
    text: str
    allowed: frozenset[str]
    run: Callable[[World, float], Awaitable[Outcome]]
    required: tuple[frozenset[str], ...] = ()

    def failures(self, outcome: Outcome) -> list[str]:
        """What is wrong with A's outcome: answers outside `allowed` (any 5xx among them), a
        `required` group never seen, the attack's own violations."""
        out = [f"A got {label} x {n}" for label, n in outcome.unexpected(self.allowed).items()]
        out += [f"A never got any of {sorted(group)}" for group in self.required
                if not any(outcome.answers.get(label) for label in group)]
        return out + list(outcome.violations)


def client_of(headers: dict[str, str] | None = None, limit: int = 0):
    """An aiohttp session (the benchmark's: no connection limit, 300 s timeout) sending
    `headers` (a credential) with every request."""
    from bench.load import client_session

    return client_session(limit=limit, headers=headers)


async def label_of(resp) -> str:
    """"<status> <code>" of an answer (its JSON body's code), "<status>" without one; the
    header timeout's 408 is "408 request_timeout head" (A's own client sent no head in time),
    told from a body the server timed out ("408 request_timeout")."""
    body = await resp.read()
    try:
        answer = json.loads(body)
        code = answer.get("code")
    except (ValueError, AttributeError):
        answer, code = {}, None
    if code and answer.get("error") == HEAD_TIMEOUT_ERROR:
        return f"{resp.status} {code} head"
    return f"{resp.status} {code}" if code else str(resp.status)


def form(images: list[bytes], content_types: list[str] | None = None):
    """A multipart body of `images`, each an `image` part (JPEG unless `content_types` says)."""
    import aiohttp

    body = aiohttp.FormData()
    for i, data in enumerate(images):
        body.add_field("image", data, filename=f"{i}",
                       content_type=(content_types or ["image/jpeg"] * len(images))[i])
    return body


async def loop(duration_s: float, clients: int, one: Callable[[], Awaitable[None]]) -> None:
    """`clients` concurrent loops of `one()` until `duration_s` has passed (each finishes the
    call it has in flight)."""
    end = time.perf_counter() + duration_s

    async def client() -> None:
        while time.perf_counter() < end:
            await one()

    await asyncio.gather(*(client() for _ in range(clients)))


