"""Typed errors of the accounts: tenants, their limits, API keys, bot ownership, candidates.
No HTTP here: the service maps them to statuses (`service.core.errors`). Every message names the
offending value and never another tenant."""
from __future__ import annotations


class AccountsError(Exception):
    """Base class of every error the accounts layer raises on purpose."""


class InvalidTenant(AccountsError, ValueError):
    """A tenant name outside the bot id rules (`[A-Za-z0-9][A-Za-z0-9._-]{0,63}`), or a change
    the default tenant does not allow (removing it)."""


class InvalidLimits(AccountsError, ValueError):
    """A tenant limit that is not a number in its range (`accounts.tenants.LIMITS`), or a limit
    name that does not exist. The message names the limit."""


class UnknownTenant(AccountsError, LookupError):
    """No tenant of this name exists."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown tenant {name!r}")
        self.name = name


class TenantExists(AccountsError):
    """A tenant of this name exists already."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} exists already")
        self.name = name


class TenantNotEmpty(AccountsError):
    """A tenant that still owns bots was to be removed without force."""

    def __init__(self, name: str, bots: int) -> None:
        super().__init__(f"tenant {name!r} still owns {bots} bot(s): remove them first, or "
                         "remove the tenant with force (which removes its bots too)")
        self.name = name
        self.bots = bots


class UnknownKey(AccountsError, LookupError):
    """No API key of this id exists."""

    def __init__(self, key_id: str) -> None:
        shown = key_id if isinstance(key_id, str) and len(key_id) <= 80 else "..."
        super().__init__(f"unknown API key {shown!r}")
        self.key_id = key_id


class BotOwnedElsewhere(AccountsError):
    """The bot id is live under another tenant. The message never names that tenant, nor says
    that one owns it: bot ids are one namespace, and the answer is the one any taken id gets."""

    def __init__(self, bot_id: str) -> None:
        super().__init__(f"bot id {bot_id!r} is taken: choose another id")
        self.bot_id = bot_id


class InvalidCandidate(AccountsError, ValueError):
    """A candidate mode that is neither `shadow` nor `canary:P` with 0 < P < 100. The message
    names the value."""


class NoCandidate(AccountsError, LookupError):
    """The bot has no candidate to promote or discard."""

    def __init__(self, bot_id: str) -> None:
        super().__init__(f"bot {bot_id!r} has no candidate (register one with --candidate "
                         "shadow or --candidate canary:P)")
        self.bot_id = bot_id



class TenantLimitExceeded(AccountsError):
    """A registration would pass one of its tenant's storage limits (`max_bots`,
    `max_head_bytes`): refused before anything is written. The message names the limit and its
    value (the tenant's own: the caller's)."""

    def __init__(self, limit: str, value: int, detail: str) -> None:
        super().__init__(f"tenant limit {limit}={value} reached: {detail}")
        self.limit = limit
        self.value = value
