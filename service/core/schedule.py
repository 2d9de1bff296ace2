"""What the batcher does with deadlines (issue 32, items 3 and 4), at the trunk's times as it
runs in this server (`LiveProfile.upper`: what live batches rarely exceed, so a row let through
is answered in time, not just run in time). A request's deadline itself, on every protocol:
`service.core.deadlines`.

- Admission (`Schedule.expected_at`, read by `service.core.engine` before any decoding): when
  the request's rows would be answered, given the batch running, the rows the scheduler takes
  before them (their tenant's queued and being decoded, and other tenants' queued, in fair
  order: `TenantQueue.ahead`, whatever their deadlines: a batch runs them with the new rows
  whenever it still ends in time) in batches of the next one's size, or, when longer, the
  time its rows take to be decoded (its tenant's pace of decoding, learnt, x the rows
  decoded before them: `backlog`) and a batch of one (`Estimate.due`); and when they
  would be with nothing queued ahead of them (the rest of the batch running, then their own
  decoding and batches: `Estimate.alone`, which is all but certain). The wait between the
  two is what queued rows cost, and what the estimate can miss (rows the order puts first
  that arrive later, a batch that starts before its rows are decoded). How far off it was is
  learnt from the rows answered since (`slack`: the SLACK_QUANTILE of the ratio actual wait
  / expected wait of its tenant's last rows whose deadline the wait decided, those of the
  last SLACK_AGE_S), and the request is refused at once when its time alone plus its
  expected wait times that ratio passes its deadline: 504
  `deadline_unmeetable` (gRPC DEADLINE_EXCEEDED), nothing decoded or run (`Estimate.need_s`).
  The slack multiplies that wait only, and ages out, so it can never refuse every request of
  a tenant for good: a request that nothing is queued ahead of is admitted whenever its time
  alone meets its deadline, and is learnt from. What is learnt is each tenant's own (of the
  LEARNT_TENANTS that learnt last): a tenant whose rows come late (costly images, say) makes
  only its own requests refused sooner.
- Drops (`drop_doomed`, before each batch): a row that could no longer be answered in time
  even in a batch of its own is failed before the trunk (504 `deadline_exceeded`); a row with
  that much time left is never dropped. Without a batch profile, a row is dropped once its
  deadline passed. A row whose deadline passes between its batch's take and its trunk's start
  is dropped by the engine as the trunk starts (`ran`'s `run`: not counted late).
- The last check before work: an image of an admitted request whose decode starts (after
  waiting for a batch running, `service.core.cores`, or for the decode pool) when its row
  could no longer be answered in time even in the batch right after the one running (the
  running batch's rest, then a batch of one: `too_late_to_start`) would be dropped by a
  later batch; it is refused then instead, before it is decoded (504 `deadline_unmeetable`:
  no work done, its tokens given back; `service.core.engine`), and learnt as a drop is
  (`refused_at_start`).
- A batch's rows (`batch_pick`): the batch holds what the scheduler's order gives it when all
  of it ends before the earliest deadline among them; else the most urgent of those rows, as
  many as end before it, and the others head the next batch. The order still decides who is
  served (its bounds hold: tests/service/core/test_sharing.py); deadlines decide only which of
  a batch's rows go first.
- A batch waits for more rows (max_wait_ms, or the rows being decoded) only while the
  earliest deadline among its rows allows (`start_in`).
- "Ends" means the batch's answers are delivered: its trunk at `seconds` (the live upper
  time) and the work around the trunk (the hand-off to the batch thread, a running decode,
  the heads, the event loop's resumption) at `around_s`, learnt from the batches run (mean
  + 3 mean deviations, ANSWER_S at least), in admission, drops, picks and waits alike.
- Rows the trunk ran whose batch ended after their deadline are counted per tenant
  (`on_late`: `multihead_tenant_rows_late_total`): the trunk's work for answers too late.
"""
from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from service.core.errors import DeadlineExceeded
from service.core.rows import fail

# The time a row's answer takes after its batch has ended (the transport), and the least the
# work around a batch's trunk is allowed (`Schedule.around_s`).
ANSWER_S = 0.005
# The work around the trunk in a batch (its hand-off to the batch thread, waiting for a running
# decode, stacking the images, the heads, delivering the answers, the event loop's resumption):
# an EWMA of each batch's (weight AROUND_ALPHA for the newest) and of its mean absolute
# deviation; a batch is run for a row only if it ends, its trunk at its upper time and this
# work at its mean + AROUND_DEVIATIONS deviations, before the row's deadline.
AROUND_ALPHA, AROUND_DEVIATIONS = 0.2, 3.0
# A batch that waits for more rows starts this long before the last moment its deadlines allow.
START_LEAD_S = 0.002
# The newest request's weight in the running mean of the time from admission to queue.
PATH_ALPHA = 0.2
# Admission's slack (`Schedule.slack`): the SLACK_QUANTILE of the last SLACK_KEPT rows' actual
# wait over their expected wait (each at least a batch of one), once SLACK_MIN were, of the
# rows learnt in the last SLACK_AGE_S; only rows whose deadline left them a wait within
# SLACK_TIGHT x their expected wait count (for a row with more time, a late estimate decided
# nothing, and `batch_pick` lets it wait).
# The quantile is their largest but for a tenant learning more than 1,000 rows in SLACK_AGE_S:
# at the 99th percentile admission let 1 % of the rows it decided on come late by design,
# which is all the bench's 99 % target allows (issue 32's trace: within / admitted
# 0.988-0.997 in nine runs, two below 0.99; 0.993 and 0.998 in two with the largest, at
# about 1 % of the goodput).
SLACK_QUANTILE, SLACK_KEPT, SLACK_MIN, SLACK_TIGHT = 0.999, 256, 16, 8.0
SLACK_AGE_S = 10.0
# The error of a row whose deadline passed before its trunk ran (dropped unrun: here, or by
# the engine as the trunk starts).
PASSED_WAITING = "the request's deadline passed while it waited for the trunk"
# The tenants whose pace and slack are kept (the least recently learnt is forgotten).
LEARNT_TENANTS = 64


def batch_pick(deadlines: Sequence[float | None], now: float,
               seconds: Callable[[int], float]) -> list[int]:
    """Which rows of a batch to run now, given their deadlines in the scheduler's order (None:
    none) and the time a batch of n takes (`seconds(n)`): all of them when, run now, they end
    before the earliest deadline among them; else the k most urgent (earliest deadline first,
    then the order's), k the most that end before it (at least 1: `Schedule.drop_doomed`
    drops a row that cannot make it even alone). Rows with more time run in the next batch."""
    n = len(deadlines)
    urgent = sorted(range(n), key=lambda i: (deadlines[i] is None, deadlines[i] or 0.0, i))
    earliest = deadlines[urgent[0]] if n else None
    if earliest is None or now + seconds(n) <= earliest:
        return list(range(n))
    k = max([k for k in range(1, n) if now + seconds(k) <= earliest], default=1)
    return sorted(urgent[:k])


def backlog(fair: bool, booked: Mapping[str, int], tenant: str, rows: int) -> int:
    """The rows decoded before the last of `rows` more rows of `tenant` with the rows `booked`
    (being decoded) by tenant: in the tenants' fair order of decoding (`service.core.decoding`)
    its own, and of each other tenant's as many as its own at most (taken in turn); in arrival
    order all of them."""
    if not fair:
        return sum(booked.values()) + rows
    own = booked.get(tenant, 0) + rows
    return own + sum(min(n, own) for t, n in booked.items() if t != tenant)


class Estimate(NamedTuple):
    """Admission's estimate of a request's rows (`Schedule.expected_at`), on the batcher's
    clock."""

    due: float  # when they would be answered, after what the scheduler takes before them
    alone: float  # when they would be answered with nothing queued ahead of them
    slack: float  # how many times its expected wait its tenant's rows waited (`slack`)

    def need_s(self, now: float) -> float:
        """Seconds from `now` the rows need, by the estimate: their time alone plus their
        expected wait times the slack."""
        return self.alone - now + max(0.0, self.due - self.alone) * self.slack


class Learnt:
    """What a `Schedule` learnt of one tenant's requests: its pace of decoding (an EWMA of the
    time from admission to queue per row decoded before, PATH_ALPHA) and how much longer its
    rows waited than expected (the last SLACK_KEPT (when learnt, ratio))."""

    __slots__ = ("pace_s", "ratios")

    def __init__(self) -> None:
        self.pace_s = 0.0
        self.ratios: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=SLACK_KEPT)


class Schedule:
    """The batcher's deadlines (see the module doc).

    Args:
        seconds: the time a batch of n takes here (the engine's `LiveProfile.upper`); None
            (no batch profile): no estimate, no picks, rows dropped once their deadline passed.
    """

    def __init__(self, seconds: Callable[[int], float] | None) -> None:
        self.seconds = seconds
        self.on_late: Callable[[Mapping[str, int]], object] | None = None
        # The trunk's seconds in the batch that just ran (None: it did not run), read when the
        # batch ends to learn the work around it (`around_s`); None: not known.
        self.trunk_took: Callable[[], float | None] | None = None
        self._running: tuple[float, int] | None = None  # (start, rows) of the running batch
        self._around: tuple[float, float] | None = None  # (mean, mean deviation) learnt
        self._learnt: collections.OrderedDict[str, Learnt] = collections.OrderedDict()

    def around_s(self) -> float:
        """The work around a batch's trunk, as batches rarely exceed it: the learnt mean plus
        AROUND_DEVIATIONS mean deviations, ANSWER_S at least (and before any was learnt)."""
        if self._around is None:
            return ANSWER_S
        mean, spread = self._around
        return max(ANSWER_S, mean + AROUND_DEVIATIONS * spread)

    def _answered(self, n: int) -> float:
        assert self.seconds is not None
        return self.seconds(n) + self.around_s()

    # -- admission ------------------------------------------------------------------------

    def expected_at(self, queue, booked: Mapping[str, int], tenant: str, rows: int,
                    batch_size: int, now: float) -> Estimate | None:
        """The `Estimate` of `rows` new rows of `tenant`, with `queue` (a `TenantQueue` of
        entries) and the rows `booked` (being decoded) by tenant; None without a profile."""
        if self.seconds is None:
            return None
        waiting = collections.Counter(queue.rows)  # every row queued, by tenant
        waiting[tenant] += booked.get(tenant, 0)
        ahead = queue.ahead(tenant, rows, waiting)
        pace = self.pace(tenant)
        path_s = pace * backlog(queue.fair, booked, tenant, rows)
        return Estimate(now + self.expected_s(now, ahead, 1, batch_size, path_s),
                        now + self.expected_s(now, 0, rows, batch_size, pace * rows),
                        self.slack(tenant, now))

    def expected_s(self, now: float, ahead: int, rows: int, batch_size: int,
                   path_s: float = 0.0) -> float:
        """Seconds from `now` until the last of `rows` new rows is answered, with `ahead` rows
        taken before it and batches of `batch_size`: after the running batch's rest; or,
        when longer, after `path_s` (until its rows are decoded) and a batch of one."""
        assert self.seconds is not None
        left = 0.0
        if self._running is not None:
            start, size = self._running
            left = max(0.0, start + self.seconds(size) - now)
        full, part = divmod(ahead + rows, batch_size)
        trunk = left + full * self.seconds(batch_size) + (self.seconds(part) if part else 0.0)
        # Decoding overlaps the trunk's work ahead; the rows join the queue once decoded.
        return max(trunk, path_s + self.seconds(1)) + self.around_s()

    def _of(self, tenant: str) -> Learnt:
        """`tenant`'s learnt state, made (and the least recently learnt one forgotten) when
        missing, now the most recent."""
        learnt = self._learnt.get(tenant)
        if learnt is None:
            learnt = self._learnt[tenant] = Learnt()
            while len(self._learnt) > LEARNT_TENANTS:
                self._learnt.popitem(last=False)
        self._learnt.move_to_end(tenant)
        return learnt

    def pace(self, tenant: str) -> float:
        """Seconds per row decoded before a row of `tenant` is queued (0 before it learnt)."""
        learnt = self._learnt.get(tenant)
        return 0.0 if learnt is None else learnt.pace_s

    def slack(self, tenant: str, now: float) -> float:
        """How many times its expected wait a row of `tenant` waits to be answered, at worst:
        the SLACK_QUANTILE (their largest) of its last SLACK_KEPT rows learnt since
        SLACK_AGE_S before `now` whose deadline their wait decided, at least 1; 1 before
        SLACK_MIN of them."""
        learnt = self._learnt.get(tenant)
        if learnt is None:
            return 1.0
        ratios = sorted(r for t, r in learnt.ratios if t >= now - SLACK_AGE_S)
        if len(ratios) < SLACK_MIN:
            return 1.0
        return max(1.0, ratios[min(len(ratios) - 1, int(SLACK_QUANTILE * len(ratios)))])

    def queued_after(self, tenant: str, seconds: float, rows_before: int) -> None:
        """A request of `tenant` had its rows queued `seconds` after its admission, with
        `rows_before` rows to decode before them then, its own included (`backlog`)."""
        learnt = self._of(tenant)
        learnt.pace_s += PATH_ALPHA * (max(0.0, seconds) / max(1, rows_before) - learnt.pace_s)

    # -- batches ----------------------------------------------------------------------------

    def doomed(self, deadline: float | None, now: float) -> bool:
        """Whether a row of `deadline` is dropped before a batch taken at `now`."""
        if deadline is None:
            return False
        return deadline <= now if self.seconds is None else now + self._answered(1) > deadline

    def too_late_to_start(self, deadline: float | None, now: float) -> bool:
        """Whether an image whose decode starts `now` could no longer be answered by `deadline`
        even in the batch right after the one running (its rest, then a batch of one: the
        next batch after it would drop the row): asked as each image's decode is to start
        (`service.core.engine`: refused then, DeadlineUnmeetable, before any work). False
        without a deadline or a profile. Only reads (a decode thread asks)."""
        if deadline is None or self.seconds is None:
            return False
        return self._after_running(now) > deadline

    def _after_running(self, now: float) -> float:
        """When a row ready `now` would be answered at the earliest: after the rest of the
        batch running, in a batch of its own (upper times)."""
        assert self.seconds is not None
        running = self._running
        left = 0.0 if running is None else max(0.0, running[0] + self.seconds(running[1]) - now)
        return now + left + self._answered(1)

    def drop_doomed(self, queue, now: float) -> int:
        """Removes from `queue` the entries not done that are `doomed` now and fails them (504
        `deadline_exceeded`); each counts as answered a batch of one from now in `slack`.
        Returns how many."""
        doomed = [e for e in queue.entries
                  if not e.future.done() and self.doomed(e.row.deadline, now)]
        queue.remove_many(doomed)
        for e in doomed:
            e.queued = False
        if doomed and self.seconds is not None:
            self._learn([e.row for e in doomed], now + self._answered(1))
        fail([e for e in doomed if (e.row.deadline or 0.0) <= now],
             DeadlineExceeded(PASSED_WAITING))
        fail(doomed, DeadlineExceeded("the request's deadline would pass before its answer: "
                                      "dropped before the trunk"))
        return len(doomed)

    def start_in(self, queue, now: float, rows: int) -> float:
        """Seconds until a batch of the `rows` ready in `queue` must start (START_LEAD_S
        early) for the earliest deadline among its entries to be met (a batch waits for more
        rows only that long); inf without a profile or a deadline."""
        deadlines = [e.row.deadline for e in queue.entries if e.row.deadline is not None]
        if self.seconds is None or not deadlines or rows < 1:
            return math.inf
        return min(deadlines) - self._answered(rows) - START_LEAD_S - now

    def leaves_room(self, queue, now: float, rows: int, then: int) -> bool:
        """Whether the earliest deadline in `queue` would still be met after a batch of `rows`
        started now and one of `then` rows after it (its row may be in either): where a batch
        longer than the working size may run at saturation (`Sharing.batch`). False without a
        profile."""
        if self.seconds is None:
            return False
        return self.start_in(queue, now, rows) >= self._answered(then)

    def picker(self, now: float) -> Callable[[list], list[int]] | None:
        """`TenantQueue.take`'s `pick` for a batch taken at `now` (`batch_pick` on the
        entries' deadlines); None without a profile (the order's rows, as many as fit)."""
        if self.seconds is None:
            return None
        return lambda order: batch_pick([e.row.deadline for e in order], now, self._answered)

    def running(self, start: float, rows: int) -> None:
        """A batch of `rows` started at `start`."""
        self._running = (start, rows)

    def ran(self, rows: Sequence, end: float, run: Sequence | None = None) -> None:
        """The running batch of `rows` (`Row`s) ended at `end`: those of them `run` (all by
        default; not those dropped as the trunk started) past their deadline are counted
        (`on_late`); how late admission's estimates were is learnt (`slack`), and the work
        around the batch's trunk (`around_s`), when the trunk ran."""
        took = None if self.trunk_took is None else self.trunk_took()
        if self._running is not None and took is not None:
            around = max(0.0, end - self._running[0] - took)
            if self._around is None:
                self._around = (around, 0.0)
            else:
                mean, spread = self._around
                self._around = (mean + AROUND_ALPHA * (around - mean),
                                spread + AROUND_ALPHA * (abs(around - mean) - spread))
        self._running = None
        late = collections.Counter(r.tenant for r in (rows if run is None else run)
                                   if r.deadline is not None and r.deadline < end)
        if late and self.on_late is not None:
            self.on_late(late)
        self._learn(rows, end + ANSWER_S)

    def refused_at_start(self, tenant: str, due: tuple[float, float] | None,
                         deadline: float | None, now: float) -> None:
        """A request of `tenant`, admitted with `due` (`Estimate`'s (alone, due)), was refused
        `now` as its work was to start (`too_late_to_start`, `service.core.engine`): learnt
        (`slack`) as answered when it could have been at the earliest, as a row dropped after
        the running batch is, so admission stays as strict as if it had been queued."""
        if self.seconds is not None:
            self._learn_row(tenant, due, deadline, self._after_running(now), self.seconds(1))

    def _learn(self, rows: Sequence, answered: float) -> None:
        if self.seconds is None:  # no estimates to learn from
            return
        least = self.seconds(1)  # a wait is counted as a batch of one at least
        for r in rows:
            self._learn_row(r.tenant, r.due, r.deadline, answered, least)

    def _learn_row(self, tenant: str, due: tuple[float, float] | None, deadline: float | None,
                   answered: float, least: float) -> None:
        if due is None or deadline is None:
            return
        alone, expected = due
        wait = max(expected - alone, least)
        if deadline - alone <= SLACK_TIGHT * wait:  # its expected wait decided
            self._of(tenant).ratios.append((answered, max(0.0, answered - alone) / wait))
