"""Weighted per-tenant shares of one capacity, like the queue shares (`service.core.booking`):
what the open WebSockets (`service.core.sockets`), the in-flight bytes
(`service.core.admission`) and the concurrent gRPC calls (`service.transports.grpc.common`) of
one process are divided by.

Each holder (a socket, a request's reservation, a call) holds an amount of the capacity for a
tenant. A tenant's share is its weight's part of the capacity among the tenants holding
something and itself (a tenant alone may take it all), at least `floor`:

- a tenant that holds something and would pass its share is refused with the user's
  `over_share` error (429, Retry-After); a tenant holding nothing is never over its share;
  whether a tenant alone (its share the whole capacity) is refused so or finds the server full
  is the user's choice (`alone_over_share`);
- a tenant within its share is never refused for another's use: when the capacity is full, the
  newest pushable holders of the tenants most over their shares (counting the newcomer as
  holding) are pushed out: forgotten here and their `push` callbacks returned for the user to
  call; only when that cannot make room is the newcomer refused with `full` (503 overloaded).

Requests without a tenant (the operator's, anyone's with --auth none) count under "". No
locking here: each user serializes its calls (an event loop, or its own lock).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

Push = Callable[[], Any]


class Holding:
    """What one holder holds: an amount, and how it is pushed out (None: it cannot be)."""

    __slots__ = ("amount", "push")

    def __init__(self, amount: int, push: Push | None) -> None:
        self.amount = amount
        self.push = push


class Shares:
    """One capacity shared by tenants (see the module doc).

    Args:
        capacity: the most held at once, by every tenant together.
        weight: a tenant's weight (`Tenancy.weight`).
        over_share: `over_share(tenant, held, share) -> Exception`, the refusal of a tenant
            beyond its share.
        full: `full() -> Exception`, the refusal when no room can be made.
        floor: no share is below it (one socket, one call).
        alone_over_share: a tenant alone that would pass the capacity is refused with
            `over_share` (True) or finds the server full (False); or a function of the
            tenant saying which.
    """

    def __init__(self, capacity: int, weight: Callable[[str], float], *,
                 over_share: Callable[[str, int, int], Exception],
                 full: Callable[[], Exception], floor: int = 1,
                 alone_over_share: bool | Callable[[str], bool] = False) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = int(capacity)
        self.used = 0
        self._weight = weight
        self._over_share = over_share
        self._full = full
        self._floor = floor
        self._alone_over_share = (alone_over_share if callable(alone_over_share)
                                  else (lambda tenant: alone_over_share))
        self._held: dict[str, dict[object, Holding]] = {}  # tenant -> {holder: ...}, in order

    def held(self, tenant: str) -> int:
        """What `tenant` holds now."""
        return sum(h.amount for h in self._held.get(tenant, {}).values())

    def holders(self, tenant: str) -> int:
        """How many holders `tenant` has now."""
        return len(self._held.get(tenant, ()))

    def share(self, tenant: str, newcomer: str | None = None) -> int:
        """`tenant`'s weighted share of the capacity among the tenants holding something,
        itself and `newcomer`; at least `floor`."""
        active = set(self._held) | {tenant}
        if newcomer is not None:
            active.add(newcomer)
        total = sum(self._weight(t) for t in active)
        return max(self._floor, int(self.capacity * self._weight(tenant) / total))

    def take(self, tenant: str, holder: object, amount: int,
             push: Push | None = None) -> list[Push]:
        """Adds `amount` to what `holder` of `tenant` holds (a new holder is the newest), or
        raises (nothing taken). `push`: how the holder is pushed out (kept when None and the
        holder is known). Returns the pushes of the holders pushed out to make room: the
        caller calls them.

        Raises:
            the `over_share` error: `tenant` holds something and would pass its share.
            the `full` error: no room, and none can be made.
        """
        mine, share = self.held(tenant), self.share(tenant)
        if (mine and mine + amount > share
                and (share < self.capacity or self._alone_over_share(tenant))):
            raise self._over_share(tenant, mine, share)
        victims: list[tuple[str, object]] = []
        if self.used + amount > self.capacity:
            victims = self._victims(tenant, self.used + amount - self.capacity)
            if victims is None:
                raise self._full()
        pushes = []
        for victim_tenant, victim in victims:
            pushes.append(self._held[victim_tenant][victim].push)
            self.release(victim_tenant, victim)
        holding = self._held.setdefault(tenant, {}).get(holder)
        if holding is None:
            holding = self._held[tenant][holder] = Holding(0, push)
        elif push is not None:
            holding.push = push
        holding.amount += amount
        self.used += amount
        return pushes

    def pushable(self, tenant: str, holder: object, push: Push | None) -> None:
        """Sets how `holder` is pushed out from now on (None: it cannot be)."""
        holding = self._held.get(tenant, {}).get(holder)
        if holding is not None:
            holding.push = push

    def release(self, tenant: str, holder: object, amount: int | None = None) -> int:
        """Gives back `amount` of what `holder` holds (None: all of it; nothing when it holds
        nothing, e.g. it was pushed out); returns what was given back."""
        holders = self._held.get(tenant)
        holding = holders.get(holder) if holders is not None else None
        if holding is None:
            return 0
        given = holding.amount if amount is None else min(amount, holding.amount)
        holding.amount -= given
        self.used -= given
        if amount is None or holding.amount <= 0:
            del holders[holder]
            if not holders:
                del self._held[tenant]
        return given

    def _victims(self, newcomer: str, need: int) -> list[tuple[str, object]] | None:
        """The holders to push out for `need` more room: the newest pushable holders of the
        tenant most over its share (counting `newcomer` as holding), one by one; None when
        they cannot make that room (nothing is pushed then)."""
        excess = {t: sum(h.amount for h in holders.values()) - self.share(t, newcomer)
                  for t, holders in self._held.items() if t != newcomer}
        candidates = {t: [k for k, h in self._held[t].items() if h.push is not None]
                      for t in excess}
        victims: list[tuple[str, object]] = []
        while need > 0:
            over = [(excess[t], t) for t in excess if excess[t] > 0 and candidates[t]]
            if not over:
                return None
            _, tenant = max(over)
            holder = candidates[tenant].pop()  # the newest
            amount = self._held[tenant][holder].amount
            excess[tenant] -= amount
            need -= amount
            victims.append((tenant, holder))
        return victims
