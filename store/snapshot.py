"""The store as the request path sees it: an immutable `StoreSnapshot`, and the `Refresher`
thread that keeps it current.

`HeadStore`'s lookups (`get`, `exists`, `owner`, the candidates, `key_table`, `tenant_limits`)
answer from the snapshot alone: a registry read that blocks (a locked SQLite file, PostgreSQL
frozen) delays only the refresher, never a request. The refresher polls the backend's cheap
data version every `change_poll_s` (a PostgreSQL notification wakes it at once), reads the
rows only when the version moved, and publishes the new snapshot by one attribute swap. A
write through the same `HeadStore` publishes before it returns (read-your-writes). A read that
fails keeps the last snapshot (logged), and the next poll reads again.

`Snapshots` is all of it for one store: the current snapshot, `refresh`, and `watch`, which
starts the refresher.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from accounts.candidates import CandidateMode
from accounts.tenants import DEFAULT_TENANT, ApiKey, TenantLimits
from store.backend import Backend

log = logging.getLogger(__name__)


class _Unread:
    """The data version of a snapshot that reflects no read: equal to no backend's version."""

    def __repr__(self) -> str:
        return "<unread>"


_UNREAD = _Unread()


@dataclass(frozen=True)
class StoreSnapshot:
    """What one store held when it was last read. Immutable (its mappings are read-only
    views): a reader keeps a consistent view for as long as it holds it.

    Attributes:
        data_version: the backend's data version the rows were read at (`Backend.data_version`).
        active: {bot id: active version} of every live bot.
        owners: {bot id: owner tenant} of every live bot.
        candidates: {bot id: (version, mode)} of the live bots that have a candidate.
        keys: {key id: ApiKey} of the live (unrevoked) API keys.
        limits: {tenant: its limits} of every tenant ("default" always).
        read_s: when it was read (`time.monotonic()` when its data version was read, just
            before its rows; the store's opening if never).
        confirmed_s: when it was last found current: its read, or the last poll that saw the
            data version unchanged (`time.monotonic()`).
    """

    data_version: object
    active: Mapping[str, int]
    owners: Mapping[str, str]
    candidates: Mapping[str, tuple[int, CandidateMode]]
    keys: Mapping[str, ApiKey]
    limits: Mapping[str, TenantLimits]
    read_s: float
    confirmed_s: float

    @classmethod
    def unread(cls, now_s: float) -> StoreSnapshot:
        """The snapshot of a store not read yet (or whose registry could not be read): no
        bots, no keys, every tenant's limits the serve defaults."""
        empty = MappingProxyType({})
        return cls(_UNREAD, empty, empty, empty, empty,
                   MappingProxyType({DEFAULT_TENANT: TenantLimits()}), now_s, now_s)

    @property
    def is_read(self) -> bool:
        """Whether it reflects a read of the store (False until the first one succeeds)."""
        return self.data_version is not _UNREAD

    def confirmed(self, now_s: float) -> StoreSnapshot:
        """This snapshot, found current again at `now_s`."""
        return dataclasses.replace(self, confirmed_s=now_s)


def _frozen(new: dict, old: Mapping) -> Mapping:
    """`new` as a read-only mapping; `old` itself if equal, so that callers that keep
    something per table (the service's filled-in limits) keep it until a real change."""
    return old if new == old else MappingProxyType(new)


def read_snapshot(backend: Backend, data_version: object, previous: StoreSnapshot,
                  now_s: float) -> StoreSnapshot:
    """The rows of `backend` read now, as a snapshot of `data_version` (read BEFORE the rows:
    a commit in between is then seen twice, never missed).

    Raises:
        backend.read_errors: the registry cannot be read.
    """
    state = backend.bots.active_map()
    found = backend.bots.candidates()
    keys = {k.id: k for k in backend.accounts.keys(live_only=True)}
    limits = backend.accounts.tenant_limits()
    active = {b: v for b, (v, _) in state.items()}
    # NOTE: several reads: a candidate promoted between them would name the active version;
    # it is not one then (the next poll reads both again).
    candidates = {b: (c.version, c.mode) for b, c in found.items()
                  if b in active and active[b] != c.version}
    return StoreSnapshot(
        data_version, _frozen(active, previous.active),
        _frozen({b: t for b, (_, t) in state.items()}, previous.owners),
        _frozen(candidates, previous.candidates), _frozen(keys, previous.keys),
        _frozen(limits, previous.limits), now_s, now_s)


class Refresher:
    """A daemon thread that calls `poll()` again and again: after the interval `poll` returns,
    or at once when `wake()` is called (a change notification). It holds its store weakly
    (`poll` is a bound method): a store dropped without `close()` stops it too."""

    def __init__(self, poll: Callable[[], float], *, name: str) -> None:
        self._poll = weakref.WeakMethod(poll)
        self._first_wait_s = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, first_wait_s: float) -> None:
        self._first_wait_s = first_wait_s
        self.thread.start()

    def wake(self) -> None:
        """Poll now (or as soon as the poll under way returns)."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and wait for a poll under way (at most `timeout_s`)."""
        self._stop.set()
        self._wake.set()
        if self.thread.ident is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    def _run(self) -> None:
        wait_s = self._first_wait_s
        while True:
            self._wake.wait(wait_s)
            if self._stop.is_set():
                return
            self._wake.clear()  # a wake from here on means another poll
            poll = self._poll()
            if poll is None:
                return  # the store is gone
            try:
                wait_s = poll()
            except Exception:  # noqa: BLE001 - the refresher must outlive one failed poll
                log.exception("store refresher: poll failed; trying again")
            finally:
                del poll


class Snapshots:
    """The snapshots of one store: the current one, reading it again, and the refresher that
    keeps it current once the store is watched. Thread-safe.

    Args:
        backend: the store's backend.
        poll_s: the refresher's interval, asked before each wait (`HeadStore.change_poll_s`).
        published: called with each new snapshot, under the refresh lock (the resident cache
            drops the heads of versions no longer active).
        log: where an unreadable registry is reported (`HeadStore`'s logger).

    Attributes:
        current: the current snapshot (replaced whole, never changed in place).
    """

    def __init__(self, backend: Backend, *, poll_s: Callable[[], float],
                 published: Callable[[StoreSnapshot], None], log: logging.Logger) -> None:
        self._backend = backend
        self._poll_s = poll_s
        self._published = published
        self._log = log
        self.current = StoreSnapshot.unread(time.monotonic())
        self._lock = threading.Lock()  # one refresh at a time, so none publishes older rows
        self._unreadable = False  # the last read failed: the next failures are logged quietly
        self._watch_lock = threading.Lock()
        self._refresher: Refresher | None = None
        self._closed = False

    def for_lookup(self) -> StoreSnapshot:
        """The snapshot a lookup answers from; the first lookup of a store nobody watched
        watches it (and so reads the registry, once).

        Raises:
            RuntimeError: the store is closed.
        """
        if self._refresher is None or self._closed:
            self.watch()
        return self.current

    def watch(self) -> None:
        """Read the store unless the snapshot is current, then start the refresher (unless it
        runs). Idempotent. Raises RuntimeError if the store is closed."""
        with self._watch_lock:
            if self._closed:
                raise RuntimeError("the head store is closed")
            if self._refresher is not None:
                return
            refresher = Refresher(self._poll, name="multihead-store-refresher")
            # Before the first read: a change notified meanwhile is read at once by the thread.
            self._backend.on_change(refresher.wake)
            self.refresh()
            refresher.start(self._poll_s())
            self._refresher = refresher

    def refresh(self, *, force: bool = False) -> None:
        """Publish the store as it is now: read its data version, and its rows if the version
        moved since the current snapshot (always with `force`: a writer's read-your-writes).
        A read error is logged and keeps the current snapshot."""
        with self._lock:
            current = self.current
            now = time.monotonic()
            try:
                version = self._backend.data_version()
                if not force and version == current.data_version:
                    self.current = current.confirmed(now)
                    self._unreadable = False
                    return
                fresh = read_snapshot(self._backend, version, current, now)
            except self._backend.read_errors as exc:
                # NOTE: an unreadable registry must not make every bot unknown: keep serving
                # the last snapshot and read again at the next poll.
                (self._log.debug if self._unreadable else self._log.warning)(
                    "registry of store %s unreadable (%s): keeping the last known bots",
                    self._backend.describe(), exc)
                self._unreadable = True
                return
            self._unreadable = False
            self.current = fresh
            self._published(fresh)

    def age_s(self) -> float:
        """Seconds since the current snapshot was last confirmed current."""
        return max(0.0, time.monotonic() - self.current.confirmed_s)

    def close(self) -> None:
        """Stop the refresher; from now on `for_lookup` and `watch` raise. Idempotent."""
        with self._watch_lock:
            self._closed = True
            refresher = self._refresher
        if refresher is not None:
            refresher.stop()

    def _poll(self) -> float:
        self.refresh()
        return self._poll_s()
