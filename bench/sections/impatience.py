"""How the cancellation section's impatient clients give up: their timeout and their number,
from the trunk they run against (issue 31, item 6). Pure arithmetic, no I/O.

The section's comparison (`bench.sections.cancellation`: the patient clients' images/s without
cancellation ÷ with it) means something only where the clients that give up leave abandoned
work behind them faster than the trunk can run it: without cancellation that work stays
queued and the patient clients' rows wait behind it; with it, it leaves the queue. The timeout
used to be 2 × m, m the median of one client alone (about one batch-1 forward): the abandoned
rows then arrive at 8 / 2m a second against the trunk's 8 / B (B: a batch of 8), B / 2m of
it. That is 2-5 × on a CPU where a batch of 8 takes 4-9 batch-1 forwards (the runs in
docs/performance.md), but 1 × or less where the trunk gains more from batching, or where the
request path takes a larger share of m: on the AMX Xeon of issue 31 the comparison measured
1.18 × (FAIL), nothing abandoned having piled up.

So the timeout and the number of clients come from what the server measured under the
16-patient load just before (`all-patient`, the same server and batch size): B, its trunk's
mean time per batch, and its trunk time per image (B ÷ the mean batch, ≈ B / 8). The rules,
each the same on a slow CPU and a fast one:

- The rate: N clients that each give up after T seconds and at once send again send N / T
  requests a second, every one abandoned: `OVERLOAD` (4) × the rows the trunk runs a second.
  Without cancellation the queue then gains 4 - 1 = 3 s of work every second: it holds 30 s
  (the request deadline, past which the server drops a row) 10 s into the load, the end of the
  warm-up (quick: 15 s of the 30 by the end of its 5 s), or its 256-row bound sooner where the
  trunk runs more than 256 / 30 ≈ 8.5 rows/s. From then on a patient request waits the whole
  deadline, or for a queue of 256 abandoned rows, or is refused (503): the patient clients'
  images/s go towards 0, where with cancellation they keep about half the trunk.
- The timeout: T = B / `OVERLOAD`, a quarter of a batch, with N = 8 (the batch size: 8 patient
  and 8 impatient clients, the 16 of `all-patient`) giving that rate: 8 / (B / 4) = 4 × 8 / B.
  Under the load every request waits for the running batch to end and then runs a whole one,
  more than B, so every impatient request gives up; and B / 4 stays under the batch time of
  the `no-cancel` server (another process, whose trunk drifted 20-50 % from the first one's in
  the runs measured, docs/performance.md#cancellation).
- The floor: T ≥ m. A request that does not queue is answered within m, so a give-up is always
  a request that queued: its row reached the batcher, where cancellation can withdraw it (one
  given up while its upload is still read or decoded abandons no trunk work). Where B / 4 < m
  (a trunk that runs a batch of 8 in less than four single requests' time), T = m and N =
  ⌈4 × m ÷ the trunk's time per image⌉ clients keep the rate.
- The cap: N ≤ `MAX_IMPATIENT` (64, reached where m > 2B): a machine whose single request takes
  longer than two batches is bound by its request path, not its trunk. The rate offered is
  then less than 4 ×; `Impatience.overload` says how much it was.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

OVERLOAD = 4.0  # abandoned requests a second ÷ the trunk's rows a second
MAX_IMPATIENT = 64  # most clients that give up (the request path's bound, above)


@dataclass(frozen=True)
class Impatience:
    """The impatient clients of a run: `clients` of them, each giving up after `timeout_s`,
    from the trunk's `batch_ms` per batch and `image_ms` per image and the one client's
    median `median_ms` (see the module doc)."""

    timeout_s: float
    clients: int
    batch_ms: float
    image_ms: float
    median_ms: float

    @property
    def overload(self) -> float:
        """The requests they abandon a second ÷ the rows the trunk runs a second."""
        return self.clients / self.timeout_s * self.image_ms / 1000


def impatience(median_ms: float, batch_ms: float, image_ms: float, least: int) -> Impatience:
    """The impatient clients for a trunk that takes `batch_ms` per batch and `image_ms` per
    image under the load, and a single request's `median_ms` (the module doc has the rules
    and their arithmetic): timeout max(batch_ms / OVERLOAD, median_ms); clients enough to
    abandon OVERLOAD × the trunk's rows a second, at least `least` (the batch size), at most
    MAX_IMPATIENT.

    Raises:
        ValueError: a number is missing (NaN), not positive or not finite.
    """
    for name, value in (("median_ms", median_ms), ("batch_ms", batch_ms),
                        ("image_ms", image_ms)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value}")
    timeout_ms = max(batch_ms / OVERLOAD, median_ms)
    # round(): 4 × (B / 4) / (B / 8) is 8 up to the last bit, which ceil() would make 9.
    needed = math.ceil(round(OVERLOAD * timeout_ms / image_ms, 6))
    clients = min(max(needed, least), MAX_IMPATIENT)
    return Impatience(timeout_ms / 1000, clients, batch_ms, image_ms, median_ms)
