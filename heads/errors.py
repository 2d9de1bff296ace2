"""Typed errors of the heads layer. No HTTP here: the service maps them to statuses."""


class HeadsError(Exception):
    """Base class of every error the heads layer raises on purpose."""
