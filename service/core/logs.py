"""Logs: one format for the whole process (text or JSON lines), the access log, request ids,
and what a line may never hold.

- `configure(log_format, level)` gives the root logger one handler on stderr: `text` (the
  default) keeps the lines `time LEVEL logger: message`; `json` writes one JSON object per line
  with `time` (ISO 8601, UTC), `level`, `logger`, `message`, `request_id`, `tenant`, `bot`,
  `status`, `latency_ms` on every line (null where they do not apply), and `exception` with
  the traceback. A line logged while a request is served (an internal error, a bot that cannot
  be loaded) carries that request's id, tenant and bot, and its `trace_id`/`span_id` when
  tracing is on.
- `request_scope(...)` is what every transport wraps around one request (an HTTP request, a
  gRPC call, a WebSocket message): its id (`X-Request-Id` / `x-request-id` when the client sent
  a sane one, else a new one), its span when tracing is on (`service.core.tracing`), and at
  its end one access line on the `multihead.access` logger (unless `--no-access-log`), with the
  protocol, method, route (the endpoint's name), path (never the query), status, latency,
  tenant, bot and version. The core fills in tenant, bot and version as it learns them
  (`note`), without knowing which transport serves the request.
- Every line is scrubbed (`scrub`) before it is written: bearer and basic credentials, API
  keys (`mhk_<id>_<secret>` keeps only `mhk_<id>_`), `authorization`/`token`/`api_key`/
  `password`-like `name=value` pairs, the secrets registered by the service (the operator
  token), and long `bytes` literals (`b'...'`, as image bytes would appear in a message). No
  line ever holds a request body or header values beyond the request id.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

from service.core.tracing import (
    BOT,
    REQUEST_ID,
    TENANT,
    VERSION,
    Tracing,
    head_attributes,
    span_ids,
)

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "multihead.access"
REQUEST_ID_HEADER = "X-Request-Id"
# The keys of every JSON line, in order (null where they do not apply).
JSON_KEYS = ("time", "level", "logger", "message", "request_id", "tenant", "bot", "status",
             "latency_ms")
# What the access line adds (trace_id and span_id when the request has a recording span).
ACCESS_KEYS = ("protocol", "method", "route", "path", "version", "remote")

access_log = logging.getLogger(ACCESS_LOGGER)

# A request id a client may choose: what proxies and tracers send (UUIDs, hex, base64-ish
# ids), short, nothing that could break a log line or a header.
_SANE_ID = re.compile(r"[A-Za-z0-9._:@+=/-]{1,128}")
_MAX_FIELD = 512  # longest path or bot list in an access line

# -- scrubbing ------------------------------------------------------------------------------

_SCRUBS = (
    # `Authorization: Bearer x`, `'authorization': 'x'`, `api_key=x`, `token: x`, ...
    (re.compile(r"(?i)\b(authorization|proxy-authorization|x-api-key|api[_-]?key|"
                r"access[_-]?token|token|password|passwd|secret)(['\"]?\s*[:=]\s*['\"]?)"
                r"(?:(?:bearer|basic)\s+)?(?!\*\*\*)[^\s'\",;}&]+"), r"\1\2***"),
    (re.compile(r"(?i)\b(bearer|basic)(\s+)(?!\*\*\*)[^\s'\",;}&]+"), r"\1\2***"),
    # API keys (accounts.tenants: mhk_<id>_<secret>): the id names the key, the rest is secret.
    (re.compile(r"\b(mhk_[0-9a-f]+_)[A-Za-z0-9_-]+"), r"\1***"),
    # bytes literals long enough to be content (an image, a body), not a short magic number
    (re.compile(r"""b'(?:[^'\\]|\\.){48,}'|b"(?:[^"\\]|\\.){48,}\""""), "b'<bytes elided>'"),
)
_known_secrets: set[str] = set()
_MIN_SECRET = 6  # shorter values would scrub ordinary words


def register_secret(value: str | None) -> None:
    """Never write `value` in a log line (the operator token): scrubbed wherever it appears."""
    if value and len(value) >= _MIN_SECRET:
        _known_secrets.add(value)


def scrub(text: str) -> str:
    """`text` without credentials or content bytes (see the module doc)."""
    for secret in _known_secrets:
        if secret in text:
            text = text.replace(secret, "***")
    for pattern, replacement in _SCRUBS:
        text = pattern.sub(replacement, text)
    return text


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\"\\]")


def printable(text: str, limit: int = _MAX_FIELD) -> str:
    """A client-chosen string (a path, a bot id) as a text line may show it: control
    characters, quotes and backslashes escaped (no forged lines), at most `limit` characters."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


# -- the request being served ---------------------------------------------------------------

def request_id(given: str | None) -> str:
    """The client's request id if it is sane (1-128 of `A-Za-z0-9._:@+=/-`), else a new one."""
    if given and _SANE_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


@dataclass(slots=True, eq=False)
class RequestLog:
    """What the access line of one request says, filled in as the request goes."""

    request_id: str
    protocol: str  # http, grpc, ws
    method: str  # the HTTP method; the gRPC method (/package.Service/Method); WS
    route: str  # the endpoint's name, as metrics label it
    path: str
    remote: str | None
    start_s: float  # time.perf_counter()
    tenant: str | None = None
    bot: str | None = None
    version: str | None = None
    status: int | None = None
    span: Any = None  # the request's span, when tracing is on

    def set_attribute(self, key: str, value: Any) -> None:
        """An attribute of the request's span (nothing when tracing is off)."""
        if self.span is not None:
            self.span.set_attribute(key, value)


_current: contextvars.ContextVar[RequestLog | None] = contextvars.ContextVar(
    "multihead_request", default=None)


def current() -> RequestLog | None:
    """The request the calling task serves, or None."""
    return _current.get()


def note(*, tenant: str | None = None, bots: Sequence[str] | None = None,
         heads: Sequence[Any] | None = None) -> None:
    """The core tells the request being served (if any) whom it is for: the tenant, the bots
    asked for, then the heads resolved (bots and versions). Goes to its access line and, when
    tracing is on, to its span (`multihead.tenant`, `multihead.bot`, `multihead.version`)."""
    req = _current.get()
    if req is None:
        return
    if tenant is not None:
        req.tenant = tenant
        req.set_attribute(TENANT, tenant)
    if bots is not None:
        req.bot = ",".join(bots)
        req.set_attribute(BOT, req.bot)
    if heads is not None:
        attributes = head_attributes(heads)
        req.bot, req.version = attributes[BOT], attributes[VERSION]
        if req.span is not None:
            req.span.set_attributes(attributes)


@contextlib.contextmanager
def request_scope(tracing: Tracing | None, log_access: bool, *, protocol: str, method: str,
                  route: str, path: str, headers: Mapping[str, Any] | None,
                  remote: str | None = None, span_name: str,
                  attributes: Mapping[str, Any] | None = None,
                  request_id_: str | None = None) -> Iterator[RequestLog]:
    """Around the serving of one request, in the task that serves it: its `RequestLog` (set
    its `status` before the block ends: the answer's HTTP status, or the one metrics give a
    gRPC outcome), its span when `tracing`, its access line when `log_access`.

    Args:
        headers: the request's headers or metadata (`x-request-id`, `traceparent`), any case
            the mapping's `get` finds lower-case names with; None for a WebSocket message
            (its span is then a child of the current one, its socket's).
        span_name: the span's name (`POST /classify/{bot_id}`, `/inference.GRPCInferenceService/
            ModelInfer`); `attributes` its semantic-convention attributes.
        request_id_: the id to use (a WebSocket message's); default from `headers`.
    An exception escaping the block without a status is 499 (cancelled: the client left) or
    500.
    """
    rid = request_id_ or request_id(headers.get("x-request-id") if headers is not None else None)
    req = RequestLog(rid, protocol, method, route, path, remote, time.perf_counter())
    token = _current.set(req)
    span_token = None
    if tracing is not None:
        req.span, span_token = tracing.start_request(
            span_name, headers, kind="server", attributes={**(attributes or {}), REQUEST_ID: rid})
    try:
        yield req
    except asyncio.CancelledError:
        if req.status is None:
            req.status = 499
        raise
    except BaseException:
        if req.status is None:
            req.status = 500
        raise
    finally:
        status = req.status if req.status is not None else 500
        latency_ms = (time.perf_counter() - req.start_s) * 1000
        try:
            if log_access and access_log.isEnabledFor(logging.INFO):
                _log_access(req, status, latency_ms)
        finally:
            if tracing is not None:
                end = ({"http.response.status_code": status} if protocol != "grpc" else {})
                tracing.end_request(req.span, span_token, error=status >= 500, attributes=end)
            _current.reset(token)


def _log_access(req: RequestLog, status: int, latency_ms: float) -> None:
    fields = {"request_id": req.request_id, "tenant": req.tenant, "bot": req.bot,
              "status": status, "latency_ms": round(latency_ms, 3), "protocol": req.protocol,
              "method": req.method, "route": req.route, "path": req.path,
              "version": req.version, "remote": req.remote}
    extra = f" tenant={printable(req.tenant)}" if req.tenant else ""
    if req.bot:
        extra += f" bot={printable(req.bot)}"
    access_log.info('%s "%s %s" %d %.1fms request_id=%s%s', req.remote or "-", req.method,
                    printable(req.path), status, latency_ms, req.request_id, extra,
                    extra={"access": fields})


# -- formats ----------------------------------------------------------------------------------

class TextFormatter(logging.Formatter):
    """The text lines (`TEXT_FORMAT`), scrubbed."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line (the keys of `JSON_KEYS`, the access line's `ACCESS_KEYS`,
    `trace_id`/`span_id`, `exception`), every string scrubbed, ASCII only."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC)
        out: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name,
            "message": scrub(record.getMessage()),
            "request_id": None, "tenant": None, "bot": None, "status": None, "latency_ms": None,
        }
        fields = getattr(record, "access", None)
        req = _current.get()
        if fields is not None:
            out.update({k: scrub(_cap(v)) if isinstance(v, str) else v
                        for k, v in fields.items()})
        elif req is not None:  # a line logged while serving a request
            out.update(request_id=req.request_id, tenant=req.tenant, bot=req.bot)
        if req is not None and req.span is not None:
            ids = span_ids(req.span)
            if ids is not None:
                out["trace_id"], out["span_id"] = ids
        if record.exc_info:
            out["exception"] = scrub(self.formatException(record.exc_info))
        if record.stack_info:
            out["stack"] = scrub(self.formatStack(record.stack_info))
        return json.dumps(out, ensure_ascii=True, default=str)


def _cap(text: str) -> str:
    return text if len(text) <= _MAX_FIELD else text[:_MAX_FIELD] + "..."


def configure(log_format: str, level: str | int = "INFO", *,
              stream: IO[str] | None = None) -> logging.Handler:
    """The process's logging: one handler on `stream` (stderr) in `log_format` (`FORMATS`) at
    `level`, replacing the root logger's handlers. Returns the handler."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler
