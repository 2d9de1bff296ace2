"""What a head store backend does, and which backend a store location names.

`HeadStore` (store.front) owns everything both backends share: validation of what is
registered, the resident LRU cache, change detection, `BotInfo` and the rollback-target rules.
A backend only keeps rows and tensors:

    store.directory.DirectoryBackend   a directory: SQLite registry + immutable version
                                       directories
    store.pg.PgBackend                 PostgreSQL: registry, tensors and labels in one
                                       database, LISTEN/NOTIFY for changes (psycopg is
                                       imported only there)

Store locations (`parse_location`): a path (str or PathLike) is a directory store;
`postgresql://` and `postgres://` URLs are PostgreSQL stores; any other `scheme:/...` is
refused with InvalidStoreLocation, so that a URL can never become a local folder.
"""
from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from accounts.candidates import CandidateInfo, CandidateMode
from accounts.tenants import (
    DEFAULT_TENANT,
    OPERATOR,
    ApiKey,
    AuditRecord,
    TenantInfo,
    TenantLimits,
)
from heads.head import Head
from store.errors import InvalidStoreLocation

SQLITE = "sqlite"
POSTGRESQL = "postgresql"
PG_SCHEMES = ("postgresql", "postgres")

# "s3://...", "file:/x", "postgresql:/host" (one slash): a scheme of 2+ characters, a colon and
# a slash. (One letter would be a Windows drive; a path like "data:v1/x" has no slash after ':'.)
_URL_LIKE_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/")
_PG_PREFIX_RE = re.compile(r"(?i)postgres(?:ql)?:")

# A registration step name, handed to the test seam `store.front._fault_hook`.
Step = Callable[[str], None]


@dataclass(frozen=True)
class VersionRow:
    """One committed version of one bot, as the registry keeps it."""

    bot_id: str
    version: int
    n_classes: int
    labels: tuple[str, ...]
    created: str
    source: str


def redact_url(url: str) -> str:
    """`url` with its password (in the user info or a `password=` parameter) shown as ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hosts = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    query = "&".join("password=***" if q.split("=", 1)[0].lower() == "password" else q
                     for q in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def parse_location(location: str | os.PathLike) -> tuple[str, str]:
    """(`SQLITE`, directory) or (`POSTGRESQL`, URL) for a store location.

    Raises:
        InvalidStoreLocation: empty, not a str/PathLike, or a URL of another scheme.
    """
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str):
        raise InvalidStoreLocation(
            f"a store location is a directory path or a postgresql:// URL, not "
            f"{type(location).__name__}")
    if not location.strip():
        raise InvalidStoreLocation("the store location is empty")
    m = _URL_LIKE_RE.match(location)
    if m is None:
        if _PG_PREFIX_RE.match(location):  # "postgres:db", "postgresql:host/db"
            raise InvalidStoreLocation(
                f"malformed PostgreSQL store URL {redact_url(location)!r}: write "
                "postgresql://user@host:port/dbname")
        return SQLITE, location
    scheme = m.group(1).lower()
    rest = location[m.end(1):]
    if scheme in PG_SCHEMES and rest.startswith("://"):
        return POSTGRESQL, scheme + rest  # libpq only knows the lower-case schemes
    if scheme in PG_SCHEMES:
        raise InvalidStoreLocation(
            f"malformed PostgreSQL store URL {redact_url(location)!r}: write "
            "postgresql://user@host:port/dbname")
    raise InvalidStoreLocation(
        f"unsupported store scheme '{scheme}://' in {redact_url(location)!r}: a store is a "
        "directory path (SQLite registry and head files) or a postgresql:// or postgres:// URL "
        "(PostgreSQL)")


class StoreBackend(ABC):
    """Rows and tensors of one store. Thread-safe; every method may block on I/O.

    Contract shared by both backends (tests/heads run the same behaviour tests on each):
    a registration is one transaction (a crash at any point leaves nothing visible), version
    numbers of a bot are never reused (also after its removal), and a head whose stored bytes
    do not match their sha256 fails to load with HeadLoadError.
    """

    kind: str
    #: Errors of a registry read that must not make every bot unknown: `HeadStore` logs them
    #: and keeps serving the last known state.
    read_errors: tuple[type[BaseException], ...] = ()

    @abstractmethod
    def describe(self) -> str:
        """The location for messages and repr (never a password)."""

    @abstractmethod
    def data_version(self) -> object:
        """A token that changes whenever another connection or process committed a change.
        Cheap: `HeadStore` calls it at most every `change_poll_s` on the lookup path."""

    @abstractmethod
    def active_map(self) -> dict[str, tuple[int, str]]:
        """{bot id: (active version, owner tenant)}, read now (one snapshot)."""

    @abstractmethod
    def load(self, bot_id: str, version: int) -> Head:
        """Read one version and check every stored blob or file against its sha256.

        Raises:
            HeadLoadError: missing, unreadable or corrupt.
        """

    @abstractmethod
    def add_version(self, bot_id: str, weights: np.ndarray, biases: np.ndarray,
                    labels: tuple[str, ...], source: str, step: Step, *,
                    tenant: str = DEFAULT_TENANT, actor: str = OPERATOR,
                    candidate: CandidateMode | None = None) -> int:
        """Store a new version (already validated) and make it active, owned by `tenant`, with
        its audit record ("register" or "replace"), in one transaction; call `step(name)`
        between the steps. Returns the new version number.

        With `candidate`, the version is stored as the bot's candidate instead (history
        "candidate", audit "candidate_add"); a candidate the bot had is discarded in the same
        transaction (its version deleted, audit "candidate_discard").

        Raises (before writing anything):
            UnknownTenant: no such tenant. BotOwnedElsewhere: the bot is live under another.
            UnknownBot: a candidate for a bot that is not live.
        """

    @abstractmethod
    def candidates(self, bot_id: str | None = None) -> dict[str, CandidateInfo]:
        """{bot id: its candidate} of every live bot that has one (only `bot_id`'s if given),
        read now (one snapshot)."""

    @abstractmethod
    def promote(self, bot_id: str, *, actor: str = OPERATOR) -> tuple[int, int]:
        """In one write transaction: the candidate becomes the active version (history
        "promote", audit "candidate_promote"); the previous active version stays stored.
        Returns (previous active version, new active version). Raises UnknownBot,
        NoCandidate."""

    @abstractmethod
    def discard(self, bot_id: str, *, actor: str = OPERATOR) -> int:
        """In one write transaction: the candidate and its version are deleted (history
        "discard", audit "candidate_discard"). Returns its version. Raises UnknownBot,
        NoCandidate."""

    @abstractmethod
    def snapshot(self, bot_id: str | None = None
                 ) -> list[tuple[int, VersionRow, list[int], str]]:
        """(active version, its row, every loadable version ascending, owner tenant) per bot,
        ordered by id (byte order); only `bot_id`'s if given. The versions include a
        candidate's (`HeadStore` leaves it out of `BotInfo.versions`)."""

    @abstractmethod
    def history(self, bot_id: str) -> list[dict]:
        """Registrations, rollbacks and removals of `bot_id`, oldest first: dicts with
        action, version, previous, at, source."""

    @abstractmethod
    def remove(self, bot_id: str, *, actor: str = OPERATOR) -> None:
        """Unregister `bot_id` and delete its versions (audited). Raises UnknownBot."""

    @abstractmethod
    def rollback(self, bot_id: str, choose: Callable[[int, list[int]], int], *,
                 actor: str = OPERATOR) -> int:
        """In one write transaction: `target = choose(active, loadable versions but the
        candidate's)` (which may raise), activate it if it differs (audited). Returns target.
        Raises UnknownBot."""

    # -- tenants, keys, audit (rows: accounts.rows) -----------------------------------------

    @abstractmethod
    def add_tenant(self, name: str, *, actor: str,
                   limits: TenantLimits | None = None) -> TenantInfo:
        """Add a tenant, with its limits if given (audited). Raises TenantExists."""

    @abstractmethod
    def tenants(self) -> list[TenantInfo]:
        """Every tenant (DEFAULT_TENANT always) with its live bot count and limits, ordered by
        name."""

    @abstractmethod
    def set_limits(self, name: str, changes: dict, *, actor: str) -> TenantLimits:
        """Change a tenant's limits (`accounts.rows.Rows.set_limits`), as a change every
        process sees (audited). Raises UnknownTenant, InvalidLimits."""

    @abstractmethod
    def tenant_limits(self) -> dict[str, TenantLimits]:
        """{tenant: limits} of every tenant (DEFAULT_TENANT always), read now."""

    @abstractmethod
    def remove_tenant(self, name: str, *, force: bool, actor: str) -> None:
        """In one transaction: with `force`, remove its bots; revoke its keys; delete it; each
        change audited. Raises UnknownTenant, TenantNotEmpty (bots left and not `force`)."""

    @abstractmethod
    def add_key(self, key: ApiKey, *, actor: str) -> None:
        """Store a new key (audited). Raises UnknownTenant."""

    @abstractmethod
    def keys(self, tenant: str | None = None, *, live_only: bool = False) -> list[ApiKey]:
        """Keys ordered by creation; only `tenant`'s, only unrevoked ones, if asked."""

    @abstractmethod
    def revoke_key(self, key_id: str, *, actor: str) -> ApiKey:
        """Revoke a key (audited; nothing written if it was revoked already). Raises
        UnknownKey."""

    @abstractmethod
    def mark_used(self, used: dict[str, str]) -> None:
        """Set last_used of keys ({key id: at}); no audit record, no change notification."""

    @abstractmethod
    def audit(self, *, tenant: str | None, since: str | None, limit: int) -> list[AuditRecord]:
        """The newest `limit` audit records matching, oldest first."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads. Idempotent."""
