"""`ServingProcesses`: this process's lease on one store (`store.leases`: what a lease is, how
the leases are counted), renewed by a thread of its own, and the count of live leases."""
from __future__ import annotations

import logging
import threading

from store.leases import Lease, Leases
from store.snapshot import Refresher

log = logging.getLogger(__name__)


class ServingProcesses:
    """This process's lease on one store, and the count of live leases. Thread-safe.

    Attributes:
        beat_s: seconds between beats (read before each wait).
        ttl_s: how long a lease is live after its last beat (a store's processes should agree:
            each sweeps by its own).
    """

    beat_s = 2.0
    ttl_s = 10.0

    def __init__(self, leases: Leases, where: str) -> None:
        self._leases = leases
        self._where = where
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._beating: Refresher | None = None
        self._count = 1
        self._failing = False  # the last beat failed: the next failures are logged quietly
        self._closed = False

    @property
    def joined(self) -> bool:
        return self._lease is not None

    def count(self) -> int:
        """The live leases at the last beat that succeeded, at least 1 (this process): from
        memory. 1 before `join`."""
        return self._count

    def join(self) -> None:
        """Take a lease (its first beat now: a failure is logged) and keep it alive from a
        background thread until `leave`. Idempotent. Raises RuntimeError after `leave`."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the head store is closed")
            if self._lease is not None:
                return
            self._lease = Lease.of_this_process()
            beating = Refresher(self._beat, name="multihead-store-lease")
            self._beat()
            beating.start(self.beat_s)
            self._beating = beating

    def leave(self) -> None:
        """Stop beating and delete the lease (best effort: a failure is logged, the lease then
        expires after `ttl_s`). Idempotent; `join` refuses afterwards."""
        with self._lock:
            self._closed = True
            lease, beating = self._lease, self._beating
            self._lease = self._beating = None
        if beating is not None:
            beating.stop()
        if lease is None:
            return
        try:
            self._leases.leave(lease.id)
        except Exception as exc:  # noqa: BLE001 - it expires anyway
            log.warning("store %s: could not delete this process's lease (%s); it expires in "
                        "%g s", self._where, exc, self.ttl_s)

    def _beat(self) -> float:
        lease = self._lease
        if lease is None:
            return self.beat_s
        try:
            count = self._leases.beat(lease, self.ttl_s)
        except Exception as exc:  # noqa: BLE001 - keep the last count, beat again
            (log.debug if self._failing else log.warning)(
                "store %s: the lease of this process could not be renewed (%s): keeping the "
                "count of serving processes at %d", self._where, exc, self._count)
            self._failing = True
            return self.beat_s
        if count != self._count:
            log.info("store %s: %d serving process(es) now (were %d)", self._where, count,
                     self._count)
        self._count = max(1, int(count))
        self._failing = False
        return self.beat_s
