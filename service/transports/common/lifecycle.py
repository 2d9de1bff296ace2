"""What a serving process runs beside its main transport, started and stopped with it.

The HTTP transport (aiohttp) owns the process's lifecycle: start-up, SIGTERM, the drain. Another
listener over the same `Service` (the gRPC server) plugs into it as a `Listener`, built by a
factory from that `Service`; the transports never import each other, the command that serves
(`cli.serve`) composes them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from service.core.service import Service


class Listener(Protocol):
    """A second listener of one serving process."""

    async def open(self) -> None:
        """Binds at start-up, before the service's bring-up (a port in use fails the start)."""

    def begin_stop(self) -> None:
        """The main transport stopped accepting: refuse new calls, let those in flight drain."""

    async def close(self) -> None:
        """Waits for the drain begun by `begin_stop`, before the `Service` closes."""


ListenerFactory = Callable[["Service"], Listener]
