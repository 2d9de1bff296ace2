"""`RefusalPacer`: a tenant's rate refusals answered after min(Retry-After, its bound), at most
so many held per tenant, never a request without a tenant (a fake sleep: no timing)."""
from __future__ import annotations

import asyncio

from service.core.admission import RefusalPacer


class Sleeps:
    """A sleep that records its seconds and waits until released."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.release = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)
        await self.release.wait()


async def test_a_refusal_waits_its_retry_after_up_to_the_bound():
    sleeps = Sleeps()
    sleeps.release.set()
    pacer = RefusalPacer(max_s=1.0, sleep=sleeps)
    await pacer.pace("acme", 0.25)
    await pacer.pace("acme", 30.0)
    assert sleeps.seconds == [0.25, 1.0] and pacer.held == {}


async def test_at_most_so_many_of_a_tenants_refusals_are_held_and_none_without_a_tenant():
    sleeps = Sleeps()
    pacer = RefusalPacer(max_held=2, sleep=sleeps)
    held = [asyncio.ensure_future(pacer.pace("acme", 5.0)) for _ in range(2)]
    other = asyncio.ensure_future(pacer.pace("globex", 5.0))
    await asyncio.sleep(0)
    assert pacer.held == {"acme": 2, "globex": 1}
    await asyncio.wait_for(pacer.pace("acme", 5.0), 1)  # the third: answered at once
    await asyncio.wait_for(pacer.pace("", 5.0), 1)  # no tenant: never held
    assert len(sleeps.seconds) == 3
    sleeps.release.set()
    await asyncio.gather(*held, other)
    assert pacer.held == {}


async def test_a_tenant_with_many_refusals_held_has_its_next_ones_held_the_bound():
    """A flood: beyond `flood_held` refusals held at once, a tenant's next refusal waits
    `flood_s`, not its own Retry-After; another tenant's refusals are held as before."""
    sleeps = Sleeps()
    pacer = RefusalPacer(max_s=1.0, flood_held=2, flood_s=2.0, sleep=sleeps)
    held = [asyncio.ensure_future(pacer.pace("acme", 0.25)) for _ in range(3)]
    other = asyncio.ensure_future(pacer.pace("globex", 0.25))
    await asyncio.sleep(0)
    assert sleeps.seconds == [0.25, 0.25, 2.0, 0.25]
    sleeps.release.set()
    await asyncio.gather(*held, other)
    await pacer.pace("acme", 0.25)  # none held any more: its own again
    assert sleeps.seconds[-1] == 0.25 and pacer.held == {}


def test_what_a_refusal_is_held_follows_its_status():
    from service.core.admission import PACE_MAX_S, PACE_SENT_S, refusal_pace_s

    assert refusal_pace_s(429, 0.25) == 0.25 and refusal_pace_s(429, 60.0) == PACE_MAX_S
    assert refusal_pace_s(429, None) == PACE_SENT_S
    assert [refusal_pace_s(s, None) for s in (400, 404, 409, 413)] == [PACE_SENT_S] * 4
    assert [refusal_pace_s(s, 5.0) for s in (200, 401, 403, 405, 408, 500, 503)] == [0.0] * 7
