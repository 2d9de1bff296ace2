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
"" with the default weight. The shares are `service.core.shares.Shares` (one socket, one
unit). Everything here runs on the event loop serving the sockets.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from service.core.admission import RETRY_AFTER_S
from service.core.errors import Overloaded, SocketShareExceeded
from service.core.shares import Shares

log = logging.getLogger(__name__)

# RFC 6455: "try again later", what a socket closed to make room for another tenant's gets.
CLOSE_TRY_LATER = 1013
CLOSE_REASON = json.dumps({"error": "closed to make room for a tenant within its share of "
                                    "the sockets", "code": "socket_share", "status": 429})
# A socket pushed out of the in-flight bytes (`service.core.admission`): the same, for them.
BYTES_CLOSE_REASON = json.dumps({"error": "closed to make room for a tenant within its "
                                          "share of bytes", "code": "inflight_share",
                                 "status": 429})
assert max(len(CLOSE_REASON.encode()), len(BYTES_CLOSE_REASON.encode())) <= 123

Close = Callable[[], Awaitable[None]]


class SocketShares:
    """The open sockets of one process by tenant (see the module doc): one socket is one of
    the capacity's units in a `service.core.shares.Shares`.

    Args:
        capacity: the most sockets open at once (`max_websockets`).
        weight: a tenant's weight (`Tenancy.weight`).
    """

    def __init__(self, capacity: int, weight: Callable[[str], float]) -> None:
        self.capacity = capacity
        self._shares = Shares(capacity, weight, over_share=_over_share, full=lambda: Overloaded(
            RETRY_AFTER_S, f"server busy: {capacity} WebSockets open; "
                           f"retry after {RETRY_AFTER_S:.0f} s"), alone_over_share=True)

    @property
    def open_count(self) -> int:
        return self._shares.used

    def count(self, tenant: str) -> int:
        return self._shares.held(tenant)

    def share(self, tenant: str, newcomer: str | None = None) -> int:
        """`tenant`'s weighted share of the capacity among the tenants with sockets open,
        itself and `newcomer`; at least one socket."""
        return self._shares.share(tenant, newcomer)

    def admit(self, tenant: str, socket: object, close: Close) -> Close | None:
        """Registers `socket` of `tenant` (its `close` closes it with CLOSE_TRY_LATER), or
        raises. Returns the close of the socket pushed out to make room, if any: the caller
        awaits it.

        Raises:
            SocketShareExceeded: `tenant` has its share open already.
            Overloaded: every socket is taken and no tenant is over its share.
        """
        pushed = self._shares.take(tenant, socket, 1, close)
        if not pushed:
            return None
        log.info("a WebSocket was closed to make room for tenant %r (its share)", tenant)
        return pushed[0]

    def release(self, tenant: str, socket: object) -> None:
        self._shares.release(tenant, socket)


def _over_share(tenant: str, mine: int, share: int) -> SocketShareExceeded:
    return SocketShareExceeded(RETRY_AFTER_S, (
        f"tenant '{tenant}' has {mine} WebSockets open, its share is {share} now; "
        "close one or retry later"))
