"""The serving processes of one store: a lease each, and how many are live (issue 34: quotas
across the processes that serve one store, `service.core.quota`).

    processes = store.processes      # `store.processes.ServingProcesses`: starts nothing
    processes.join()                 # this process serves the store: its lease, kept alive
    processes.count()                # the live leases (this one included), from memory
    processes.leave()                # its lease deleted (`HeadStore.close` calls it)

Here: `Lease`, and `Leases`, the backends' part (`store.directory.leases`, `store.pg.leases`);
`store.processes`: `ServingProcesses`, a store's own lease and count, renewed by a thread.

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

import os
import socket
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from accounts.tenants import utc_now


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
