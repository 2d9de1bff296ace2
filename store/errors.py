"""Typed errors of the store: where it is, whether it can be reached, which versions it keeps.
No HTTP here: the service maps them to statuses (`service.core.errors`)."""
from __future__ import annotations

from heads.errors import HeadLoadError


class StoreError(Exception):
    """Base class of every error the store raises on purpose (besides the heads' and the
    accounts' errors it passes on)."""


class UnknownVersion(StoreError, LookupError):
    """The bot exists but the requested version does not (rollback target)."""


class StoreUnavailable(StoreError, HeadLoadError):
    """The store's database cannot be reached (PostgreSQL down or unreachable). Resident heads
    are still served; a head that is not resident, and every write, fail with this until the
    store reconnects by itself. (A subclass of HeadLoadError: a `get` of a bot whose head cannot
    be loaded now fails the same way whatever the reason.)"""


class InvalidStoreLocation(StoreError, ValueError):
    """A store location that is neither a directory path nor a PostgreSQL URL, e.g. `s3://...`
    or a malformed `postgresql:` URL. Refused before anything is created or connected."""
