"""OpenTelemetry tracing of requests, off unless asked for.

Off (the default), nothing here imports OpenTelemetry: `Tracing.configure` returns None, a
`Service` keeps `tracing = None`, and each hook on the request path is one `is None` test
(`span(None, ...)` hands back one shared no-op context). On, a `Tracing` holds a tracer provider
of the SDK (the `otel` extra) and makes these spans:

- the request, a SERVER span per HTTP request, gRPC call and WebSocket message, made by the
  transports (`service.core.logs.request_scope`), child of the W3C `traceparent` the client
  sent (HTTP header, gRPC metadata; `opentelemetry.propagate`, so `OTEL_PROPAGATORS` applies);
  a WebSocket message's span is a child of its socket's request span;
- under it, made by the engine: `admission` (the tenant's quota and the queue room of the
  request's rows), `decode` (the cache misses, in the decode pool), `queue_wait` (from the rows
  queued to the batch taking them; one per batch the request has rows in) and `heads` (scoring);
- `trunk_batch`, one per trunk run: the root of a trace of its own, LINKED to the request span
  of every row in it (a batch serves many traces); each `queue_wait` links back to it.

Spans made in the batcher's worker thread get their parent from the row (`RowTrace`, on the
row's payload), never from context variables: the thread serves every request in turn.

Configuration is OpenTelemetry's own: tracing is on when `--tracing` (`MULTIHEAD_TRACING`) or,
unset, `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`; `none` or unset: off), and
`OTEL_SDK_DISABLED=true` turns it off whatever they say. The rest is read by the SDK itself:
the resource (`OTEL_SERVICE_NAME`, default `multihead`; `OTEL_RESOURCE_ATTRIBUTES`), the
sampler (`OTEL_TRACES_SAMPLER[_ARG]`), the batch processor (`OTEL_BSP_*`) and the OTLP/HTTP
exporter (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, `..._HEADERS`, `..._TIMEOUT`, ...).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from service.core.errors import ServiceError

EXPORTERS = ("otlp", "console", "none")  # what --tracing / OTEL_TRACES_EXPORTER may name
DEFAULT_SERVICE_NAME = "multihead"
SCOPE = "multihead"  # the instrumentation scope of every span

# Span names (docs/deployment.md#tracing).
ADMISSION, DECODE, QUEUE_WAIT, HEADS, TRUNK_BATCH = (
    "admission", "decode", "queue_wait", "heads", "trunk_batch")

# Attributes of our own, namespaced (OpenTelemetry's semantic conventions for the rest).
TENANT, BOT, VERSION = "multihead.tenant", "multihead.bot", "multihead.version"
REQUEST_ID = "multihead.request_id"
IMAGES = "multihead.images"  # images a span works on (decode: the cache misses)
BATCH_SIZE, BATCH_ROWS = "multihead.batch.size", "multihead.batch.rows"
BATCH_TRUNK_IMAGES, BATCH_REQUESTS = "multihead.batch.trunk_images", "multihead.batch.requests"
BATCH_TENANTS = "multihead.batch.tenants"

OTEL_HINT = "pip install 'multihead[otel]'"
_TRUE = "true"


def exporters(setting: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The span exporters to run: `setting` (--tracing) if given, else OTEL_TRACES_EXPORTER
    (a comma-separated list); () when tracing is off (unset, `none`, or OTEL_SDK_DISABLED=true).

    NOTE: OpenTelemetry's default for an unset OTEL_TRACES_EXPORTER is `otlp`; here unset is
    off, so that a server never starts exporting to a collector nobody configured.

    Raises:
        ServiceError: an exporter other than otlp, console or none.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == _TRUE:
        return ()
    raw = setting if setting is not None else environ.get("OTEL_TRACES_EXPORTER", "")
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    if "none" in names:
        return ()
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ServiceError(f"OTEL_TRACES_EXPORTER: exporter {unknown[0]!r} is not served "
                           f"here; use otlp (OTLP over HTTP), console or none")
    return names


def span(tracing: Tracing | None, name: str, attributes: Mapping[str, Any] | None = None, *,
         heads: Sequence[Any] = ()) -> contextlib.AbstractContextManager:
    """A child span of the current one around a block, with `attributes` and those of the
    `heads` (`head_attributes`, worked out only when traced); a no-op when tracing is off."""
    if tracing is None:
        return _NO_SPAN
    if heads:
        attributes = {**(attributes or {}), **head_attributes(heads)}
    return tracing.span(name, attributes)


def head_attributes(heads: Sequence[Any]) -> dict[str, str]:
    """`multihead.bot` and `multihead.version` of the heads a request is scored with (several
    comma-separated, in the request's order)."""
    return {BOT: ",".join(h.bot_id for h in heads),
            VERSION: ",".join(str(h.version) for h in heads)}


def span_ids(span_: Any) -> tuple[str, str] | None:
    """(trace id, span id) of a span in hex, as logs show them; None for an invalid one."""
    ctx = span_.get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


@dataclass(slots=True, eq=False)
class RowTrace:
    """What a request's rows carry to the batch thread: the request span (parent of the spans
    made there, and the target of the batch's link), when its rows were queued, its tenant."""

    context: Any  # opentelemetry Context holding the request span
    span_context: Any  # its SpanContext, for links
    queued_ns: int
    tenant: str


class Tracing:
    """The tracer of one `Service` over a tracer provider of the OpenTelemetry SDK.

    Args:
        provider: the SDK's TracerProvider (tests pass one with an in-memory exporter).
        owned: shut the provider down (flush its spans) in `shutdown()`; a provider given by
            the caller stays the caller's.
    """

    def __init__(self, provider: Any, *, owned: bool = False) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import propagate, trace

        self.provider = provider
        self.tracer = provider.get_tracer(SCOPE)
        self._owned = owned
        self._context = otel_context
        self._propagate = propagate
        self._trace = trace
        self.status_error = trace.StatusCode.ERROR

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def configure(cls, setting: str | None,
                  environ: Mapping[str, str] = os.environ) -> Tracing | None:
        """The tracing of a serving process from --tracing and the OTEL_* variables (see the
        module doc), or None when off (and then nothing of OpenTelemetry is imported).

        Raises:
            ServiceError: an unknown exporter, an OTLP protocol not installed, or tracing on
                without the otel extra.
        """
        names = exporters(setting, environ)
        if not names:
            return None
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        except ImportError as exc:
            raise ServiceError(f"tracing ({', '.join(names)}) needs the OpenTelemetry SDK "
                               f"({exc.name} is missing): {OTEL_HINT}") from None
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            # Neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES named the service.
            resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
        # The sampler (OTEL_TRACES_SAMPLER) and span limits come from the environment.
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        for name in names:
            exporter = _otlp_exporter(environ) if name == "otlp" else ConsoleSpanExporter()
            provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* apply
        return cls(provider, owned=True)

    def shutdown(self) -> None:
        """Flushes and stops the exporters of a provider this tracing owns. Blocking."""
        if self._owned:
            self.provider.shutdown()

    # -- the request span (the transports, through service.core.logs.request_scope) ---------

    def start_request(self, name: str, carrier: Mapping[str, Any] | None, *, kind: str,
                      attributes: Mapping[str, Any]) -> tuple[Any, object]:
        """Starts a request's span and makes it current; returns (span, token for
        `end_request`). Its parent is the `traceparent` in `carrier` (headers or metadata,
        names lower-case), none if absent or malformed; `carrier=None`: the current span (a
        WebSocket message under its socket)."""
        parent = (self._context.get_current() if carrier is None
                  else self._propagate.extract(carrier))
        span_ = self.tracer.start_span(name, context=parent, kind=_kind(self._trace, kind),
                                       attributes=attributes)
        token = self._context.attach(self._trace.set_span_in_context(span_, parent))
        return span_, token

    def end_request(self, span_: Any, token: object, *, error: bool,
                    attributes: Mapping[str, Any]) -> None:
        """Ends a request's span (status ERROR when `error`: a 5xx answer) and restores the
        context that was current before it."""
        try:
            span_.set_attributes(attributes)
            if error:
                span_.set_status(self.status_error)
            span_.end()
        finally:
            self._context.detach(token)

    def carrier(self) -> dict[str, str]:
        """The current span's context as headers (`traceparent`): what a request served in
        another process carries to have its span under this one (a WebSocket message under
        its socket, on Ray)."""
        out: dict[str, str] = {}
        self._propagate.inject(out)
        return out

    # -- spans of the engine -----------------------------------------------------------------

    def span(self, name: str,
             attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager:
        """A child span of the current one, current inside the block; an exception escaping
        the block is recorded and sets its status to ERROR."""
        return self.tracer.start_as_current_span(name, attributes=attributes)

    def row_trace(self, tenant: str) -> RowTrace:
        """What the request's rows carry to the batch thread (call it as they are queued)."""
        context = self._context.get_current()
        span_context = self._trace.get_current_span(context).get_span_context()
        return RowTrace(context, span_context, time.time_ns(), tenant)

    def batch(self, traces: Sequence[RowTrace | None], heads_of: Sequence[Sequence[Any]],
              trunk_images: int) -> BatchTrace:
        """The spans of one trunk run, for the batch's worker thread (a context manager
        around the run): row i carries `traces[i]` and is scored with the heads
        `heads_of[i]`; `trunk_images` of the rows run through the trunk (the others' features
        were cached)."""
        return BatchTrace(self, traces, heads_of, trunk_images)


class BatchTrace:
    """The spans of one batch, made in the worker thread: on entry `trunk_batch` (linked to
    each request span) and each request's `queue_wait`; `heads()` around the scoring makes
    each request's `heads` span; on exit `trunk_batch` ends (ERROR if the run raised)."""

    def __init__(self, tracing: Tracing, traces: Sequence[RowTrace | None],
                 heads_of: Sequence[Sequence[Any]], trunk_images: int) -> None:
        self._tracing = tracing
        self._rows = len(traces)
        self._trunk_images = trunk_images
        # The requests in this batch, in order of their first row: (trace, its heads, rows).
        self._requests: dict[int, tuple[RowTrace, Sequence[Any], int]] = {}
        for trace, heads in zip(traces, heads_of):
            if trace is not None:
                _, _, n = self._requests.get(id(trace), (trace, heads, 0))
                self._requests[id(trace)] = (trace, heads, n + 1)
        self._span: Any = None

    def __enter__(self) -> BatchTrace:
        from opentelemetry.trace import Link

        tracer, start_ns = self._tracing.tracer, time.time_ns()
        requests = list(self._requests.values())
        self._span = tracer.start_span(
            TRUNK_BATCH, context=_ROOT.get(), start_time=start_ns,
            links=[Link(t.span_context, {TENANT: t.tenant, BATCH_ROWS: n})
                   for t, _, n in requests],
            attributes={BATCH_SIZE: self._rows, BATCH_TRUNK_IMAGES: self._trunk_images,
                        BATCH_REQUESTS: len(requests),
                        BATCH_TENANTS: sorted({t.tenant for t, _, _ in requests})})
        to_batch = [Link(self._span.get_span_context())]
        for trace, _, n in requests:
            tracer.start_span(QUEUE_WAIT, context=trace.context, start_time=trace.queued_ns,
                              links=to_batch,
                              attributes={TENANT: trace.tenant, BATCH_ROWS: n,
                                          BATCH_SIZE: self._rows}).end(end_time=start_ns)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None:
            self._span.record_exception(exc)
            self._span.set_status(self._tracing.status_error, type(exc).__name__)
        self._span.end()

    @contextlib.contextmanager
    def heads(self) -> Iterator[None]:
        """Around the scoring: then one `heads` span per request, child of its request span,
        spanning the batch's scoring."""
        start_ns = time.time_ns()
        yield
        end_ns = time.time_ns()
        tracer = self._tracing.tracer
        for trace, heads, n in self._requests.values():
            tracer.start_span(HEADS, context=trace.context, start_time=start_ns,
                              attributes={**head_attributes(heads), TENANT: trace.tenant,
                                          BATCH_ROWS: n}).end(end_time=end_ns)


class NoBatch:
    """`BatchTrace` when tracing is off: nothing at all."""

    def __enter__(self) -> NoBatch:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def heads(self) -> contextlib.AbstractContextManager:
        return _NO_SPAN


NO_BATCH = NoBatch()
_NO_SPAN = contextlib.nullcontext()


class _Root:
    """An empty opentelemetry Context (a span started in it is the root of a new trace),
    made on first use so that this module imports nothing of OpenTelemetry by itself."""

    _context: Any = None

    def get(self) -> Any:
        if self._context is None:
            from opentelemetry.context import Context

            self._context = Context()
        return self._context


_ROOT = _Root()


def _kind(trace: Any, kind: str) -> Any:
    return trace.SpanKind.SERVER if kind == "server" else trace.SpanKind.INTERNAL


def _otlp_exporter(environ: Mapping[str, str]) -> Any:
    """The OTLP/HTTP span exporter (it reads its endpoint, headers, timeout and compression
    from the environment itself); another OTLP protocol is refused."""
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    if protocol != "http/protobuf":
        raise ServiceError(f"OTLP protocol {protocol!r} is not served here: the otel extra "
                           f"exports OTLP over HTTP (http/protobuf)")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ServiceError(f"the otlp exporter needs {exc.name}: {OTEL_HINT}") from None
    return OTLPSpanExporter()
