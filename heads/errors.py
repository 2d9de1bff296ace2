"""Typed errors of the heads layer. No HTTP here: the service maps them to statuses.

Every message names the offending value (`unknown bot 'acme-7'`) and never echoes internals
(no tracebacks, no TensorFlow status strings), so the CLI and the HTTP layer can show it as is.
"""
from __future__ import annotations


class HeadsError(Exception):
    """Base class of every error the heads layer raises on purpose."""


class UnknownBot(HeadsError, LookupError):
    """No bot with this id is registered (HTTP 404)."""

    def __init__(self, bot_id: str) -> None:
        super().__init__(f"unknown bot {bot_id!r}")
        self.bot_id = bot_id


class UnknownVersion(HeadsError, LookupError):
    """The bot exists but the requested version does not (rollback target)."""


class InvalidBotId(HeadsError, ValueError):
    """A bot id outside `[A-Za-z0-9][A-Za-z0-9._-]{0,63}` (also guards against path traversal)."""


class InvalidHead(HeadsError, ValueError):
    """Head arrays or labels that cannot form a head: shapes, NaN/Inf, label count, n < 2."""


class HeadLoadError(HeadsError):
    """Head files are missing, unreadable or corrupt (checkpoint, labels file, manifest)."""


class StoreUnavailable(HeadLoadError):
    """The store's database cannot be reached (PostgreSQL down or unreachable). Resident heads
    are still served; a head that is not resident, and every write, fail with this until the
    store reconnects by itself. (A subclass of HeadLoadError: a `get` of a bot whose head cannot
    be loaded now fails the same way whatever the reason.)"""


class InvalidStoreLocation(HeadsError, ValueError):
    """A store location that is neither a directory path nor a PostgreSQL URL, e.g. `s3://...`
    or a malformed `postgresql:` URL. Refused before anything is created or connected."""


class TrunkMismatch(HeadsError):
    """A slim import was refused: the checkpoint's trunk differs from the serving trunk."""


class InvalidTrainingData(HeadsError, ValueError):
    """A labelled image folder or feature set that a head cannot be trained from."""


class InvalidTenant(HeadsError, ValueError):
    """A tenant name outside the bot id rules (`[A-Za-z0-9][A-Za-z0-9._-]{0,63}`), or a change
    the default tenant does not allow (removing it)."""


class InvalidLimits(HeadsError, ValueError):
    """A tenant limit that is not a number in its range (`heads.tenants.LIMITS`), or a limit
    name that does not exist. The message names the limit."""


class UnknownTenant(HeadsError, LookupError):
    """No tenant of this name exists."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown tenant {name!r}")
        self.name = name


class TenantExists(HeadsError):
    """A tenant of this name exists already."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} exists already")
        self.name = name


class TenantNotEmpty(HeadsError):
    """A tenant that still owns bots was to be removed without force."""

    def __init__(self, name: str, bots: int) -> None:
        super().__init__(f"tenant {name!r} still owns {bots} bot(s): remove them first, or "
                         "remove the tenant with force (which removes its bots too)")
        self.name = name
        self.bots = bots


class UnknownKey(HeadsError, LookupError):
    """No API key of this id exists."""

    def __init__(self, key_id: str) -> None:
        shown = key_id if isinstance(key_id, str) and len(key_id) <= 80 else "..."
        super().__init__(f"unknown API key {shown!r}")
        self.key_id = key_id


class BotOwnedElsewhere(HeadsError):
    """The bot id is live under another tenant. The message never names that tenant (a tenant
    must not learn who else uses the store)."""

    def __init__(self, bot_id: str) -> None:
        super().__init__(f"bot id {bot_id!r} is taken by another tenant")
        self.bot_id = bot_id


class InvalidCandidate(HeadsError, ValueError):
    """A candidate mode that is neither `shadow` nor `canary:P` with 0 < P < 100. The message
    names the value."""


class NoCandidate(HeadsError, LookupError):
    """The bot has no candidate to promote or discard."""

    def __init__(self, bot_id: str) -> None:
        super().__init__(f"bot {bot_id!r} has no candidate (register one with --candidate "
                         "shadow or --candidate canary:P)")
        self.bot_id = bot_id
