"""`multihead tenants|keys|audit`: the operator's commands over a store (the same changes as
`/tenants`, `/keys` and `/audit` over HTTP; recorded in the audit log as the operator).

`keys add` prints the new key's secret once, alone on the last line of stdout (`| tail -1`);
only its hash is stored, so it cannot be shown again: revoke it and make another.

`tenants add` and `tenants set` take a tenant's limits (`accounts.tenants.LIMITS`): fair sharing
`--weight`, `--rate`, `--burst`, `--max-queued`, and what it stores `--max-bots`,
`--max-versions`, `--max-head-bytes`, `--registrations-per-minute`, each a number in its range
or `default` (the serve default). A bad value is refused while the flags are parsed, before the
store is opened, in one line naming the flag and the limit's range (exit 2), as the store's
refusals are.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from accounts.errors import InvalidLimits
from accounts.tenants import (
    LIMIT_NAMES,
    LIMITS,
    TenantLimits,
    describe_limits,
    format_limit,
    validate_limit,
)
from cli.options import open_store, store_option

SCOPE_HELP = ("infer: call and list the tenant's bots; manage: also register, replace, roll "
              "back and remove them; metrics: read /metrics and the full /readyz")
DEFAULT_WORD = "default"
LIMIT_METAVARS = {"weight": "W", "rate": "IMAGES_PER_S", "burst": "N", "max_queued": "ROWS",
                  "max_bots": "BOTS", "max_versions": "VERSIONS", "max_head_bytes": "BYTES",
                  "registrations_per_minute": "N", "deadline_ms": "MS"}
# `tenants list` headers (the limit's name in capitals, shorter where it is long)
LIMIT_HEADERS = {"registrations_per_minute": "REG_PER_MIN"}


def limit_flag(name: str) -> str:
    """The flag of limit `name`: --weight, --rate, --burst, --max-queued."""
    return "--" + name.replace("_", "-")


def limit_value(name: str) -> Callable[[str], float | int | None]:
    """The argparse type of limit `name`: a number in its range (`accounts.tenants.validate_limit`,
    the store's own check), or the word `default` (None: back to the serve default)."""
    limit = LIMITS[name]

    def parse(text: str) -> float | int | None:
        if text.strip().lower() == DEFAULT_WORD:
            return None
        try:
            value: float | int = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                shown = text if len(text) <= 40 else text[:37] + "..."
                raise argparse.ArgumentTypeError(
                    f"{name} must be {limit.range_text} or '{DEFAULT_WORD}', got "
                    f"{shown!r}") from None
        try:
            return validate_limit(name, value)
        except InvalidLimits as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name  # what argparse names in "invalid <type> value" messages
    return parse


class OneLineErrors(argparse.ArgumentParser):
    """The parser of the `tenants` actions: a usage error is one line, `<prog>: error: <why>`,
    exit 2 (argparse would print the usage first, several lines): the refusal of a bad limit
    reads like the store's own refusals. `--help` shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def limit_options() -> argparse.ArgumentParser:
    """Parent parser with a flag per limit (absent from the namespace unless given)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group(
        "limits", "the tenant's share of the trunk (fair sharing) and what it stores; each a "
                  "number or "
                  f"'{DEFAULT_WORD}' (the server's setting)")
    for name, limit in LIMITS.items():
        unit = f" {limit.unit}" if limit.unit else ""
        group.add_argument(limit_flag(name), dest=name, metavar=LIMIT_METAVARS[name],
                           type=limit_value(name), default=argparse.SUPPRESS,
                           help=f"{limit.meaning}: {limit.range_text}{unit}, or "
                                f"'{DEFAULT_WORD}'")
    return parent


def _limits_given(args: argparse.Namespace) -> dict[str, float | int | None]:
    return {name: getattr(args, name) for name in LIMIT_NAMES if hasattr(args, name)}


def add_commands(sub) -> None:
    """Add `tenants {add,set,list,remove}`, `keys {add,list,revoke}` and `audit` to
    `multihead`."""
    store = store_option()
    limits = limit_options()

    tenants = sub.add_parser(
        "tenants", help="add, set, list or remove tenants (the customers bots and keys "
                        "belong to)",
        description="Tenants own bots and API keys: a key sees and calls only its tenant's "
                    "bots. The tenant 'default' always exists (bots of older stores are "
                    "in it). Each tenant has limits for sharing the trunk (weight, rate, "
                    "burst, max queued images); an unset one is the server's setting.")
    tenants_sub = tenants.add_subparsers(dest="tenants_command", required=True,
                                         metavar="ACTION", parser_class=OneLineErrors)
    p = tenants_sub.add_parser("add", parents=[store, limits], help="add a tenant",
                               description="Add a tenant, with its limits if given.")
    p.add_argument("name", metavar="NAME", help="tenant name (the characters of a bot id)")
    p.set_defaults(func=cmd_tenants_add)
    p = tenants_sub.add_parser(
        "set", parents=[store, limits], help="change a tenant's limits",
        description="Change a tenant's limits ('default' too): each flag given sets its "
                    f"limit ('{DEFAULT_WORD}': back to the server's setting), the others stay "
                    "as they are. Every server process on the store reads the new limits within a "
                    "second.")
    p.add_argument("name", metavar="NAME", help="the tenant")
    p.set_defaults(func=cmd_tenants_set)
    p = tenants_sub.add_parser("list", parents=[store],
                               help="list tenants with bot counts and limits")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_tenants_list)
    p = tenants_sub.add_parser(
        "remove", parents=[store], help="remove a tenant",
        description="Remove a tenant. Refused while it owns bots, unless --force, which "
                    "also removes its bots and revokes its keys.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--force", action="store_true",
                   help="also remove its bots and revoke its keys")
    p.set_defaults(func=cmd_tenants_remove)

    keys = sub.add_parser(
        "keys", help="add, list or revoke API keys",
        description="API keys authenticate clients (`Authorization: Bearer <key>`; gRPC: "
                    "the `authorization` metadata). A revoked key is refused by every "
                    "server process within a second.")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    p = keys_sub.add_parser(
        "add", parents=[store], help="make a key; its secret is printed once, last",
        description="Make an API key for a tenant and print its secret, alone on the last "
                    "line of stdout. Only a hash of it is stored: keep it now.")
    p.add_argument("--tenant", metavar="NAME", required=True, help="the key's tenant")
    p.add_argument("--scope", choices=("infer", "manage", "metrics"), default="infer",
                   help=f"what it may do (default: infer). {SCOPE_HELP}")
    p.set_defaults(func=cmd_keys_add)
    p = keys_sub.add_parser("list", parents=[store], help="list keys (never their secrets)")
    p.add_argument("--tenant", metavar="NAME", default=None, help="only this tenant's keys")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_keys_list)
    p = keys_sub.add_parser("revoke", parents=[store], help="revoke a key")
    p.add_argument("key_id", metavar="ID", help="the key's id (`keys list`)")
    p.set_defaults(func=cmd_keys_revoke)

    p = sub.add_parser(
        "audit", parents=[store], help="show the audit log",
        description="Every registration, replacement, rollback and removal of a bot, and "
                    "every tenant and key change, oldest first: time, actor (operator or "
                    "key:<id>), tenant, bot, version and head digest.")
    p.add_argument("--tenant", metavar="NAME", default=None, help="only this tenant's")
    p.add_argument("--since", metavar="TIME", default=None,
                   help="only records at or after this ISO 8601 time (e.g. 2026-12-01)")
    p.add_argument("--limit", type=int, default=1000, help="at most this many (default 1000)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_audit)



def _show(items: list, as_json: bool, header: tuple[str, ...], row) -> int:
    """Items as JSON (their `to_dict`), or as a table: `header`, then `row(item)` each."""
    if as_json:
        print(json.dumps([item.to_dict() for item in items], indent=2))
        return 0
    rows = [header, *(row(item) for item in items)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_tenants_add(args: argparse.Namespace) -> int:
    given = _limits_given(args)
    with open_store(args) as store:
        info = store.add_tenant(args.name, limits=TenantLimits(**given) if given else None)
    print(f"added tenant '{info.name}'" + (f" ({describe_limits(given)})" if given else ""))
    return 0


def cmd_tenants_set(args: argparse.Namespace) -> int:
    given = _limits_given(args)
    if not given:
        raise InvalidLimits("nothing to set: give one or more of "
                            f"{', '.join(limit_flag(n) for n in LIMIT_NAMES)}")
    with open_store(args) as store:
        limits = store.set_tenant_limits(args.name, **given)
    print(f"limits of tenant '{args.name}': {describe_limits(limits.to_dict())}")
    return 0


def cmd_tenants_list(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        tenants = store.tenants()
    return _show(tenants, args.json,
                 ("TENANT", "BOTS", *(LIMIT_HEADERS.get(n, n.upper()) for n in LIMIT_NAMES),
                  "CREATED"),
                 lambda t: (t.name, str(t.bots),
                            *(format_limit(v) for v in t.limits.to_dict().values()),
                            t.created or "-"))


def cmd_tenants_remove(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        store.remove_tenant(args.name, force=args.force)
    print(f"removed tenant '{args.name}'")
    return 0


def cmd_keys_add(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        key, token = store.add_key(args.tenant, args.scope)
    print(f"added key {key.id} ({key.scope}) for tenant '{key.tenant}'; its secret, shown "
          f"only now:")
    print(token)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        keys = store.keys(args.tenant)
    return _show(keys, args.json,
                 ("ID", "PREFIX", "TENANT", "SCOPE", "CREATED", "LAST USED", "REVOKED"),
                 lambda k: (k.id, k.prefix, k.tenant, k.scope, k.created, k.last_used or "-",
                            k.revoked or "-"))


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        key = store.revoke_key(args.key_id)
    print(f"revoked key {key.id} of tenant '{key.tenant}'")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        records = store.audit(tenant=args.tenant, since=args.since, limit=args.limit)
    return _show(records, args.json,
                 ("AT", "ACTOR", "ACTION", "TENANT", "BOT", "VERSION", "DIGEST"),
                 lambda r: (r.at, r.actor, r.action, r.tenant or "-", r.bot_id or "-",
                            "-" if r.version is None else str(r.version), (r.digest or "-")[:12]))
