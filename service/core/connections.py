"""Keys for the life of a connection: the open WebSockets of one process by the API key that
opened them, closed when that key stops being accepted.

A call is authenticated once (`Authenticator.admit`); a WebSocket lives on after its upgrade.
So each socket opened with an API key is registered here (`Connections.hold`) with a way to
close it, and:

- each of its messages is checked first (`Connections.accepts`): a message arriving after its
  key left the key table is refused by closing the socket, never answered;
- a watcher task on the event loop reads the key table every WATCH_S while sockets are open,
  and closes those whose key left it (revoked, or its tenant removed) with close code 1008
  (policy violation) and a JSON reason (`CLOSE_REASON`).

The key table is the store snapshot's (`HeadStore.key_table`): the same read-only mapping
until the keys change, so a watcher round that finds nothing changed is one identity check. A
revocation through this process's store publishes the new snapshot before it returns (the
store's read-your-writes): its sockets are closed within WATCH_S. One made by another process
(or `multihead keys revoke`) reaches this process's snapshot within the store refresher's
`change_poll_s` (0.25 s; a PostgreSQL notification wakes the refresher at once) plus the read
of the rows: its sockets are closed within about 0.25 s + WATCH_S. A socket of the operator
(or, with --auth none, anyone's) has no key to lose: it is not registered.

Everything here runs on one event loop (the one serving the sockets).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping

from service.core.auth import Principal

log = logging.getLogger(__name__)

# RFC 6455: "policy violation", what a socket whose key was revoked is closed with.
CLOSE_POLICY = 1008
# How often the watcher reads the key table while sockets are open (seconds).
WATCH_S = 0.1
# The close frame's reason (a close reason holds at most 123 bytes).
CLOSE_REASON = json.dumps({"error": "API key no longer accepted (revoked, or its tenant "
                                    "removed)", "code": "unauthorized", "status": 401})
assert len(CLOSE_REASON.encode()) <= 123, CLOSE_REASON

Close = Callable[[], Awaitable[None]]


class Connections:
    """The open connections of one process by key id (see the module doc).

    Args:
        keys: the live keys by id (`HeadStore.key_table`: from the snapshot, cheap).
        every_s: the watcher's interval.
    """

    def __init__(self, keys: Callable[[], Mapping], *, every_s: float = WATCH_S) -> None:
        self._keys = keys
        self._every_s = every_s
        self._open: dict[str, dict[object, Close]] = {}  # key id -> {socket: its close}
        self._watcher: asyncio.Task | None = None
        self._seen: Mapping | None = None  # the key table the watcher last checked against

    @property
    def open_count(self) -> int:
        """How many sockets are registered (opened with a key, not closed yet)."""
        return sum(len(sockets) for sockets in self._open.values())

    def accepts(self, principal: Principal) -> bool:
        """Whether the key `principal` called with is still accepted (always, for a caller
        without a key: the operator, anyone with --auth none)."""
        if principal.key_id is None:
            return True
        try:
            return principal.key_id in self._keys()
        except RuntimeError:  # the store is closed: the process is stopping
            return False

    @contextlib.contextmanager
    def hold(self, principal: Principal, close: Close) -> Iterator[None]:
        """Registers a socket opened by `principal` for the block: `close()` closes it (with
        CLOSE_POLICY and CLOSE_REASON) once its key is no longer accepted. Call on the event
        loop that serves the socket."""
        with self.hold_key(principal.key_id, close):
            yield

    @contextlib.contextmanager
    def hold_key(self, key_id: str | None, close: Close) -> Iterator[None]:
        """`hold` by the key's id (None: a socket without a key, not registered)."""
        if key_id is None:
            yield
            return
        token = object()
        self._open.setdefault(key_id, {})[token] = close
        # NOTE: its key may have gone since its upgrade was admitted: checked next round.
        self._seen = None
        self._watch()
        try:
            yield
        finally:
            sockets = self._open.get(key_id, {})
            sockets.pop(token, None)
            if not sockets:
                self._open.pop(key_id, None)

    def _watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(
                self._run(), name="multihead-connection-keys")

    async def live(self, key_ids: Collection[str]) -> Collection[str] | None:
        """Which of `key_ids` are still accepted; None: nothing changed since the last round
        (the same key table), or the table cannot be read (the store is closed: the sockets
        close with the server)."""
        try:
            keys = self._keys()
        except RuntimeError:
            return None
        if keys is self._seen:
            return None
        self._seen = keys
        return {k for k in key_ids if k in keys}

    async def _run(self) -> None:
        while self._open:
            await asyncio.sleep(self._every_s)
            live = await self.live(list(self._open))
            if live is None:
                continue
            gone = [k for k in self._open if k not in live]
            for key_id in gone:
                sockets = self._open.pop(key_id, {})
                log.info("API key %s no longer accepted: closing its %d open socket(s)",
                         key_id, len(sockets))
                for close in sockets.values():
                    asyncio.get_running_loop().create_task(_quietly(close))


async def _quietly(close: Close) -> None:
    try:
        await close()
    except Exception as exc:  # noqa: BLE001 - a socket already gone is closed enough
        log.debug("closing a socket whose key was revoked: %r", exc)
