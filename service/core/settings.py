"""The service's one settings object: built from `MULTIHEAD_*` environment variables and CLI
flags (flags win), validated once at startup, then passed explicitly. Nothing else in the
service reads the environment, but for OpenTelemetry's own `OTEL_*` variables, which its SDK
reads where tracing is set up (`service.core.tracing`).

    settings = Settings.from_env_and_args(args)      # args from `multihead serve ...`

`Settings` holds what one server process serves with; its `deployment` field, a `Deployment`,
how `multihead serve --ray` deploys that process on Ray Serve. Users see one flat list: one flag
and one variable per field of either (`--replicas`, `MULTIHEAD_REPLICAS`).

Where each piece lives:
- a field's constraints are its metadata (`setting(default, help, at_least=1, ...)`, checked by
  the functions of `service.core.setting_fields.CONSTRAINTS`); `validate` checks every field in
  one loop, then the few rules between fields (`RULES`, `DEPLOYMENT_RULES`, here);
- every setting resolves one way, `Settings.resolve`: flag, else environment, else default. The
  other commands' shared options (`cli.options`) resolve through it too;
- what a log, a message or a status page may show of a value is
  `service.core.setting_fields.public_value` (a secret as ***, a URL without its password), used
  by messages, `repr` and `public_dict` alike.

This module declares the fields (`Settings`, `Deployment`) and the rules between them;
`service.core.setting_fields` holds what any field is: its declaration, parsing, checks and
redaction.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from backbone.precision import PRECISION_CHOICES, RUNTIME_CHOICES, precision_help, runtime_help
from heads import InvalidBotId, validate_bot_id
from service.core.auth import AUTH_MODES
from service.core.batcher import POLICIES as BATCH_POLICIES
from service.core.fair import SCHEDULERS
from service.core.logs import FORMATS as LOG_FORMATS
from service.core.setting_fields import (
    GROUP,
    InvalidSettings,
    add_flags,
    check_value,
    parse_text,
    public_fields,
    setting,
    shown,
    validate_fields,
)
from service.core.tracing import EXPORTERS

# Whose images share the feature cache's entries (`service.core.engine.cache_key`).
FEATURE_CACHE_SCOPES = ("tenant", "shared")

log = logging.getLogger(__name__)

ENV_PREFIX = "MULTIHEAD_"
MIB = 1024 * 1024


def _device(name: str, value: str) -> str | None:
    if value in ("auto", "cpu", "gpu"):
        return None
    head, _, index = value.partition(":")
    if head == "gpu" and index.isascii() and index.isdigit():
        return None
    return f"{name} must be auto, cpu, gpu or gpu:N, got {value!r}"


def _token(name: str, value: str) -> str | None:
    if value and not any(c.isspace() for c in value):
        return None
    return f"{name} must be non-empty and contain no whitespace"  # NOTE: never the token itself


def _bot_list(name: str, value: str) -> str | None:
    for bot_id in _bot_ids(value):
        try:
            validate_bot_id(bot_id)
        except InvalidBotId as exc:
            return f"{name}: {exc}"
    return None


# -- the Ray Serve deployment -------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """How `multihead serve --ray` deploys the service on Ray Serve (read only under --ray; see
    service/transports/ray/serve.py): replica count or autoscaling range, per-replica
    resources, the ingress, the cluster. Validated at construction, like `Settings`."""

    replicas: int = setting(
        1, "Ray Serve replicas (a fixed count; see --max-replicas)", at_least=1)
    ray_address: str | None = setting(
        None,
        "Ray cluster to deploy to (e.g. auto, or ray://head:10001); unset starts a local "
        "Ray for this process",
        url=True)
    min_replicas: int | None = setting(
        None, "autoscaling: fewest replicas (unset: --replicas); with --max-replicas",
        at_least=0)
    max_replicas: int | None = setting(
        None,
        "autoscaling: most replicas; set, it turns Ray Serve's autoscaling on between "
        "--min-replicas and this, driven by --target-ongoing-requests",
        at_least=1)
    target_ongoing_requests: float = setting(
        16.0, "autoscaling: requests in flight per replica that Ray aims at", above=0)
    max_ongoing_requests: int = setting(
        64,
        "requests one Ray replica takes at once (Ray's own default of 5 would starve the "
        "cross-bot batcher); beyond it Ray's proxy queues them",
        at_least=1)
    ingress_replicas: int = setting(
        1,
        "Ray Serve ingress replicas: light processes (no TensorFlow) that take requests "
        "from Ray's proxy and hand them to the model replicas, retrying on another replica "
        "when one dies mid-request",
        at_least=1)
    replica_cpus: float = setting(1.0, "CPUs Ray reserves for each replica", at_least=0)
    replica_gpus: float = setting(
        0.0, "GPUs Ray reserves for each replica; a fraction shares one GPU", at_least=0)

    def __post_init__(self) -> None:
        validate_fields(self, DEPLOYMENT_RULES)

    @property
    def fewest_replicas(self) -> int:
        """The low end of the autoscaling range: min_replicas, else replicas."""
        return self.min_replicas if self.min_replicas is not None else self.replicas


# -- the settings of one server process ---------------------------------------------------------


@dataclass(frozen=True, repr=False)  # `__repr__` below: never a secret
class Settings:
    """Every option of `multihead serve`, with safe defaults.

    Construct it with `Settings.from_env_and_args(...)`, or directly in tests
    (`Settings(max_batch_size=4)`, `Settings(deployment=Deployment(replicas=2))`); construction
    validates and raises `InvalidSettings` (a ValueError) naming the field and the value.
    """

    host: str = setting("127.0.0.1", "address to listen on", non_empty=True)
    port: int = setting(8080, "TCP port to listen on (0 picks a free port)",
                        at_least=0, at_most=65535)
    grpc_port: int | None = setting(
        None,
        "TCP port of the gRPC listener on --host: KServe v2 / Triton GRPCInferenceService "
        "and TF Serving PredictionService + ModelService, same engine and batcher as HTTP "
        "(8001 is Triton's convention; 0 picks a free port). Unset: no gRPC, since it is "
        "one more listener to expose and secure and needs the grpc extra "
        "(pip install 'multihead[grpc]')",
        at_least=0, at_most=65535)
    store: str = setting(
        "checkpoints",
        "the registered bots: a store directory (holding trunk/ and heads/), or a "
        "postgresql://user@host:port/db URL shared by many processes and machines (then "
        "--trunk-checkpoint is required)",
        non_empty=True, url=True)
    trunk_checkpoint: str | None = setting(
        None, "trunk checkpoint prefix; unset means the trunk inside --store", non_empty=True)
    device: str = setting("auto", "where the trunk runs: auto, cpu, gpu or gpu:N", check=_device)
    # Choices and help from the runner registry (`backbone.runners.registry`): the choices are
    # live, so a runner registered later (a plugin, a test's fake) is accepted and listed.
    precision: str = setting("auto", precision_help(), choices=PRECISION_CHOICES)
    runtime: str = setting("auto", runtime_help(), choices=RUNTIME_CHOICES)
    max_batch_size: int = setting(
        16, "most images in one trunk batch (any mix of bots)", at_least=1)
    batch_from_profile: bool = setting(
        True,
        "the batch size is the smallest of the trunk's batch profile within 5 % of its best "
        "images/s, at most --max-batch-size (a longer one costs every waiting request its "
        "length for less); at saturation (--scheduler fair, no light tenant, more images "
        "queued than that, no deadline close) a batch takes up to --max-batch-size; off, or "
        "without a profile: --max-batch-size")
    shared_batch_ms: float | None = setting(
        None,
        "with --scheduler fair, while more than one tenant sent images within the last "
        "second and one of them has few waiting (a light tenant), a trunk batch takes, for "
        "each tenant with images waiting, the images the batch profile runs within this many "
        "ms (at least one), and a batch carrying the light tenant's images up to twice that: "
        "a quiet tenant's request waits for a short batch beside another's flood, at the cost "
        "of some of the heavy tenant's throughput meanwhile; unset: 1.5 x the profile's batch "
        "of one; 0 or without a profile: full batches", at_least=0)
    max_wait_ms: float = setting(
        5.0, "longest a batch waits for more images after its first one, in ms", at_least=0)
    max_queue_rows: int = setting(
        256, "most images waiting for the trunk; beyond it: 503 + Retry-After", at_least=1)
    request_timeout_s: float = setting(
        30.0, "deadline of one request, in seconds (504 when it passes)", above=0)
    cancel_on_disconnect: bool = setting(
        True,
        "cancel a request whose client disconnects (HTTP and WebSocket): its images still "
        "queued for the trunk are withdrawn and /metrics counts it with status 499. Off, it "
        "runs to its end and its answer is dropped: the comparison of `multihead bench "
        "--sections cancellation`, and an escape hatch. gRPC calls end with their client "
        "either way; under --ray, Ray's proxy decides")
    max_body_bytes: int = setting(
        20 * MIB, "largest accepted request body, in bytes (413 beyond)", at_least=1)
    max_inflight_bytes: int = setting(
        256 * MIB,
        "budget of request bytes in flight across all requests (bodies being read or "
        "served, plus each open WebSocket's message size); a request that does not fit is "
        "refused BEFORE its body is read: 429 inflight_share + Retry-After for a tenant beyond "
        "its weighted share of it among the tenants holding bytes (alone: all of it), 503 "
        "overloaded for a request without a tenant; one within its share pushes out an unread "
        "body or a WebSocket of a tenant over its share when it is full")
    max_ws_message_bytes: int = setting(
        4 * MIB,
        "largest WebSocket message (one image), in bytes; each open socket holds this much "
        "of the in-flight budget",
        at_least=1)
    # -- connection limits (issue 34, item 5) --
    header_timeout_s: float = setting(
        10.0,
        "longest an HTTP request's line and headers may take to arrive, from the connection's "
        "first byte (or the end of its previous request): 408 request_timeout and the "
        "connection closed beyond it; 0 turns it off", at_least=0)
    body_min_rate_bytes_s: int = setting(
        16 * 1024,
        "slowest an HTTP request body may arrive, in bytes/s on average after "
        "`body_grace_s`: a slower body is answered 408 request_timeout and its connection "
        "closed; 0 turns it off", at_least=0)
    body_grace_s: float = setting(
        5.0, "how long a body may arrive at any pace before `body_min_rate_bytes_s` applies",
        at_least=0)
    max_websockets: int = setting(
        32,
        "most WebSockets open at once in this process; a tenant opens at most its weighted "
        "share of them among the tenants with sockets open (429 socket_share beyond it), and "
        "one within its share closes the newest socket of a tenant over its share when all "
        "are taken", at_least=1)
    max_grpc_calls: int = setting(
        64,
        "most gRPC calls in flight at once in this process; a tenant runs at most its "
        "weighted share of them among the tenants with calls in flight (RESOURCE_EXHAUSTED "
        "call_share beyond it), and one within its share cancels the newest call of a tenant "
        "over its share when all are taken", at_least=1)
    max_image_pixels: int = setting(
        40_000_000, "largest decoded image, in pixels (413 beyond; decompression-bomb guard)",
        at_least=1)
    max_images_per_request: int = setting(
        32, "most images in one request (413 beyond)", at_least=1)
    top_k_default: int = setting(
        5, "predictions per image when the request gives no top_k", at_least=1)
    max_answer_bytes: int = setting(
        8 * MIB,
        "largest answer a classification may produce, in bytes: its upper bound (images x "
        "bots x min(top_k, classes) predictions of the longest label, plus every class's "
        "score where the protocol returns them) is checked before any image is decoded "
        "(413 answer_too_large beyond)",
        at_least=1)
    feature_cache_size: int = setting(
        1024, "trunk features kept by image digest, in entries (0 disables the cache)",
        at_least=0)
    feature_cache_scope: str = setting(
        "tenant",
        "tenant: each tenant's images are cached apart (a tenant never hits an image another "
        "sent); shared: one cache for all, more hits, but a hit is faster and shows in "
        "Server-Timing, so a tenant can learn whether another sent an image: only where "
        "the tenants trust each other",
        choices=FEATURE_CACHE_SCOPES)
    heads_memory_mb: int = setting(
        2048,
        "memory budget of the resident heads, in MiB (a 100-class head takes 0.6 MiB: "
        "the default keeps about 3,400 resident; colder ones load on demand)",
        at_least=1)
    auth: str = setting(
        "keys",
        "keys: every call needs a tenant's API key (`multihead keys add`) or the operator "
        "token, and sees only that tenant's bots; none: no keys, every bot open to anyone "
        "who reaches the port (bot changes still need the admin token); logged at start",
        choices=AUTH_MODES)
    admin_token: str | None = setting(
        None,
        "the operator credential: bearer token that manages tenants, keys and every bot "
        "(and, with --auth none, the admin routes PUT/DELETE /bots); unset disables it. "
        "Prefer the environment variable: flags show up in `ps`",
        check=_token, secret=True)
    preprocess_threads: int = setting(
        2, "threads decoding and preprocessing images (plus one thread at the lowest CPU "
        "priority for the images above 8 x 640x480 RGB 8-bit)", at_least=1)
    own_cores: bool = setting(
        True,
        "a CPU trunk runs alone on the cores: images are decoded between trunk batches, "
        "never during one (a decode thread beside the trunk's threads stalls the whole "
        "batch), the batcher gathers the rows being decoded into the next batch, and the "
        "heads' BLAS (numpy) runs on one thread (its pool's workers spin after each product, "
        "beside the next batch); off: decoding runs beside the trunk and BLAS keeps its "
        "threads. No effect on a GPU")
    batch_policy: str = setting(
        "mixed",
        "mixed: one trunk batch holds any mix of bots; per_group: one bot per batch "
        "(what per-model servers do; for comparison)",
        choices=BATCH_POLICIES)
    # -- fair sharing between tenants (service.core.fair, service.core.quota) ------------------
    scheduler: str = setting(
        "fair",
        "fair: when more images wait than a batch holds, take them by the tenants' weighted "
        "counters of trunk images served (VTC), FIFO within a tenant, and keep each tenant "
        "within its weighted share of max_queue_rows (429 queue_share beyond it); decodes "
        "are taken in the same order, by decode cost; fifo: arrival order (decodes too) and "
        "one queue bound for all (for comparison)",
        choices=SCHEDULERS)
    tenant_weight: float = setting(
        1.0, "a tenant's weight when its own is unset (`multihead tenants set NAME --weight`)",
        above=0, at_most=1000)
    tenant_rate: float | None = setting(
        None,
        "a tenant's quota in images per second when its own is unset: an image up to "
        "640x480 RGB 8-bit costs 1, a larger or deeper one its decoded bytes / 640x480x3 "
        "(429 rate_limited + Retry-After beyond it; a feature-cache hit costs nothing); unset: "
        "no quota. N processes serving one store each enforce rate / N and burst / N: the "
        "processes with a live lease on the store, or under --ray the replicas (max-replicas "
        "when autoscaling)",
        above=0, at_most=1_000_000)
    tenant_burst: int | None = setting(
        None,
        "a tenant's quota bucket size in images when its own is unset; unset: one second of "
        "its rate",
        at_least=1, at_most=1_000_000)
    tenant_max_queued: int | None = setting(
        None,
        "most images one tenant may have waiting when its own is unset (429 queue_share "
        "beyond it); unset: only its weighted share of max_queue_rows (fair)",
        at_least=1, at_most=1_000_000)
    # -- what a tenant stores (accounts.tenants.versions_to_prune, accounts.rows.storage_plan) --
    tenant_max_bots: int | None = setting(
        1000,
        "most live bots a tenant owns when its own max_bots is unset (403 tenant_limit for a "
        "new bot beyond it; `multihead tenants set NAME --max-bots`); unset: no bound",
        at_least=1, at_most=1_000_000)
    tenant_max_versions: int | None = setting(
        20,
        "versions kept per bot when the tenant's own max_versions is unset: a registration "
        "beyond it prunes the bot's oldest versions (never the active one, the candidate, "
        "the previously active one or the rollback target); unset: every version kept",
        at_least=1, at_most=1000)
    tenant_max_head_bytes: int | None = setting(
        2 * 1024**3,
        "total head bytes a tenant stores ((1536 + 1) x 4 per class of every stored "
        "version) when its own max_head_bytes is unset (403 tenant_limit beyond it); unset: "
        "no bound",
        at_least=1, at_most=1_000_000_000_000)
    tenant_registrations_per_minute: int | None = setting(
        120,
        "registrations (new versions, candidates) a tenant makes through this server per "
        "minute when its own is unset, whoever registers (429 registration_rate + "
        "Retry-After beyond it; a bucket of one minute's worth, divided between the processes "
        "serving the store as quotas are); unset: no bound",
        at_least=1, at_most=1_000_000)
    tenant_deadline_ms: float | None = setting(
        None,
        "the deadline of a tenant's requests that give none (no X-Multihead-Deadline-Ms, no "
        "gRPC deadline), in ms from their arrival, when its own deadline_ms is unset; unset: "
        "--request-timeout-s only", above=0, at_most=3_600_000)
    metrics_top_tenants: int = setting(
        20, "busiest tenants that get their own /metrics label; the rest are 'other'",
        at_least=0)
    metrics_top_bots: int = setting(
        20, "busiest bots that get their own /metrics label; the rest are 'other'", at_least=0)
    # -- logs and traces (service.core.logs, service.core.tracing) -----------------------------
    log_format: str = setting(
        "text",
        "log lines: text (time LEVEL logger: message) or json (one object per line: time, "
        "level, logger, message, request_id, tenant, bot, status, latency_ms); credentials "
        "and image bytes are scrubbed from both",
        choices=LOG_FORMATS)
    access_log: bool = setting(
        True,
        "one line per request (HTTP request, gRPC call, WebSocket message) on the "
        "multihead.access logger, at INFO: method, path, status, latency, request id, tenant, "
        "bot, version")
    tracing: str | None = setting(
        None,
        "OpenTelemetry span exporter: otlp (OTLP over HTTP to OTEL_EXPORTER_OTLP_ENDPOINT), "
        "console or none; unset: OTEL_TRACES_EXPORTER decides, and unset there too tracing "
        "is off (no OpenTelemetry import). OTEL_SDK_DISABLED=true turns it off; the other "
        "OTEL_* variables (service name, sampler, endpoint) are the SDK's. Needs the otel "
        "extra (pip install 'multihead[otel]')",
        choices=EXPORTERS)
    warmup: bool = setting(
        True,
        "run the trunk before reporting ready: at batch 1 on the CPU (a first run at a new "
        "batch size costs only 20-100 ms more there), at every power-of-two batch size up "
        "to max_batch_size on a GPU; a start without a saved batch profile measures it "
        "(the trunk's time per batch alone at 1, 2, 4, ... max_batch_size, kept in "
        "graph_cache/ for the next start); off: nothing is run or measured (a saved "
        "profile still loads)")
    graph_cache: bool = setting(
        True,
        "keep the built trunk graph in graph_cache/ next to the trunk checkpoint "
        "(<store>/trunk/graph_cache for the store's own trunk) and re-import it on the "
        "next start instead of rebuilding it with tf-slim (restarts in seconds)")
    # -- hot bots: heads resident before ready ---------------------------------------------
    pin: str | None = setting(
        None,
        "bots whose heads are loaded before /readyz says ready and never evicted, "
        "comma-separated (a,b,c); serve refuses to start if one is not registered",
        check=_bot_list)
    preload: int = setting(
        0,
        "load the heads of the N most recently registered bots before ready (after the "
        "pinned ones, as many as fit in heads_memory_mb); unlike pinned ones they stay "
        "evictable",
        at_least=0)

    # -- more than one process: Ray Serve (`multihead serve --ray`) ---------------------------
    ray: bool = setting(
        False,
        "serve through Ray Serve: --replicas processes, each with its own trunk and "
        "batcher, behind Ray's HTTP proxy on --host/--port (needs the ray extra; no web "
        "page there)")
    # Its fields are settings like the others (flags, variables), listed right after --ray.
    deployment: Deployment = field(default_factory=Deployment, metadata={GROUP: Deployment})

    def __post_init__(self) -> None:
        self.validate()

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={shown(f, getattr(self, f.name))}"
                           for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"

    # -- validation -------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise `InvalidSettings` for the first invalid field: of the wrong type, outside its
        own constraints (its metadata), or breaking a rule between fields (`RULES`)."""
        validate_fields(self, RULES)

    # -- derived values ---------------------------------------------------------------------

    @property
    def admin_enabled(self) -> bool:
        return self.admin_token is not None

    @property
    def pinned_bots(self) -> tuple[str, ...]:
        """The bot ids of `pin`, in order, without duplicates."""
        return _bot_ids(self.pin or "")

    @property
    def quota_divisor(self) -> int:
        """The processes sharing one tenant's traffic, each enforcing rate / this: the Ray
        replicas (the most of the autoscaling range, so the sum never passes the rate), else 1
        (outside Ray the service divides by the store's serving processes instead:
        `service.core.tenancy`, `store.leases`)."""
        if not self.ray:
            return 1
        d = self.deployment
        return d.max_replicas if d.max_replicas is not None else d.replicas

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def public_dict(self) -> dict[str, Any]:
        """All fields for logging / a status page, nested as `dataclasses.asdict` nests them,
        with a set admin token shown as *** and a store URL without its password."""
        return public_fields(self)

    # -- construction from the outside world ------------------------------------------------

    @classmethod
    def env_var(cls, name: str) -> str:
        """`max_batch_size` -> `MULTIHEAD_MAX_BATCH_SIZE`."""
        return ENV_PREFIX + name.upper()

    @classmethod
    def flat_fields(cls) -> tuple[dataclasses.Field, ...]:
        """Every setting, in flag order: the fields, with a group's (`deployment`) in its
        place. Each has one flag and one environment variable."""
        out: list[dataclasses.Field] = []
        for f in dataclasses.fields(cls):
            group = f.metadata.get(GROUP)
            out += dataclasses.fields(group) if group else [f]
        return tuple(out)

    @classmethod
    def field_of(cls, name: str) -> dataclasses.Field:
        """The field of one setting (`default`, `metadata`), a group's included."""
        for f in cls.flat_fields():
            if f.name == name:
                return f
        raise KeyError(name)

    @classmethod
    def resolve(cls, name: str, given: Any = None,
                environ: Mapping[str, str] = os.environ) -> Any:
        """One setting: `given` (a flag's value; None when the flag is absent), else its
        `MULTIHEAD_<NAME>` variable parsed to the field's type, else the default; checked
        against the field's own constraints (the rules between fields wait for the whole
        object). Raises `InvalidSettings` naming the variable or the field."""
        f = cls.field_of(name)
        var = cls.env_var(name)
        if given is not None:
            value = given
        elif var in environ:
            value = parse_text(f, var, environ[var])
        else:
            value = f.default
        check_value(f, value)
        return value

    @classmethod
    def from_env_and_args(
        cls,
        args: argparse.Namespace | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> Settings:
        """Defaults, overridden by `MULTIHEAD_<FIELD>` variables, overridden by CLI flags: each
        setting by `resolve`.

        A flag counts as given when its value in `args` is not None (`add_arguments` makes every
        default None for that reason). Raises `InvalidSettings` naming the variable or field.
        """
        flat = cls.flat_fields()
        values = {f.name: cls.resolve(f.name, getattr(args, f.name, None), environ)
                  for f in flat}
        known_vars = {cls.env_var(f.name) for f in flat}
        for var in environ:
            if var.startswith(ENV_PREFIX) and var not in known_vars:
                log.warning("ignoring unknown environment variable %s", var)
        fields = {}
        for f in dataclasses.fields(cls):
            group = f.metadata.get(GROUP)
            fields[f.name] = (group(**{g.name: values[g.name] for g in dataclasses.fields(group)})
                              if group else values[f.name])
        return cls(**fields)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any],
                     environ: Mapping[str, str] = os.environ) -> Settings:
        """As `from_env_and_args`, with the flags given as a mapping of setting name -> value
        (a Ray Serve config's `args`); text is parsed as its environment variable would be.
        Unknown names are refused."""
        names = {f.name: f for f in cls.flat_fields()}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise InvalidSettings(f"unknown setting(s): {', '.join(unknown)}")
        given = {name: parse_text(names[name], name, value) if isinstance(value, str) else value
                 for name, value in values.items()}
        return cls.from_env_and_args(argparse.Namespace(**given), environ)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--flag` per setting; each flag's help names its env var and default.

        Every default is None so `from_env_and_args` can tell a given flag from an absent one.
        """
        group = parser.add_argument_group(
            "serve settings", f"each flag can also be set by its {ENV_PREFIX}* variable; flags win"
        )
        add_flags(group, cls.flat_fields(), cls.env_var)


# -- rules between fields, checked after every field's own: each gives the message of
# settings that break it, else None ------------------------------------------------------------

def _distinct_ports(s: Settings) -> str | None:
    # 0 and 0 are two free ports, not one.
    if s.grpc_port is not None and s.grpc_port == s.port != 0:
        return f"grpc_port must differ from port ({s.port})"
    return None


def _admissible_requests(s: Settings) -> str | None:
    # Otherwise a request within the limits could never be admitted or queued, even when idle.
    for name in ("max_body_bytes", "max_ws_message_bytes"):
        if getattr(s, name) > s.max_inflight_bytes:
            return (f"{name} ({getattr(s, name)}) must be <= max_inflight_bytes "
                    f"({s.max_inflight_bytes})")
    if s.max_queue_rows < s.max_images_per_request:
        return (f"max_queue_rows ({s.max_queue_rows}) must be >= max_images_per_request "
                f"({s.max_images_per_request})")
    return None


def _autoscaling_range(d: Deployment) -> str | None:
    if d.max_replicas is not None and d.max_replicas < d.fewest_replicas:
        return f"max_replicas must be >= {d.fewest_replicas}, got {d.max_replicas}"
    return None


RULES: tuple[Callable[[Settings], str | None], ...] = (_distinct_ports, _admissible_requests)
DEPLOYMENT_RULES: tuple[Callable[[Deployment], str | None], ...] = (_autoscaling_range,)


def _bot_ids(text: str) -> tuple[str, ...]:
    """`"a, b,,a"` -> `("a", "b")`."""
    return tuple(dict.fromkeys(b.strip() for b in text.split(",") if b.strip()))
