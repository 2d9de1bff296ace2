"""Operations: `GET /healthz` (the process answers), `GET /readyz` (the trunk is loaded and
warm; 503 with the reason otherwise: the full report for who may read metrics) and
`GET /metrics` (Prometheus text format)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from service.codecs.base import Answer, Endpoint, Reply, Request, json_answer, json_reply
from service.core.auth import METRICS, PUBLIC

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller


async def healthz(service: Caller, request: Request) -> Reply:
    return json_reply({"status": "alive"})


async def readyz(service: Caller, request: Request) -> Reply:
    """The full report for who may read /metrics (the operator, a metrics key, anyone with
    --auth none); else only the status, for probes (no checkpoint path, no timings)."""
    report = service.readiness_report() if service.may(METRICS) else {"status": service.status}
    return json_reply(report, status=200 if service.ready else 503)


async def metrics(service: Caller, request: Request) -> Reply:
    """The Prometheus text: a key's caller reads its own tenant's series only. The reply
    carries that scope for a transport that rebuilds the body (the Ray ingress's merge)."""
    body, content_type = service.render_metrics()
    return Reply(200, body, content_type, scope=service.metrics_scope)


# -- API description ---------------------------------------------------------------------------

CALIBRATION_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["digest", "images", "description", "date", "min_cosine", "passed"],
    "description": "the images `multihead quantize` calibrated the int8 trunk on, when, and "
                   "the fidelity it measured on held-out images (passed: within the bounds; "
                   "false: written with --force)",
    "properties": {"digest": {"type": "string"},
                   "images": {"type": "integer", "minimum": 1},
                   "description": {"type": "string"},
                   "date": {"type": "string", "format": "date-time"},
                   "min_cosine": {"type": "number"},
                   "passed": {"type": "boolean"}}}

_SHARE = {"type": "number", "minimum": 0, "maximum": 1, "nullable": True}
GATE_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["passed", "images", "heads", "lowest_head", "min_agreement",
                 "overall_agreement", "mean_cosine", "min_cosine", "bounds", "failures"],
    "description": "the gate of the INT8 trunk the choice judged (the one run, else the newest "
                   "passed over): on its held-out images, every head's top-1 agreement with "
                   "the float trunk, all heads' answers together, and the mean cosine of the "
                   "features, against their bounds (the min cosine is reported, not gated); "
                   "each bot's agreement is in GET /bots/{bot_id}",
    "properties": {"passed": {"type": "boolean"},
                   "images": {"type": "integer", "minimum": 1},
                   "heads": {"type": "integer", "minimum": 0,
                             "description": "the active bots judged (0: the mean cosine alone "
                                            "decides)"},
                   "lowest_head": {"type": "string", "nullable": True},
                   "min_agreement": {**_SHARE, "description": "the lowest head's agreement"},
                   "overall_agreement": {**_SHARE, "description": "all heads' answers"},
                   "mean_cosine": {"type": "number"},
                   "min_cosine": {"type": "number"},
                   "bounds": {"type": "object", "additionalProperties": {"type": "number"}},
                   "failures": {"type": "integer", "minimum": 0,
                                "description": "bounds not met (one per failing head)"}}}

PROFILE_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["batch_ms", "source", "measured_at", "repeats", "measure_s"],
    "description": "the trunk's time per batch alone, by batch size (1, 2, 4, ... and "
                   "max_batch_size): the median of `repeats` runs of a fixed batch after a "
                   "discarded first run, measured at warm-up (source measured) or loaded from "
                   "graph_cache/ next to the trunk checkpoint where this trunk, its libraries, "
                   "this CPU model and these cores were measured before (source cached); "
                   "absent with --no-warmup and no saved profile",
    "properties": {"batch_ms": {"type": "object",
                                "additionalProperties": {"type": "number", "minimum": 0},
                                "description": "batch size -> milliseconds per batch"},
                   "source": {"type": "string", "enum": ["measured", "cached"]},
                   "measured_at": {"type": "string", "format": "date-time"},
                   "repeats": {"type": "integer", "minimum": 1},
                   "measure_s": {"type": "number", "minimum": 0,
                                 "description": "seconds the measurement took"}}}

IN_SERVER_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["batch_ms", "batches"],
    "description": "the trunk's time per batch inside this server so far, by batch size (under "
                   "load: compare with `profile`, its time alone); absent before the first batch",
    "properties": {"batch_ms": {"type": "object",
                                "additionalProperties": {"type": "number", "minimum": 0},
                                "description": "batch size -> mean milliseconds per batch"},
                   "batches": {"type": "object",
                               "additionalProperties": {"type": "integer", "minimum": 1},
                               "description": "batch size -> batches run"}}}

READINESS_SCHEMA = {
    "title": "Readiness", "type": "object", "additionalProperties": False,
    "required": ["status"],
    "description": "the status alone, unless the caller may read /metrics (the operator, a "
                   "key of scope metrics, anyone with --auth none); a tenant's key reads its "
                   "own bots only (pinned, preloaded, skipped) and no trunk `gate`, `why` nor "
                   "`in_server` (they count or name every tenant's heads and batches)",
    "properties": {
        "status": {"type": "string", "enum": ["loading", "ready", "failed"]},
        "trunk": {"type": "object", "required": ["weights"],
                  "description": "the trunk's weights (official, demo or custom) and, once "
                                 "built, its checkpoint, device, runtime and precision and why; "
                                 "an int8 trunk also the precision of its float layers and its "
                                 "calibration set; the gate of an INT8 trunk judged; once "
                                 "warm, its batch profile (time alone); once it ran, its "
                                 "time per batch inside the server",
                  "properties": {"weights": {"type": "string"},
                                 "checkpoint": {"type": "string"},
                                 "device": {"type": "string"},
                                 "runtime": {"type": "string"},
                                 "precision": {"type": "string"},
                                 "float_precision": {"type": "string"},
                                 "calibration": CALIBRATION_SCHEMA,
                                 "why": {"type": "string",
                                         "description": "the precision and why it was chosen "
                                                        "(\"int8: gate passed for 3 heads "
                                                        "...\", \"bf16: the INT8 trunk's "
                                                        "gate fails for head 'x' ...\")"},
                                 "gate": GATE_SCHEMA,
                                 "profile": PROFILE_SCHEMA,
                                 "in_server": IN_SERVER_SCHEMA}},
        "timings": {"type": "object", "additionalProperties": {"type": "number"},
                    "description": "bring-up steps in seconds: import_s (the runtime's "
                                   "packages: no TensorFlow where the compiled trunk is cached "
                                   "or INT8), build_s, restore_s, compile_s (or the compiled "
                                   "trunk's import from the cache), warmup_s (measuring the "
                                   "batch profile included, where it is not saved yet), "
                                   "preload_s, ready_s (the service's creation to ready)"},
        "heads": {"type": "object", "additionalProperties": False,
                  "required": ["pinned", "preloaded"],
                  "description": "heads loaded before ready: the pinned bots (`--pin`), and "
                                 "how many of the most recently registered (`--preload`) were "
                                 "loaded (and skipped: over the heads memory budget)",
                  "properties": {"pinned": {"type": "array", "items": {"type": "string"}},
                                 "preloaded": {"type": "integer", "minimum": 0},
                                 "preload_skipped": {"type": "integer", "minimum": 0}}},
        "store": {"type": "object", "additionalProperties": False,
                  "required": ["kind", "read", "snapshot_age_s", "serving_processes"],
                  "description": "the store requests are served from: its kind, whether its "
                                 "snapshot (bots, owners, keys, limits, candidates) was read, "
                                 "seconds since it was last confirmed current (it grows "
                                 "while the store cannot be read), and the processes serving "
                                 "it (live leases; outside Ray each enforces 1/N of a "
                                 "tenant's quota)",
                  "properties": {"kind": {"type": "string", "enum": ["sqlite", "postgresql"]},
                                 "read": {"type": "boolean"},
                                 "snapshot_age_s": {"type": "number", "minimum": 0},
                                 "serving_processes": {"type": "integer", "minimum": 1}}},
        "replica": {"type": "object",
                    "description": "under Ray (`serve --ray`): the model replica that answered "
                                   "(its Ray id and process id)",
                    "properties": {"replica": {"type": "string"}, "pid": {"type": "integer"}}},
        "error": {"type": "string", "description": "why the bring-up failed"}}}

ENDPOINTS = [
    Endpoint("GET", "/healthz", "healthz", healthz, access=PUBLIC,
             summary="liveness: the process answers",
             tag="operations",
             answers={200: json_answer("the process is alive", {
                 "type": "object", "additionalProperties": False, "required": ["status"],
                 "properties": {"status": {"type": "string", "enum": ["alive"]}}})}),
    Endpoint("GET", "/readyz", "readyz", readyz, access=PUBLIC,
             summary="readiness: trunk loaded and warm (503 while loading or after a failure)",
             tag="operations",
             answers={200: json_answer("ready: the trunk is warm and the pinned and preloaded "
                                       "heads are resident", READINESS_SCHEMA),
                      503: json_answer("loading, or the bring-up failed (see `error`)",
                                       READINESS_SCHEMA)}),
    Endpoint("GET", "/metrics", "metrics", metrics, access=METRICS, summary="Prometheus metrics",
             description="The operator (and --auth none) reads every series. A tenant's "
                         "metrics key reads only the series labelled with its own tenant or "
                         "its own bots (never tenant=\"other\" nor bot=\"other\") and the "
                         "machine's facts (multihead_trunk_info, multihead_trunk_alone_seconds, "
                         "multihead_store_snapshot_age_seconds, the Ray replica counts); the "
                         "process-wide traffic series (requests by route, latencies, batches, "
                         "queue depth, cache hits) count every tenant and are the operator's.",
             tag="operations",
             answers={200: Answer("the Prometheus text exposition format",
                                  {"text/plain": {"type": "string"}})}),
]
