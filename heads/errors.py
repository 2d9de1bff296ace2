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


class InvalidBotId(HeadsError, ValueError):
    """A bot id outside `[A-Za-z0-9][A-Za-z0-9._-]{0,63}` (also guards against path traversal)."""


class InvalidHead(HeadsError, ValueError):
    """Head arrays or labels that cannot form a head: shapes, NaN/Inf, label count, n < 2."""


class InvalidLabel(InvalidHead):
    """A label that breaks the label rules (`heads.head.validate_labels`): empty, surrounding
    whitespace, longer than `MAX_LABEL_CHARS`, or holding a control or line-breaking character
    (HTTP 400: a syntax error of the client's, like a malformed bot id)."""


class HeadLoadError(HeadsError):
    """Head files are missing, unreadable or corrupt (checkpoint, labels file, manifest)."""


class TrunkMismatch(HeadsError):
    """A slim import was refused: the checkpoint's trunk differs from the serving trunk."""


class InvalidTrainingData(HeadsError, ValueError):
    """A labelled image folder or feature set that a head cannot be trained from."""
