"""The serving processes of one store: a lease each, and how many are live (issue 34: quotas
across the processes that serve one store, `service.core.quota`).

    processes = store.processes      # `ServingProcesses`, made with the store; starts nothing
    processes.join()                 # this process serves the store: its lease, kept alive
    processes.count()                # the live leases (this one included), from memory
    processes.leave()                # its lease deleted (`HeadStore.close` calls it)

A lease is a row of `serving_processes` (id, host, pid, started, seen): in the schema of a
PostgreSQL store, in `processes.sqlite` beside the registry of a directory store (so that the
beats move neither the registry's data version nor its writer lock: `store.schema`). The
service joins at bring-up; the CLI's one-shot commands never do, so they are not counted.

Each beat, every `beat_s` (2 s) from a thread of its own: one transaction writes this lease's
`seen` as now, deletes every lease not seen within `ttl_s` (10 s: a process that died without
leaving) and counts the rest; `count()` returns that number, never reading the store. A
process that leaves is counted one less by the others at their next beat; one that died, for
up to `ttl_s` + `beat_s` (its quota share is then too small: quotas are stricter, never looser).
A beat that fails (a locked SQLite file, PostgreSQL down) is logged and keeps the last count;
the next one writes the lease again (also if another process swept it meanwhile).

Time is the database's clock for PostgreSQL (one clock for every machine that serves it) and
the machine's for a directory store (one machine).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from accounts.tenants import utc_now
from store.snapshot import Refresher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """One serving process: a random id, its host and pid, when it joined (ISO 8601 UTC)."""

    id: str
    host: str
    pid: int
    started: str

    @classmethod
    def of_this_process(cls) -> Lease:
        return cls(uuid.uuid4().hex, socket.gethostname(), os.getpid(), utc_now())


class Leases(ABC):
    """The leases part of a store backend. Thread-safe; every method may block on I/O."""

    @abstractmethod
    def beat(self, lease: Lease, ttl_s: float) -> int:
        """In one transaction: write `lease` as seen now (its row made if missing), delete
        every lease not seen within `ttl_s`, and return how many are left (`lease` included).
        Creates what the store lacks for it (its table; a directory store's file)."""

    @abstractmethod
    def leave(self, lease_id: str) -> None:
        """Delete the lease `lease_id` (nothing if it is gone)."""


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
