"""What a head store backend is, and which backend a store location names.

A backend is four parts, each an interface of its own module, which every backend implements
in modules of its own (`store/directory/{bots,blobs,accounts,leases}.py`, `store/pg/...`):

    bots      `store.bots.Bots`: the registry rows (versions, active, owners, candidates,
              history); each write one transaction with its blobs and its audit record
    blobs     `store.blobs.Blobs`: the tensors and labels of each version
    accounts  `store.accounts.Accounts`: tenants, limits, keys, audit (SQL: `accounts.rows`)
    leases    `store.leases.Leases`: the serving processes' leases (not data: no data version
              moves, nothing is notified)

and what belongs to the whole store (`Backend`): its change marker `data_version`, change
notifications, the read errors that must not empty the store, closing. `HeadStore`
(store.front) composes the parts and owns everything both backends share: validation, the
resident LRU cache, the snapshot the request path reads (`store.snapshot`), `BotInfo` and the
rollback-target rules.

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
from urllib.parse import urlsplit, urlunsplit

from store.accounts import Accounts
from store.blobs import Blobs
from store.bots import Bots
from store.errors import InvalidStoreLocation
from store.leases import Leases

SQLITE = "sqlite"
POSTGRESQL = "postgresql"
PG_SCHEMES = ("postgresql", "postgres")

# "s3://...", "file:/x", "postgresql:/host" (one slash): a scheme of 2+ characters, a colon and
# a slash. (One letter would be a Windows drive; a path like "data:v1/x" has no slash after ':'.)
_URL_LIKE_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/")
_PG_PREFIX_RE = re.compile(r"(?i)postgres(?:ql)?:")


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




class Backend(ABC):
    """One store's backend: its four parts, and what belongs to the whole store.

    Attributes:
        kind: SQLITE or POSTGRESQL.
        bots, blobs, accounts, leases: the parts (see the module's docstring).
        read_errors: errors of a registry read that must not make every bot unknown:
            `HeadStore` logs them and keeps serving its last snapshot.
    """

    kind: str
    bots: Bots
    blobs: Blobs
    accounts: Accounts
    leases: Leases
    read_errors: tuple[type[BaseException], ...] = ()

    @abstractmethod
    def describe(self) -> str:
        """The location for messages and repr (never a password)."""

    @abstractmethod
    def data_version(self) -> object:
        """A token that changes whenever a change to the bots or the accounts was committed
        (by this process or another). Cheap: no registry rows are read; `HeadStore`'s
        refresher calls it every `change_poll_s`."""

    @abstractmethod
    def on_change(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (from any thread; it returns at once) whenever the data version
        may have changed, so that a change is read without waiting for the next poll. A
        backend that learns of changes only when polled (a directory store) never calls it."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads (the leases part's too). Idempotent."""
