"""The batcher's queue: rows in arrival order, counted per tenant, taken in fair or FIFO order.

No asyncio and no clock here: the `Batcher` decides WHEN a batch runs and how long rows wait;
this decides WHICH rows a batch takes, and how much of the queue a tenant may hold. Kept apart
so that its properties are tested on their own, on random traces (tests/service/core/test_fair.py).

Fair order is the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
Models" (OSDI 2024), for a shared batch of images:

- each tenant has a counter: the trunk images it was served, divided by its weight;
- a batch is filled one row at a time from the backlogged tenant (one with queued rows) of
  the smallest counter (ties: the one served least recently, then the older row), its oldest
  row first (FIFO within a tenant),
  and that tenant's counter grows by the row's cost / weight (a row whose features came from
  the cache costs 0);
- a tenant that becomes backlogged again is lifted to the smallest counter among the
  backlogged tenants (to the counter of the last tenant that left, when none is), so credit
  cannot be banked while idle.

The batch still takes whatever waits, up to its size (work-conserving), mixing bots and tenants.
Consequences, tested on random traces: two tenants backlogged over an interval receive
weighted trunk images (images / weight) within 2 x the batch size of each other; and, while the
weights of the tenants differ by at most the batch size (max weight / min weight <=
max_batch_size), a tenant with queued rows gets a row into one of the next (number of tenants)
batches. Wider weight ratios keep the first bound; a tenant weighted below 1/max_batch_size of
another then gets less than one row per batch by its own weight, and waits longer.

FIFO order is the arrival order (what the batcher did before tenants, kept for comparison).

Queue shares: a tenant's queued rows are at most its weighted share of the queue among the
tenants with queued (or booked) rows, never below one batch (`share`), and at most its own
`max_queued`. A tenant within its share is never refused for another's flood: when the queue is
full, the newest requests of the tenants most over their shares are pushed out (`victims`).
"""
from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

SCHEDULERS = ("fair", "fifo")


class Queued(Protocol):
    """What the queue needs of an entry."""

    tenant: str
    group: str
    cost: float
    enqueued_s: float


def safe_weight(weight: Callable[[str], float], tenant: str) -> float:
    """`weight(tenant)` if it is a finite positive number, else 1.0."""
    try:
        w = float(weight(tenant))
    except Exception:  # noqa: BLE001 - a broken lookup must not stop batching
        return 1.0
    return w if math.isfinite(w) and w > 0 else 1.0


class TenantQueue:
    """The rows waiting for a batch.

    Args:
        scheduler: "fair" (VTC order, queue shares) or "fifo" (arrival order, no shares).
        weight: `weight(tenant) -> float`, read when rows are taken and shares computed (so a
            change applies at once); an invalid answer counts as 1.
    """

    def __init__(self, scheduler: str = "fair", *,
                 weight: Callable[[str], float] = lambda tenant: 1.0) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, "
                             f"got {scheduler!r}")
        self.scheduler = scheduler
        self.fair = scheduler == "fair"
        self._weight = weight
        self.entries: collections.deque = collections.deque()  # arrival order
        self.rows: collections.Counter[str] = collections.Counter()  # queued rows per tenant
        self.groups: collections.Counter[str] = collections.Counter()  # queued rows per group
        self.counters: dict[str, float] = {}  # VTC: weighted trunk images served
        self._picked: dict[str, int] = {}  # when each tenant was last picked (tie-break)
        self._picks = 0
        self._last_left = 0.0  # the counter of the last tenant whose queue emptied

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def oldest(self):
        return self.entries[0]

    def weight(self, tenant: str) -> float:
        return safe_weight(self._weight, tenant)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    # -- in and out --------------------------------------------------------------------------

    def push(self, entries: Iterable[Queued]) -> None:
        """Queues `entries` (at the end), lifting a tenant that was not backlogged."""
        for e in entries:
            if self.fair and not self.rows.get(e.tenant):
                self.counters[e.tenant] = max(self.counters.get(e.tenant, 0.0), self._floor())
            self.entries.append(e)
            self.rows[e.tenant] += 1
            self.groups[e.group] += 1

    def _floor(self) -> float:
        """What a tenant back from idle is lifted to: the smallest counter of the backlogged
        tenants (that of the last tenant that left, when none is)."""
        return min((self.counters.get(t, 0.0) for t in self.rows), default=self._last_left)

    def _left(self, e: Queued) -> None:
        """Bookkeeping of an entry that has just left the queue."""
        for counts, key in ((self.rows, e.tenant), (self.groups, e.group)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]
                if counts is self.rows:
                    self._last_left = self.counters.get(key, 0.0)

    def remove(self, e: Queued) -> None:
        """Removes a queued entry (its caller went away)."""
        self.entries.remove(e)
        self._left(e)

    def remove_many(self, gone: Iterable[Queued]) -> None:
        ids = {id(e) for e in gone}
        if not ids:
            return
        kept = collections.deque()
        for e in self.entries:
            if id(e) in ids:
                self._left(e)
            else:
                kept.append(e)
        self.entries = kept

    def pop_all(self) -> list:
        """Every entry, in arrival order, leaving the queue empty."""
        out = list(self.entries)
        self.entries.clear()
        self.rows.clear()
        self.groups.clear()
        return out

    def take(self, n: int, live: Callable[[Queued], bool], group: str | None = None, *,
             pick: Callable[[list], Iterable[int]] | None = None) -> list:
        """Removes up to `n` live entries for a batch (only `group`'s if given; FIFO then).
        `pick(order)` (fair order only): given the entries the batch would take, in order, the
        positions of those it takes (at least the first one when none: the others stay at
        the head of the order, for the next batch; who is served stays the fair order's).

        Entries for which `live(e)` is False (cancelled, past their deadline) leave the queue
        too, without counting toward `n` and without charging their tenant.
        """
        if not self.fair or group is not None:
            return self._take_in_order(n, live, group)
        if pick is not None:  # the order on copies of the counters: nothing charged
            order, _ = self._fair_order(n, lambda e: True, dict(self.counters),
                                        dict(self._picked))
            chosen = sorted({i for i in pick(order) if 0 <= i < len(order)}) or [0]
            return self._take_chosen([order[i] for i in chosen] if order else [], live)
        batch, gone = self._fair_order(n, live, self.counters, self._picked)
        self.remove_many(gone)
        self._prune()
        return batch

    def _take_chosen(self, chosen: list, live: Callable[[Queued], bool]) -> list:
        """Removes `chosen` (queued entries), charging the live ones' tenants in that order."""
        batch = [e for e in chosen if live(e)]
        for e in batch:
            self.counters[e.tenant] = self.counters.get(e.tenant, 0.0) + e.cost / self.weight(
                e.tenant)
            self._picks += 1
            self._picked[e.tenant] = self._picks
        self.remove_many(chosen)
        self._prune()
        return batch

    def _fair_order(self, n: int, live: Callable[[Queued], bool], counters: dict[str, float],
                    picked: dict[str, int]) -> tuple[list, list]:
        """(up to `n` live entries in fair order, every entry visited), charging `counters`
        and `picked` as it goes (the queue's own, or copies for a look ahead)."""
        by_tenant: dict[str, list] = {}
        for e in self.entries:
            by_tenant.setdefault(e.tenant, []).append(e)
        position = dict.fromkeys(by_tenant, 0)
        batch: list = []
        gone: list = []
        while len(batch) < n and position:
            tenant = min(position, key=lambda t: (counters.get(t, 0.0), picked.get(t, -1),
                                                  by_tenant[t][position[t]].enqueued_s))
            e = by_tenant[tenant][position[tenant]]
            position[tenant] += 1
            gone.append(e)
            if live(e):
                batch.append(e)
                counters[tenant] = counters.get(tenant, 0.0) + e.cost / self.weight(tenant)
                self._picks += 1
                picked[tenant] = self._picks
            if position[tenant] == len(by_tenant[tenant]):
                del position[tenant]
        return batch, gone

    def ahead(self, tenant: str, rows: int, waiting: Mapping[str, int]) -> int:
        """How many rows the order takes before the last of `rows` new rows of `tenant` (each
        costing 1), were they queued now, of the rows `waiting` (by tenant: those that may go
        first, queued or being decoded): under fifo all of them; in fair order the tenant's
        own and each other tenant's whose counter, row by row, stays below the tenant's at
        that row (ties aside); and the new ones before it."""
        others = {t: n for t, n in waiting.items() if n > 0 and t != tenant}
        own = waiting.get(tenant, 0) + rows - 1
        if not self.fair:
            return own + sum(others.values())
        floor = self._floor()

        def counter(t: str) -> float:  # lifted as `push` would, if not queued yet
            c = self.counters.get(t, 0.0)
            return c if self.rows.get(t) else max(c, floor)

        at = counter(tenant) + own / self.weight(tenant)
        return own + sum(min(n, max(0, math.ceil((at - counter(t)) * self.weight(t))))
                         for t, n in others.items())

    def _take_in_order(self, n: int, live: Callable[[Queued], bool], group: str | None) -> list:
        batch: list = []
        kept: list = []
        queue = self.entries
        while queue and len(batch) < n:
            e = queue.popleft()
            if group is not None and e.group != group:
                kept.append(e)
                continue
            self._left(e)
            if live(e):
                batch.append(e)
                if self.fair:
                    self.counters[e.tenant] = (self.counters.get(e.tenant, 0.0)
                                               + e.cost / self.weight(e.tenant))
        queue.extendleft(reversed(kept))  # other groups' rows keep their place and order
        return batch

    def _prune(self) -> None:
        """Forgets the counters of idle tenants that a return would lift anyway (bounded
        memory however many tenants come and go)."""
        if len(self.counters) <= 4 * len(self.rows) + 64:
            return
        floor = min((self.counters.get(t, 0.0) for t in self.rows), default=self._last_left)
        for tenant in [t for t, c in self.counters.items() if t not in self.rows and c <= floor]:
            del self.counters[tenant]
            self._picked.pop(tenant, None)

    # -- shares --------------------------------------------------------------------------------

    def share(self, tenant: str, capacity: int, floor: int,
              booked: Mapping[str, int] = {}) -> int:  # noqa: B006 - read only
        """`tenant`'s weighted share of `capacity` rows among the tenants with queued or
        booked rows and itself, at least `floor` (one batch)."""
        active = set(self.rows) | {t for t, n in booked.items() if n} | {tenant}
        total = sum(self.weight(t) for t in active)
        return max(floor, int(capacity * self.weight(tenant) / total))

    def victims(self, tenant: str, capacity: int, floor: int,
                booked: Mapping[str, int] = {}) -> list[str]:  # noqa: B006 - read only
        """The other tenants over their share (counting `tenant` as active), most over first."""
        over = []
        for t in {**self.rows, **booked}:  # queued or booked (decoding)
            if t == tenant:
                continue
            excess = self.rows.get(t, 0) + booked.get(t, 0) - self.share(t, capacity, floor, {
                **booked, tenant: booked.get(tenant, 0) + 1})
            if excess > 0:
                over.append((-excess, t))
        return [t for _, t in sorted(over)]

    def newest_of(self, tenant: str) -> Queued | None:
        """The most recently queued entry of `tenant`."""
        for e in reversed(self.entries):
            if e.tenant == tenant:
                return e
        return None
