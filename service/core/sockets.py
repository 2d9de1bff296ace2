"""Per-tenant shares of the open WebSockets of one process, like the queue shares
(`service.core.booking`): at most `max_websockets` sockets are open at once, and each tenant
opens at most its weighted share of them, counted among the tenants with sockets open and
itself (a tenant alone may open them all).

- Beyond its share a tenant's new socket is refused with 429 `socket_share` (SocketShareExceeded,
  Retry-After) before the upgrade.
- A tenant within its share is never refused for another's use: when every socket is taken,
  the newest socket of the tenant most over its share (counting the newcomer as active) is
  closed to make room (close code 1013, "try again later", with a JSON reason naming
  `socket_share`); only when no tenant is over its share is the newcomer refused (503
  `overloaded`).

A socket without a tenant (the operator's, anyone's with --auth none) counts under the tenant
"" with the default weight. Everything here runs on the event loop serving the sockets.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from service.core.admission import RETRY_AFTER_S
from service.core.errors import Overloaded, SocketShareExceeded

log = logging.getLogger(__name__)

# RFC 6455: "try again later", what a socket closed to make room for another tenant's gets.
CLOSE_TRY_LATER = 1013
CLOSE_REASON = json.dumps({"error": "closed to make room for a tenant within its share of "
                                    "the sockets", "code": "socket_share", "status": 429})
assert len(CLOSE_REASON.encode()) <= 123, CLOSE_REASON

Close = Callable[[], Awaitable[None]]


class SocketShares:
    """The open sockets of one process by tenant (see the module doc).

    Args:
        capacity: the most sockets open at once (`max_websockets`).
        weight: a tenant's weight (`Tenancy.weight`).
    """

    def __init__(self, capacity: int, weight: Callable[[str], float]) -> None:
        self.capacity = capacity
        self._weight = weight
        self._open: dict[str, dict[object, Close]] = {}  # tenant -> {socket: close}, in order

    @property
    def open_count(self) -> int:
        return sum(len(sockets) for sockets in self._open.values())

    def count(self, tenant: str) -> int:
        return len(self._open.get(tenant, ()))

    def share(self, tenant: str, newcomer: str | None = None) -> int:
        """`tenant`'s weighted share of the capacity among the tenants with sockets open,
        itself and `newcomer`; at least one socket."""
        active = {t for t, sockets in self._open.items() if sockets} | {tenant}
        if newcomer is not None:
            active.add(newcomer)
        total = sum(self._weight(t) for t in active)
        return max(1, int(self.capacity * self._weight(tenant) / total))

    def admit(self, tenant: str, socket: object, close: Close) -> Close | None:
        """Registers `socket` of `tenant` (its `close` closes it with CLOSE_TRY_LATER), or
        raises. Returns the close of the socket pushed out to make room, if any: the caller
        awaits it.

        Raises:
            SocketShareExceeded: `tenant` has its share open already.
            Overloaded: every socket is taken and no tenant is over its share.
        """
        mine, share = self.count(tenant), self.share(tenant)
        if mine + 1 > share:
            raise SocketShareExceeded(RETRY_AFTER_S, (
                f"tenant '{tenant}' has {mine} WebSockets open, its share is {share} now; "
                "close one or retry later"))
        pushed = None
        if self.open_count + 1 > self.capacity:
            pushed = self._push_out(tenant)
            if pushed is None:
                raise Overloaded(RETRY_AFTER_S, f"server busy: {self.capacity} WebSockets open; "
                                 f"retry after {RETRY_AFTER_S:.0f} s")
        self._open.setdefault(tenant, {})[socket] = close
        return pushed

    def release(self, tenant: str, socket: object) -> None:
        sockets = self._open.get(tenant)
        if sockets is not None:
            sockets.pop(socket, None)
            if not sockets:
                del self._open[tenant]

    def _push_out(self, newcomer: str) -> Close | None:
        """Unregisters the newest socket of the tenant most over its share (counting
        `newcomer` as active); returns its close, None when no tenant is over."""
        over = [(len(sockets) - self.share(t, newcomer), t) for t, sockets in self._open.items()
                if t != newcomer]
        excess, tenant = max(over, default=(0, ""))
        if excess <= 0:
            return None
        socket, close = self._open[tenant].popitem()  # the newest (insertion order)
        self.release(tenant, socket)  # drops the tenant's entry when it was its last
        log.info("WebSocket of tenant %r closed to make room for tenant %r (its share)",
                 tenant, newcomer)
        return close
