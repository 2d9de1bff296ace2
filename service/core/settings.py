"""The service's one settings object: built from `MULTIHEAD_*` environment variables and CLI
flags (flags win), validated once at startup, then passed explicitly. Nothing else in the
service reads the environment.

    settings = Settings.from_env_and_args(args)      # args from `multihead serve ...`
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backbone.precision import PRECISIONS, RUNTIMES
from heads import InvalidBotId, validate_bot_id
from service.core.batcher import POLICIES as BATCH_POLICIES

# Fields whose value is one of a few names: validated, and offered as choices by the flags.
CHOICES: dict[str, tuple[str, ...]] = {
    "batch_policy": BATCH_POLICIES,
    "precision": (*PRECISIONS, "auto"),
    "runtime": (*RUNTIMES, "auto"),
}

log = logging.getLogger(__name__)

ENV_PREFIX = "MULTIHEAD_"
MIB = 1024 * 1024



class InvalidSettings(ValueError):
    """A setting (flag, environment variable or field) has an invalid value."""


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class Settings:
    """Every option of `multihead serve`, with safe defaults.

    Construct it with `Settings.from_env_and_args(...)`, or directly in tests
    (`Settings(max_batch_size=4)`); construction validates and raises `InvalidSettings` (a
    ValueError) naming the field and the value.
    """

    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=8080, metadata=_help("TCP port to listen on (0 picks a free port)"))
    grpc_port: int | None = field(
        default=None,
        metadata=_help(
            "TCP port of the gRPC listener on --host: KServe v2 / Triton GRPCInferenceService "
            "and TF Serving PredictionService + ModelService, same engine and batcher as HTTP "
            "(8001 is Triton's convention; 0 picks a free port). Unset: no gRPC, since it is "
            "one more listener to expose and secure and needs the grpc extra "
            "(pip install 'multihead[grpc]')"
        ),
    )
    store: str = field(
        default="checkpoints",
        metadata=_help(
            "the registered bots: a store directory (holding trunk/ and heads/), or a "
            "postgresql://user@host:port/db URL shared by many processes and machines (then "
            "--trunk-checkpoint is required)"
        ),
    )
    trunk_checkpoint: str | None = field(
        default=None,
        metadata=_help("trunk checkpoint prefix; unset means the trunk inside --store"),
    )
    device: str = field(
        default="auto", metadata=_help("where the trunk runs: auto, cpu, gpu or gpu:N")
    )
    precision: str = field(
        default="auto",
        metadata=_help(
            "trunk precision: fp32; bf16 (CPUs with avx512_bf16 or AMX); fp16 (GPU); auto = "
            "fp16 on a GPU, bf16 on a CPU that has it, else fp32. Refused where the hardware "
            "lacks it, never emulated; heads stay fp32"
        ),
    )
    runtime: str = field(
        default="tf",
        metadata=_help(
            "trunk runtime: tf; openvino (CPU, compiled in-process from the same restored "
            "tf-slim graph, cached in graph_cache/ next to the trunk checkpoint; needs the "
            "openvino extra); "
            "auto = openvino on a CPU when installed, else tf"
        ),
    )
    max_batch_size: int = field(
        default=16, metadata=_help("most images in one trunk batch (any mix of bots)")
    )
    max_wait_ms: float = field(
        default=5.0,
        metadata=_help("longest a batch waits for more images after its first one, in ms"),
    )
    max_queue_rows: int = field(
        default=256,
        metadata=_help("most images waiting for the trunk; beyond it: 503 + Retry-After"),
    )
    request_timeout_s: float = field(
        default=30.0, metadata=_help("deadline of one request, in seconds (504 when it passes)")
    )
    max_body_bytes: int = field(
        default=20 * MIB, metadata=_help("largest accepted request body, in bytes (413 beyond)")
    )
    max_inflight_bytes: int = field(
        default=256 * MIB,
        metadata=_help(
            "budget of request bytes in flight across all requests (bodies being read or "
            "served, plus each open WebSocket's message size); a request that does not fit is "
            "refused with 503 + Retry-After BEFORE its body is read"
        ),
    )
    max_ws_message_bytes: int = field(
        default=4 * MIB,
        metadata=_help(
            "largest WebSocket message (one image), in bytes; each open socket holds this much "
            "of the in-flight budget"
        ),
    )
    max_image_pixels: int = field(
        default=40_000_000,
        metadata=_help("largest decoded image, in pixels (413 beyond; decompression-bomb guard)"),
    )
    max_images_per_request: int = field(
        default=32, metadata=_help("most images in one request (413 beyond)")
    )
    top_k_default: int = field(
        default=5, metadata=_help("predictions per image when the request gives no top_k")
    )
    feature_cache_size: int = field(
        default=1024,
        metadata=_help("trunk features kept by image digest, in entries (0 disables the cache)"),
    )
    heads_memory_mb: int = field(
        default=2048,
        metadata=_help(
            "memory budget of the resident heads, in MiB (a 100-class head takes 0.6 MiB: "
            "the default keeps about 3,400 resident; colder ones load on demand)"
        ),
    )
    admin_token: str | None = field(
        default=None,
        repr=False,  # NOTE: never printed, logged or shown in a traceback's locals.
        metadata=_help(
            "bearer token of the admin routes (PUT/DELETE /bots); unset disables them. "
            "Prefer the environment variable: flags show up in `ps`"
        ),
    )
    preprocess_threads: int = field(
        default=2, metadata=_help("threads decoding and preprocessing images")
    )
    batch_policy: str = field(
        default="mixed",
        metadata=_help(
            "mixed: one trunk batch holds any mix of bots; per_group: one bot per batch "
            "(what per-model servers do; for comparison)"
        ),
    )
    metrics_top_bots: int = field(
        default=20,
        metadata=_help("busiest bots that get their own /metrics label; the rest are 'other'"),
    )
    warmup: bool = field(
        default=True,
        metadata=_help(
            "run the trunk before reporting ready: at batch 1 on the CPU (a first run at a new "
            "batch size costs only 20-100 ms more there), at every power-of-two batch size up "
            "to max_batch_size on a GPU"
        ),
    )
    graph_cache: bool = field(
        default=True,
        metadata=_help(
            "keep the built trunk graph in graph_cache/ next to the trunk checkpoint "
            "(<store>/trunk/graph_cache for the store's own trunk) and re-import it on the "
            "next start instead of rebuilding it with tf-slim (restarts in seconds)"
        ),
    )
    # -- hot bots: heads resident before ready ---------------------------------------------
    pin: str | None = field(
        default=None,
        metadata=_help(
            "bots whose heads are loaded before /readyz says ready and never evicted, "
            "comma-separated (a,b,c); serve refuses to start if one is not registered"
        ),
    )
    preload: int = field(
        default=0,
        metadata=_help(
            "load the heads of the N most recently registered bots before ready (after the "
            "pinned ones, as many as fit in heads_memory_mb); unlike pinned ones they stay "
            "evictable"
        ),
    )

    # -- more than one process: Ray Serve (`multihead serve --ray`; see
    # service/transports/ray/serve.py) --
    ray: bool = field(
        default=False,
        metadata=_help(
            "serve through Ray Serve: --replicas processes, each with its own trunk and "
            "batcher, behind Ray's HTTP proxy on --host/--port (needs the ray extra; no "
            "WebSocket route or web page there)"
        ),
    )
    replicas: int = field(
        default=1, metadata=_help("Ray Serve replicas (a fixed count; see --max-replicas)")
    )
    ray_address: str | None = field(
        default=None,
        metadata=_help(
            "Ray cluster to deploy to (e.g. auto, or ray://head:10001); unset starts a local "
            "Ray for this process"
        ),
    )
    min_replicas: int | None = field(
        default=None,
        metadata=_help("autoscaling: fewest replicas (unset: --replicas); with --max-replicas"),
    )
    max_replicas: int | None = field(
        default=None,
        metadata=_help(
            "autoscaling: most replicas; set, it turns Ray Serve's autoscaling on between "
            "--min-replicas and this, driven by --target-ongoing-requests"
        ),
    )
    target_ongoing_requests: float = field(
        default=16.0,
        metadata=_help("autoscaling: requests in flight per replica that Ray aims at"),
    )
    max_ongoing_requests: int = field(
        default=64,
        metadata=_help(
            "requests one Ray replica takes at once (Ray's own default of 5 would starve the "
            "cross-bot batcher); beyond it Ray's proxy queues them"
        ),
    )
    ingress_replicas: int = field(
        default=1,
        metadata=_help(
            "Ray Serve ingress replicas: light processes (no TensorFlow) that take requests "
            "from Ray's proxy and hand them to the model replicas, retrying on another replica "
            "when one dies mid-request"
        ),
    )
    replica_cpus: float = field(
        default=1.0, metadata=_help("CPUs Ray reserves for each replica")
    )
    replica_gpus: float = field(
        default=0.0,
        metadata=_help("GPUs Ray reserves for each replica; a fraction shares one GPU"),
    )

    def __post_init__(self) -> None:
        self.validate()

    # -- validation -------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise `InvalidSettings("<field> must be ...: <value>")` for the first invalid field."""
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)

        _at_least("port", self.port, 0)
        if self.port > 65535:
            raise InvalidSettings(f"port must be <= 65535, got {self.port}")
        if self.grpc_port is not None:
            _at_least("grpc_port", self.grpc_port, 0)
            if self.grpc_port > 65535:
                raise InvalidSettings(f"grpc_port must be <= 65535, got {self.grpc_port}")
            if self.grpc_port == self.port and self.port != 0:
                raise InvalidSettings(f"grpc_port must differ from port ({self.port})")
        if not self.host:
            raise InvalidSettings("host must not be empty")
        if not self.store:
            raise InvalidSettings("store must not be empty")
        if self.trunk_checkpoint is not None and not self.trunk_checkpoint:
            raise InvalidSettings("trunk_checkpoint must not be empty (leave it unset for the "
                                  "default)")
        if not _valid_device(self.device):
            raise InvalidSettings(f"device must be auto, cpu, gpu or gpu:N, got "
                                  f"{self.device!r}")
        _at_least("max_batch_size", self.max_batch_size, 1)
        _at_least("max_wait_ms", self.max_wait_ms, 0)
        _at_least("max_queue_rows", self.max_queue_rows, 1)
        _positive("request_timeout_s", self.request_timeout_s)
        _at_least("max_body_bytes", self.max_body_bytes, 1)
        _at_least("max_ws_message_bytes", self.max_ws_message_bytes, 1)
        for name in ("max_body_bytes", "max_ws_message_bytes"):
            if getattr(self, name) > self.max_inflight_bytes:
                # Otherwise a request within the limits could never be admitted, even when idle.
                raise InvalidSettings(f"{name} ({getattr(self, name)}) must be <= "
                                      f"max_inflight_bytes ({self.max_inflight_bytes})")
        _at_least("max_image_pixels", self.max_image_pixels, 1)
        _at_least("max_images_per_request", self.max_images_per_request, 1)
        if self.max_queue_rows < self.max_images_per_request:
            # Otherwise a request within the limits could never be accepted, even when idle.
            raise InvalidSettings(
                f"max_queue_rows ({self.max_queue_rows}) must be >= max_images_per_request "
                f"({self.max_images_per_request})"
            )
        _at_least("top_k_default", self.top_k_default, 1)
        _at_least("feature_cache_size", self.feature_cache_size, 0)
        _at_least("heads_memory_mb", self.heads_memory_mb, 1)
        if self.admin_token is not None and (
            not self.admin_token or any(c.isspace() for c in self.admin_token)
        ):
            # Never echo the token itself.
            raise InvalidSettings("admin_token must be non-empty and contain no whitespace")
        _at_least("preprocess_threads", self.preprocess_threads, 1)
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise InvalidSettings(f"{name} must be one of {', '.join(choices)}, got "
                                      f"{getattr(self, name)!r}")
        _at_least("metrics_top_bots", self.metrics_top_bots, 0)
        for bot_id in self.pinned_bots:
            try:
                validate_bot_id(bot_id)
            except InvalidBotId as exc:
                raise InvalidSettings(f"pin: {exc}") from None
        _at_least("preload", self.preload, 0)
        _at_least("replicas", self.replicas, 1)
        _at_least("ingress_replicas", self.ingress_replicas, 1)
        if self.min_replicas is not None:
            _at_least("min_replicas", self.min_replicas, 0)
        if self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else self.replicas
            _at_least("max_replicas", self.max_replicas, max(1, low))
        _positive("target_ongoing_requests", self.target_ongoing_requests)
        _at_least("max_ongoing_requests", self.max_ongoing_requests, 1)
        _at_least("replica_cpus", self.replica_cpus, 0)
        _at_least("replica_gpus", self.replica_gpus, 0)

    # -- derived values ---------------------------------------------------------------------

    @property
    def admin_enabled(self) -> bool:
        return self.admin_token is not None

    @property
    def pinned_bots(self) -> tuple[str, ...]:
        """The bot ids of `pin`, in order, without duplicates."""
        return _bot_ids(self.pin or "")

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def public_dict(self) -> dict[str, Any]:
        """All fields for logging / a status page, with the admin token redacted."""
        out = dataclasses.asdict(self)
        if out["admin_token"] is not None:
            out["admin_token"] = "***"
        return out

    # -- construction from the outside world ------------------------------------------------

    @classmethod
    def env_var(cls, name: str) -> str:
        """`max_batch_size` -> `MULTIHEAD_MAX_BATCH_SIZE`."""
        return ENV_PREFIX + name.upper()

    @classmethod
    def from_env_and_args(
        cls,
        args: argparse.Namespace | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> Settings:
        """Defaults, overridden by `MULTIHEAD_<FIELD>` variables, overridden by CLI flags.

        A flag counts as given when its value in `args` is not None (`add_arguments` makes every
        default None for that reason). Raises `InvalidSettings` naming the variable or field.
        """
        values: dict[str, Any] = {}
        names = {f.name: f for f in dataclasses.fields(cls)}
        for name, f in names.items():
            var = cls.env_var(name)
            if var in environ:
                try:
                    values[name] = _parse(environ[var], f.type)
                except ValueError as exc:
                    shown = "***" if name == "admin_token" else repr(environ[var])
                    raise InvalidSettings(f"{var}={shown}: {exc}") from None
        known_vars = {cls.env_var(n) for n in names}
        for var in environ:
            if var.startswith(ENV_PREFIX) and var not in known_vars:
                log.warning("ignoring unknown environment variable %s", var)
        if args is not None:
            for name in names:
                value = getattr(args, name, None)
                if value is not None:
                    values[name] = value
        return cls(**values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any],
                     environ: Mapping[str, str] = os.environ) -> Settings:
        """As `from_env_and_args`, with the flags given as a mapping of field name -> value
        (a Ray Serve config's `args`); text is parsed as its environment variable would be.
        Unknown names are refused."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise InvalidSettings(f"unknown setting(s): {', '.join(unknown)}")
        given: dict[str, Any] = {}
        for name, value in values.items():
            if isinstance(value, str):
                try:
                    value = _parse(value, names[name].type)
                except ValueError as exc:
                    shown = "***" if name == "admin_token" else repr(value)
                    raise InvalidSettings(f"{name}={shown}: {exc}") from None
            given[name] = value
        return cls.from_env_and_args(argparse.Namespace(**given), environ)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--flag` per field; each flag's help names its env var and default.

        Every default is None so `from_env_and_args` can tell a given flag from an absent one.
        """
        group = parser.add_argument_group(
            "serve settings", f"each flag can also be set by its {ENV_PREFIX}* variable; flags win"
        )
        defaults = cls.__dataclass_fields__
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = defaults[f.name].default
            shown = "unset" if default is None else default
            if f.name.endswith("_bytes"):
                shown = f"{default} = {default // MIB} MiB"
            text = f"{f.metadata.get('help', '')} (env {cls.env_var(f.name)}; default: {shown})"
            text = text.replace("%", "%%")
            kind = _base_type(f.type)
            if kind is bool:
                group.add_argument(
                    flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                    help=text,
                )
            else:
                choices = CHOICES.get(f.name)
                metavar = None if choices else {int: "N", float: "X"}.get(kind, f.name.upper())
                group.add_argument(
                    flag, dest=f.name, type=kind, default=None, metavar=metavar,
                    choices=choices, help=text,
                )


# -- helpers ----------------------------------------------------------------------------------

_TYPES: dict[str, type] = {
    "str": str, "int": int, "float": float, "bool": bool,
    "str | None": str, "int | None": int, "float | None": float,
}


def _base_type(annotation: Any) -> type:
    # `from __future__ import annotations` makes field types strings.
    return _TYPES[annotation] if isinstance(annotation, str) else annotation


def _optional(annotation: Any) -> bool:
    return isinstance(annotation, str) and annotation.endswith("| None")


def _parse(text: str, annotation: Any) -> Any:
    kind = _base_type(annotation)
    stripped = text.strip()
    if _optional(annotation) and stripped == "":
        return None
    if kind is bool:
        low = stripped.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise InvalidSettings("expected one of 1/0, true/false, yes/no, on/off")
    if kind is int:
        try:
            return int(stripped)
        except ValueError:
            raise InvalidSettings("expected an integer") from None
    if kind is float:
        try:
            return float(stripped)
        except ValueError:
            raise InvalidSettings("expected a number") from None
    return text


def _check_type(name: str, value: Any, annotation: Any) -> None:
    if value is None and _optional(annotation):
        return
    kind = _base_type(annotation)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        shown = "***" if name == "admin_token" else repr(value)
        raise InvalidSettings(f"{name} must be {kind.__name__}, got {shown}")


def _at_least(name: str, value: float, low: float) -> None:
    if value != value or value < low:  # NaN fails too
        raise InvalidSettings(f"{name} must be >= {low}, got {value}")


def _positive(name: str, value: float) -> None:
    if value != value or value <= 0:
        raise InvalidSettings(f"{name} must be > 0, got {value}")


def _bot_ids(text: str) -> tuple[str, ...]:
    """`"a, b,,a"` -> `("a", "b")`."""
    return tuple(dict.fromkeys(b.strip() for b in text.split(",") if b.strip()))


def _valid_device(device: str) -> bool:
    if device in ("auto", "cpu", "gpu"):
        return True
    head, _, index = device.partition(":")
    return head == "gpu" and index.isascii() and index.isdigit()
