"""Tenants, API keys and audit records of a store, as plain values (no I/O here).

A tenant owns bots; an API key belongs to one tenant and has one scope; every change to bots,
tenants and keys is appended to the store's audit log in the same transaction as the change
(`store.front.HeadStore` reads and writes them; both backends keep them in the tables of
`store.schema`).

    DEFAULT_TENANT   "default": always exists; every bot of a store written before tenants
                     existed (no owners row) belongs to it
    SCOPES           what a key may do: "infer", "manage", "metrics"
    OPERATOR         the actor name of the operator credential and of the CLI
    LIMITS           the per-tenant limits (`TenantLimits`), each with its range: fair sharing
                     (weight, rate, burst, max_queued), storage (max_bots, max_versions,
                     max_head_bytes, registrations_per_minute) and latency (deadline_ms)

A token is `mhk_<key id: 12 hex>_<43 urlsafe characters>` (256 random bits). It is shown once,
when its key is made; the store keeps only `token_hash(token)`, and nothing here ever puts the
token or its hash into a repr, a `to_dict()` or a log line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import numbers
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from accounts.errors import InvalidLimits, InvalidTenant
from heads.errors import InvalidBotId
from heads.head import validate_bot_id

DEFAULT_TENANT = "default"
SCOPES = ("infer", "manage", "metrics")
OPERATOR = "operator"
TOKEN_PREFIX = "mhk_"

AUDIT_ACTIONS = ("register", "replace", "rollback", "remove", "tenant_add", "tenant_remove",
                 "tenant_set", "key_add", "key_revoke", "candidate_add", "candidate_promote",
                 "candidate_discard", "refused")

_KEY_ID_BYTES = 6  # 12 hex characters
_SECRET_BYTES = 32
# token_urlsafe(32): a token's last 43 characters, which may hold "_" themselves.
SECRET_CHARS = 43
# fullmatch of str only; explicit ASCII classes, so no Unicode digit or letter can pass.
_TOKEN_RE = re.compile(rf"mhk_([0-9a-f]{{12}})_[A-Za-z0-9_-]{{{SECRET_CHARS}}}")


def utc_now() -> str:
    """The store's timestamps: ISO 8601 UTC with milliseconds (an audit record's `at`, a key's
    `created`, a version's `created`)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def validate_tenant(name: object) -> str:
    """Return `name` if it is a valid tenant name (the rules of bot ids: 1-64 characters from
    A-Z a-z 0-9 . _ -, starting with a letter or digit), else raise InvalidTenant."""
    try:
        return validate_bot_id(name)
    except InvalidBotId:
        shown = name if isinstance(name, str) else type(name).__name__
        if isinstance(shown, str) and len(shown) > 80:
            shown = shown[:77] + "..."
        raise InvalidTenant(
            f"invalid tenant name {shown!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit") from None


def validate_scope(scope: object) -> str:
    """Return `scope` if it is one of SCOPES, else raise ValueError."""
    if not isinstance(scope, str) or scope not in SCOPES:
        raise ValueError(f"invalid key scope {scope!r}: use one of {', '.join(SCOPES)}")
    return scope


def new_token() -> tuple[str, str]:
    """A new (key id, token): the key id is 12 lowercase hex characters, public (it names the
    key in listings and logs); the token is `mhk_<key id>_<secret>` with a 256-bit secret."""
    key_id = secrets.token_hex(_KEY_ID_BYTES)
    return key_id, f"{TOKEN_PREFIX}{key_id}_{secrets.token_urlsafe(_SECRET_BYTES)}"


def parse_token(token: object) -> str | None:
    """The key id of a well-formed token, else None (never raises, whatever it is given)."""
    if not isinstance(token, str):
        return None
    m = _TOKEN_RE.fullmatch(token)
    return None if m is None else m.group(1)


def token_hash(token: str) -> str:
    """The sha256 (hex) of the whole token: what the store keeps instead of the token.

    A plain hash is right here: the token holds 256 random bits, so no dictionary or brute-force
    attack on the hash is possible, and a slow password hash (bcrypt, scrypt) would only cost
    time on every uncached authentication.
    """
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def combine_digests(digests: dict[str, str]) -> str:
    """One sha256 for a stored head from the sha256 of each of its files or blobs
    ({name: sha256 hex}): the digest recorded in the audit log."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """One API key, as the store keeps it: never the token, only its hash (which no repr or
    `to_dict()` shows either).

    Attributes:
        id: the key id (public: the 12 hex characters after `mhk_` in its token).
        prefix: `mhk_<id>`, what a person recognises the token by.
        created, last_used, revoked: ISO 8601 UTC; last_used and revoked None until then.
    """

    id: str
    tenant: str
    scope: str
    prefix: str
    created: str
    last_used: str | None
    revoked: str | None
    hash: str = field(repr=False)

    @property
    def live(self) -> bool:
        return self.revoked is None

    def to_dict(self) -> dict:
        """JSON-ready fields (never the hash)."""
        return {"id": self.id, "tenant": self.tenant, "scope": self.scope,
                "prefix": self.prefix, "created": self.created, "last_used": self.last_used,
                "revoked": self.revoked}


# -- limits: the per-tenant settings of fair sharing ---------------------------------------------


STORAGE_TABLE = "tenant_storage_limits"
LATENCY_TABLE = "tenant_latency_limits"


@dataclass(frozen=True)
class Limit:
    """One per-tenant limit: its name, whether it is a whole number, its range
    (`0 < value <= maximum`; a whole number is then >= 1), its unit and what it means."""

    name: str
    integer: bool
    maximum: float
    unit: str
    meaning: str
    # The store's table of the limit: "tenant_limits" (fair sharing) or
    # "tenant_storage_limits" (what a tenant stores: added later, so a table of its own).
    table: str = "tenant_limits"

    @property
    def range_text(self) -> str:
        """The accepted values, as messages and help texts say them."""
        if self.integer:
            return f"a whole number from 1 to {_number_text(self.maximum)}"
        return f"a number > 0 and <= {_number_text(self.maximum)}"


LIMITS: dict[str, Limit] = {limit.name: limit for limit in (
    Limit("weight", False, 1000.0, "",
          "the tenant's share of the trunk relative to the other tenants' weights (fair "
          "batching and queue shares)"),
    Limit("rate", False, 1_000_000.0, "images/s",
          "sustained trunk images per second (a token bucket; none set: unlimited)"),
    Limit("burst", True, 1_000_000, "images",
          "the token bucket's size: how far above its rate the tenant may go at once"),
    Limit("max_queued", True, 1_000_000, "images",
          "a cap on the tenant's images waiting for the trunk (one row each, whatever its "
          "bots), besides its weighted share of the queue"),
    Limit("max_bots", True, 1_000_000, "bots",
          "most live bots the tenant owns (403 tenant_limit for a new bot beyond it)",
          STORAGE_TABLE),
    Limit("max_versions", True, 1000, "versions",
          "versions kept per bot: a registration beyond it prunes the bot's oldest versions "
          "but the active one, the candidate and the rollback target", STORAGE_TABLE),
    Limit("max_head_bytes", True, 1_000_000_000_000, "bytes",
          "total float32 head bytes ((1536 + 1) x 4 per class) of every stored version of the "
          "tenant's bots (403 tenant_limit beyond it)", STORAGE_TABLE),
    Limit("registrations_per_minute", True, 1_000_000, "registrations/min",
          "registrations (new versions and candidates) per minute through the server (a "
          "token bucket of one minute's worth, per process; 429 registration_rate beyond it)",
          STORAGE_TABLE),
    Limit("deadline_ms", False, 3_600_000.0, "ms",
          "the deadline of the tenant's requests that give none (no X-Multihead-Deadline-Ms "
          "header, no gRPC deadline), from their arrival: 504 deadline_unmeetable at once "
          "when the work ahead cannot end before it", LATENCY_TABLE),
)}
LIMIT_NAMES = tuple(LIMITS)
STORAGE_LIMIT_NAMES = tuple(n for n, limit in LIMITS.items() if limit.table == STORAGE_TABLE)
FAIR_LIMIT_NAMES = tuple(n for n, limit in LIMITS.items() if limit.table == "tenant_limits")
LATENCY_LIMIT_NAMES = tuple(n for n, limit in LIMITS.items() if limit.table == LATENCY_TABLE)
# The stored bytes of one class of a head: a float32 column of weights (1536) and a bias.
HEAD_BYTES_PER_CLASS = (1536 + 1) * 4


def _number_text(value: float | int) -> str:
    """2.0 -> "2", 0.5 -> "0.5", 1e6 -> "1000000" (the audit detail, messages)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def _shown(value: object) -> str:
    """A value for a one-line message: numbers and text as repr (escaped, cut short), any other
    object by its type."""
    if isinstance(value, (str, numbers.Real)):
        try:
            text = repr(value)
        except ValueError:  # an int of more than sys.get_int_max_str_digits() digits
            return "a huge number"
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__}"


def validate_limit(name: object, value: object) -> float | int | None:
    """`value` as limit `name` keeps it: a float (weight, rate) or an int (burst, max_queued),
    or None (the serve default).

    Accepted: None; an int or float (numpy's too) in the limit's range (`LIMITS`); for a whole
    number limit, a float without a fraction (2.0). Refused with InvalidLimits (a ValueError),
    one line naming the limit: an unknown name; a bool, str or any other non-number; NaN,
    +-inf; zero or negative; above the maximum; a fraction for a whole number limit.
    """
    limit = LIMITS.get(name) if isinstance(name, str) else None
    if limit is None:
        raise InvalidLimits(f"unknown limit {_shown(name)}: the limits are "
                            f"{', '.join(LIMIT_NAMES)}")
    if value is None:
        return None
    # NOTE: bool is an int to Python (True == 1), never a limit.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidLimits(f"{name} must be {limit.range_text}, got {_shown(value)}")
    # Compared before any conversion: NaN fails both, a huge int never becomes an inf.
    if not (value > 0 and value <= limit.maximum):
        raise InvalidLimits(f"{name} must be {limit.range_text}, got {_shown(value)}")
    if not limit.integer:
        return float(value)
    if not isinstance(value, numbers.Integral) and not float(value).is_integer():
        raise InvalidLimits(f"{name} must be {limit.range_text}, got {_shown(value)}")
    return int(value)


def validate_limits(**values: object) -> dict[str, float | int | None]:
    """{name: validated value} of the limits given (see `validate_limit`); None stays None (the
    serve default). Raises InvalidLimits naming the first bad limit."""
    return {name: validate_limit(name, value) for name, value in values.items()}


def format_limit(value: float | int | None) -> str:
    """A limit as listings show it: "2", "0.5", "default" (None: the serve default)."""
    return "default" if value is None else _number_text(value)


def describe_limits(values: Mapping[str, float | int | None]) -> str:
    """"weight=2 rate=10 burst=default": the audit detail of a limits change (in LIMITS
    order)."""
    return " ".join(f"{name}={format_limit(values[name])}" for name in LIMIT_NAMES
                    if name in values)


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's settings for fair sharing of the trunk. None: the serve default, which the
    server fills in (`filled`); every value is checked on construction (`validate_limit`).

    Attributes:
        weight: the tenant's share of the trunk relative to the other tenants (fair batching:
            batches are filled from the tenants' queues in proportion to their weights; also
            their share of the queue). Float in (0, 1000].
        rate: sustained trunk images per second (a token bucket; unset and no serve default:
            unlimited). Float in (0, 1_000_000] images/s.
        burst: the bucket's size in images: how far the tenant may go above its rate for a
            moment (when a rate is set and no burst, the serve default). Int in
            [1, 1_000_000].
        max_queued: a cap on the tenant's images waiting for the trunk (one each, whatever
            its bots), besides its weighted share of the queue. Int in [1, 1_000_000].
        max_bots: most live bots the tenant owns. Int in [1, 1_000_000].
        max_versions: versions kept per bot (`versions_to_prune`). Int in [1, 1000].
        max_head_bytes: total head bytes (`HEAD_BYTES_PER_CLASS` per class) of every stored
            version of the tenant's bots. Int in [1, 10**12].
        registrations_per_minute: registrations through the server per minute. Int in
            [1, 1_000_000].
        deadline_ms: the deadline of the tenant's requests that give none, in ms from their
            arrival. Float in (0, 3_600_000].
        Unset with no serve default: no bound.
    """

    weight: float | None = None
    rate: float | None = None
    burst: int | None = None
    max_queued: int | None = None
    max_bots: int | None = None
    max_versions: int | None = None
    max_head_bytes: int | None = None
    registrations_per_minute: int | None = None
    deadline_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in validate_limits(**self.to_dict()).items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, float | int | None]:
        return {name: getattr(self, name) for name in LIMIT_NAMES}

    def changed(self, **changes: object) -> TenantLimits:
        """These limits with `changes` applied (a value of None: back to the serve default).
        Raises InvalidLimits."""
        return dataclasses.replace(self, **validate_limits(**changes))

    def filled(self, defaults: TenantLimits) -> TenantLimits:
        """Each limit that is None here taken from `defaults` (the serve defaults)."""
        return TenantLimits(**{name: defaults.to_dict()[name] if value is None else value
                               for name, value in self.to_dict().items()})


def versions_to_prune(stored: list[int], *, active: int, candidate: int | None,
                      previous: int | None, max_versions: int | None) -> list[int]:
    """The versions of one bot a registration prunes, oldest first: while more than
    `max_versions` are stored (the new one included), the oldest that is none of

    - the active version (`active`, after the registration),
    - the candidate (`candidate`, after the registration),
    - the version active before the registration (`previous`: the one a rollback undoing it
      goes back to), and
    - the rollback target: the newest stored version below `active` that is not the
      candidate (what `multihead bots rollback` without a version picks).

    So a bot may keep more than `max_versions` (at most 4: these), never fewer than it asks.
    None: no bound, nothing pruned."""
    if max_versions is None or len(stored) <= max_versions:
        return []
    older = [v for v in stored if v < active and v != candidate]
    kept = {active, candidate, previous, max(older) if older else None}
    prunable = sorted(v for v in stored if v not in kept)
    return prunable[:max(0, len(stored) - max_versions)]


@dataclass(frozen=True)
class TenantInfo:
    """A tenant, how many live bots it owns, and its limits."""

    name: str
    created: str | None  # None for DEFAULT_TENANT while no row was ever written for it
    bots: int
    limits: TenantLimits = field(default_factory=TenantLimits)

    def to_dict(self) -> dict:
        return {"name": self.name, "created": self.created, "bots": self.bots,
                "limits": self.limits.to_dict()}


@dataclass(frozen=True)
class AuditRecord:
    """One change, as the audit log keeps it.

    Attributes:
        id: grows with every record (the log's order).
        at: ISO 8601 UTC.
        actor: who made the change: OPERATOR, or whatever the service names a key by.
        action: one of AUDIT_ACTIONS.
        tenant: the tenant concerned (the bot's owner for bot changes).
        bot_id, version: the bot and the version made active (register, replace, rollback) or
            the version active when it was removed.
        digest: register, replace, rollback: the sha256 of the stored tensors and labels of
            the version made active (`combine_digests` of the backend's per-file or per-blob
            sha256s; so the same head has a different digest in a directory and in PostgreSQL).
        detail: free text: register and replace: the source (as `BotInfo.source`: it may be
            a path on the server); rollback: "from v<N>"; key_add, key_revoke: "key <id>
            scope <scope>"; tenant_remove: how many bots and keys went with it; tenant_set,
            and tenant_add with limits: the limits given ("weight=2 rate=10 burst=default",
            `describe_limits`).
    """

    id: int
    at: str
    actor: str
    action: str
    tenant: str | None
    bot_id: str | None
    version: int | None
    digest: str | None
    detail: str | None

    def to_dict(self) -> dict:
        return {"id": self.id, "at": self.at, "actor": self.actor, "action": self.action,
                "tenant": self.tenant, "bot_id": self.bot_id, "version": self.version,
                "digest": self.digest, "detail": self.detail}


def normalize_actor(actor: object) -> str:
    """An actor name as recorded: a non-empty str of at most 200 characters, whitespace runs
    made single spaces. Raises ValueError."""
    if not isinstance(actor, str) or not " ".join(actor.split()):
        raise ValueError(f"invalid actor {actor!r}: a non-empty name")
    actor = " ".join(actor.split())
    if len(actor) > 200:
        raise ValueError("invalid actor: at most 200 characters")
    return actor
