"""The header timeout of the aiohttp transport: a request whose line and headers do not arrive
within `header_timeout_s` is answered 408 (`{"error": ..., "code": "request_timeout"}`) and
its connection closed.

aiohttp has no such timeout: a connection is idle to it until a whole request head is parsed,
and its keep-alive timeout only closes a connection that sent nothing. So each connection of an
app made by `create_app` gets a timer (`arm`, from the connection's first byte, or from the
first byte after its previous request), cancelled as soon as aiohttp has parsed a request head
(`data_received`). The body's own pace is held by `common.exchange.paced`.

NOTE: aiohttp's RequestHandler is the one class every aiohttp server of the process uses; its
`connection_made` and `data_received` are wrapped here (as `handle_error` is in `app`). A
server of another app (no HEADER_TIMEOUT key) is left as aiohttp made it.
"""
from __future__ import annotations

import json
import logging

from aiohttp import web, web_protocol

from service.core.errors import HEAD_TIMEOUT_ERROR

log = logging.getLogger(__name__)

# The app key create_app sets: the header timeout of that app's connections (0: none).
HEADER_TIMEOUT = web.AppKey("header_timeout_s", float)
REQUEST_TIMEOUT = 408

_BODY = json.dumps({"error": HEAD_TIMEOUT_ERROR, "code": "request_timeout"}).encode()
ANSWER = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_BODY)) + _BODY

# The armed timers, by connection (RequestHandler has __slots__: no attribute of ours).
_timers: dict[web_protocol.RequestHandler, object] = {}


def _timeout_of(handler: web_protocol.RequestHandler) -> float:
    app = getattr(handler._request_handler, "__self__", None)
    if isinstance(app, web.Application):
        return app.get(HEADER_TIMEOUT, 0.0)
    return 0.0


def _expired(handler: web_protocol.RequestHandler) -> None:
    _timers.pop(handler, None)
    if handler._messages or handler.transport is None:
        return  # a head was parsed meanwhile, or the connection is gone
    log.info("request headers not received in %.1f s: 408, connection closed",
             _timeout_of(handler))
    handler.transport.write(ANSWER)
    handler.force_close()  # the transport sends what was written, then closes


def arm(handler: web_protocol.RequestHandler) -> None:
    """Starts `handler`'s header timer, unless one runs or its app sets none."""
    if handler in _timers:
        return
    timeout = _timeout_of(handler)
    if timeout > 0:
        _timers[handler] = handler._loop.call_later(timeout, _expired, handler)


def disarm(handler: web_protocol.RequestHandler) -> None:
    timer = _timers.pop(handler, None)
    if timer is not None:
        timer.cancel()


_connection_made = web_protocol.RequestHandler.connection_made
_data_received = web_protocol.RequestHandler.data_received
_connection_lost = web_protocol.RequestHandler.connection_lost


def _on_connection_made(self, transport) -> None:
    _connection_made(self, transport)
    arm(self)


def _on_data_received(self, data: bytes) -> None:
    # Waiting for a request (no head queued, none being handled) when bytes arrive: a new head
    # begins; its timer runs from now (from the connection's start for the first one).
    idle = not self._messages and self._waiter is not None and not self._waiter.done()
    _data_received(self, data)
    if self._messages or self._upgraded or self._force_close:
        disarm(self)
    elif idle and data:
        arm(self)


def _on_connection_lost(self, exc) -> None:
    disarm(self)
    _connection_lost(self, exc)


web_protocol.RequestHandler.connection_made = _on_connection_made
web_protocol.RequestHandler.data_received = _on_data_received
web_protocol.RequestHandler.connection_lost = _on_connection_lost
