"""The settings' fields as data: how a field is declared (`setting(default, help, **metadata)`),
what its metadata may say (`CONSTRAINTS`, `ANNOTATIONS`), and the one way a value is parsed from
text (`parse_text`), checked (`check_value`, `validate_fields`) and shown (`public_value`,
`shown`, `public_fields`: a secret as ***, a URL without its password).

Generic over any dataclass whose fields are made by `setting`: `service.core.settings` declares
the fields of `Settings` and `Deployment` and the rules between them; this knows none of them.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any

from store.backend import redact_url

SECRET = "***"  # what is shown of a secret, wherever it would be
# Metadata key of a field that holds a group of settings (a dataclass of their own).
GROUP = "group"


class InvalidSettings(ValueError):
    """A setting (flag, environment variable or field) has an invalid value."""


# What a variable's text may be, by the field's type.
_WORDS = {**dict.fromkeys(("1", "true", "yes", "on"), True),
          **dict.fromkeys(("0", "false", "no", "off"), False)}
_EXPECTED = {bool: "one of 1/0, true/false, yes/no, on/off", int: "an integer", float: "a number"}


# -- constraints: field metadata, one check each ---------------------------------------------

Constraint = Callable[[dataclasses.Field, Any, Any], "str | None"]


def _non_empty(f: dataclasses.Field, value: Any, _: bool) -> str | None:
    if value:
        return None
    hint = " (leave it unset for the default)" if optional(f) else ""
    return f"{f.name} must not be empty{hint}"


# A field's own constraints, by metadata key, in the order they are checked: each gives the
# message of a value that breaks it, else None. A bound refuses NaN too (`nan >= x` is False).
CONSTRAINTS: dict[str, Constraint] = {
    "at_least": lambda f, value, low: (
        None if value >= low else f"{f.name} must be >= {low}, got {value}"),
    "above": lambda f, value, low: (
        None if value > low else f"{f.name} must be > {low}, got {value}"),
    "at_most": lambda f, value, high: (
        None if value <= high else f"{f.name} must be <= {high}, got {value}"),
    "non_empty": _non_empty,
    "choices": lambda f, value, choices: (
        None if value in choices else
        f"{f.name} must be one of {', '.join(choices)}, got {shown(f, value)}"),
    "check": lambda f, value, check: check(f.name, value),  # a rule of its own: name -> message
}
# What a field's metadata may say besides its constraints: its help text, whether its value is
# a secret (never shown) or may be a URL holding a password (shown without it), its group.
ANNOTATIONS = ("help", "secret", "url", GROUP)


def setting(default: Any, help: str, **metadata: Any) -> Any:
    """A settings field: its default, its help text (the flag's), and its constraints
    (`CONSTRAINTS` keys: `at_least=1`, `choices=(...)`, ...) or annotations (`secret=True`)."""
    unknown = set(metadata) - set(CONSTRAINTS) - set(ANNOTATIONS)
    if unknown:
        raise TypeError(f"unknown setting metadata: {', '.join(sorted(unknown))}")
    # NOTE: repr=False keeps a secret out of the repr a subclass's dataclass generates too.
    return field(default=default, repr=not metadata.get("secret"),
                 metadata={"help": help, **metadata})


# -- a field's type, its value as shown, parsed and checked ----------------------------------

_TYPES: dict[str, type] = {
    "str": str, "int": int, "float": float, "bool": bool,
    "str | None": str, "int | None": int, "float | None": float,
}


def base_type(f: dataclasses.Field) -> type:
    """The type of a field's values: its group's dataclass, or the type its annotation names."""
    if GROUP in f.metadata:
        return f.metadata[GROUP]
    # `from __future__ import annotations` makes field types strings.
    return _TYPES[f.type] if isinstance(f.type, str) else f.type


def optional(f: dataclasses.Field) -> bool:
    """Whether a field may be None (unset)."""
    return isinstance(f.type, str) and f.type.endswith("| None")


def public_value(f: dataclasses.Field, value: Any) -> Any:
    """A value as a log, a message or a status page may show it: a secret as ***, a URL
    without its password."""
    if value is None:
        return None
    if f.metadata.get("secret"):
        return SECRET
    if f.metadata.get("url") and isinstance(value, str):
        return redact_url(value)
    return value


def shown(f: dataclasses.Field, value: Any) -> str:
    """A value in a message or a repr: its `public_value` repr (a set secret as a bare ***)."""
    if f.metadata.get("secret") and value is not None:
        return SECRET
    return repr(public_value(f, value))


def public_fields(obj: Any) -> dict[str, Any]:
    """Every field of `obj` as `public_value` shows it, a group's nested as a dict."""
    return {f.name: (public_fields(getattr(obj, f.name)) if GROUP in f.metadata
                     else public_value(f, getattr(obj, f.name)))
            for f in dataclasses.fields(obj)}


def parse_text(f: dataclasses.Field, label: str, text: str) -> Any:
    """`text` (an environment variable's, or a mapping's) as a value of `f`'s type; refused
    naming `label` (the variable, or the setting)."""
    kind = base_type(f)
    stripped = text.strip()
    if optional(f) and not stripped:
        return None
    if kind not in _EXPECTED:
        return text
    try:
        return _WORDS[stripped.lower()] if kind is bool else kind(stripped)
    except (KeyError, ValueError):
        raise InvalidSettings(f"{label}={shown(f, text)}: expected {_EXPECTED[kind]}") from None


def check_value(f: dataclasses.Field, value: Any) -> None:
    """Raise `InvalidSettings` for a value of the wrong type or outside `f`'s constraints."""
    if value is None and optional(f):
        return
    kind = base_type(f)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise InvalidSettings(f"{f.name} must be {kind.__name__}, got {shown(f, value)}")
    for key, constraint in CONSTRAINTS.items():
        if key in f.metadata:
            message = constraint(f, value, f.metadata[key])
            if message:
                raise InvalidSettings(message)


def validate_fields(obj: Any, rules: tuple[Callable[[Any], str | None], ...]) -> None:
    """Raise `InvalidSettings` for the first field of `obj` that `check_value` refuses, else for
    the first of `rules` (`rule(obj) -> message or None`) that `obj` breaks."""
    for f in dataclasses.fields(obj):
        check_value(f, getattr(obj, f.name))
    for rule in rules:
        message = rule(obj)
        if message:
            raise InvalidSettings(message)


def add_flags(group, fields, env_var: Callable[[str], str]) -> None:
    """One `--flag` on argparse `group` per field (`--max-batch-size` for max_batch_size), its
    help naming its variable (`env_var(name)`) and default; every flag's default is None, so
    that a given flag is told from an absent one. A bool is --flag / --no-flag."""
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        default = "unset" if f.default is None else f.default
        if f.name.endswith("_bytes"):
            default = f"{f.default} = {f.default // (1024 * 1024)} MiB"
        text = f"{f.metadata.get('help', '')} (env {env_var(f.name)}; default: {default})"
        text = text.replace("%", "%%")
        kind = base_type(f)
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=text)
        else:
            choices = f.metadata.get("choices")
            metavar = None if choices else {int: "N", float: "X"}.get(kind, f.name.upper())
            group.add_argument(flag, dest=f.name, type=kind, default=None, metavar=metavar,
                               choices=choices, help=text)
