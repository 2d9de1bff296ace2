"""`Caller`: the service as the caller of one call sees it, the one way from a codec to the core.

`Service.caller()` identifies the caller and checks the endpoint's access rule (`dispatch`,
the gRPC transport); the handler then gets a `Caller`. Every public member of `Caller` states
its own rule with `@rule`, which records it on the member and enforces it at each call:

- `access`: who may use the member (`service.core.auth`: PUBLIC, INFER, MANAGE, METRICS,
  OPERATOR), as `Authenticator.allows` decides for the caller; refused: Forbidden (403).
- `owns`: what the arguments name must belong to the caller. BOT / BOTS: the bots named by
  `bot_id` / `bot_ids` must be its tenant's (a key's caller); another tenant's bot is an unknown
  bot, the same UnknownBot (404, same body). HEADS: the heads given must be ones this caller
  resolved (`head`, `heads_for`: readiness and ownership were checked then). TENANT: the
  tenant named by `tenant`, if any, must be the caller's (a key's caller); refused: Forbidden.
  The operator (and anyone with --auth none) sees every tenant: for it only HEADS applies.
  A MANAGE member that owns BOT audits a key's caller refused with UnknownBot (action
  "refused", in the caller's tenant, naming the id asked for and the change): an unknown bot
  and another tenant's are refused, and recorded, alike, so the operator sees probing.
- `ready`: the member resolves heads for scoring: the bots it names go to the request's access
  line, then readiness is checked (NotReady, 503), before ownership: a request's one readiness
  check.

Endpoints check their own access rule before the handler runs; the member rules make a codec
that calls a member its endpoint should not fail closed. Nothing else of the service is
reachable from a `Caller` (no attribute forwarding), and `surface(Caller)` (run at import)
refuses a public member without a rule.
"""
from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from accounts.errors import BotOwnedElsewhere
from accounts.tenants import DEFAULT_TENANT, ApiKey, AuditRecord, TenantInfo, TenantLimits
from heads import Head, UnknownBot
from service.core import logs
from service.core.auth import (
    ACCESS,
    INFER,
    MANAGE,
    METRICS,
    OPERATOR,
    PUBLIC,
    Authenticator,
    Principal,
)
from service.core.bots import Bots
from service.core.engine import Images, Prediction
from service.core.errors import Forbidden
from service.core.inference import Inference
from service.core.lifecycle import Lifecycle, Readiness
from service.core.metrics_scope import Scope
from service.core.settings import Settings
from service.core.tenancy import Tenancy
from service.core.threads import Threads
from store import BotInfo, HeadStore

# What a member's arguments must belong to (`Rule.owns`), and the argument that names it.
BOT, BOTS, HEADS, TENANT = "bot", "bots", "heads", "tenant"
OWNS = {BOT: "bot_id", BOTS: "bot_ids", HEADS: "heads", TENANT: "tenant"}
RULE_ATTRIBUTE = "__caller_rule__"
# The change a refused member asked for, as the "refused" audit record's detail names it.
REFUSED_CHANGES = {"remove": "remove", "rollback": "rollback", "promote": "candidate_promote",
                   "discard": "candidate_discard"}

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Rule:
    """The rule of one `Caller` member (see the module doc).

    Attributes:
        access: who may use it: one of `service.core.auth.ACCESS`.
        owns: None, or what its arguments name must belong to the caller: BOT, BOTS, HEADS,
            TENANT.
        ready: it resolves heads for scoring (readiness first).
        refusal: the 403's message when TENANT refuses.
    """

    access: str
    owns: str | None = None
    ready: bool = False
    refusal: str = ""

    def __post_init__(self) -> None:
        if self.access not in ACCESS:
            raise ValueError(f"access must be one of {ACCESS}, not {self.access!r}")
        if self.owns is not None and self.owns not in OWNS:
            raise ValueError(f"owns must be one of {sorted(OWNS)} or None, not {self.owns!r}")
        if self.ready and self.owns not in (BOT, BOTS):
            raise ValueError("a member that resolves heads names its bots (owns BOT or BOTS)")
        if (self.owns == TENANT) != bool(self.refusal):
            raise ValueError("a TENANT rule, and only it, says why it refuses (refusal)")


def rule(access: str, *, owns: str | None = None, ready: bool = False,
         refusal: str = "") -> Callable[[F], F]:
    """Gives a `Caller` member its rule: recorded on it (`rule_of`) and enforced at each call,
    before the member's body runs (`Caller` methods, sync or async, and property getters)."""
    spec = Rule(access, owns, ready, refusal)

    def decorate(fn: F) -> F:
        named = _argument(fn, OWNS[owns]) if owns is not None else _nothing
        audited = access == MANAGE and owns == BOT
        if audited and not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{fn.__name__}: a MANAGE member that owns BOT is async (its "
                            f"refusals are audited off the event loop)")
        if audited:
            @functools.wraps(fn)
            async def member(self: Caller, *args: Any, **kwargs: Any) -> Any:
                bot_id = named(args, kwargs)
                try:
                    self._enter(fn.__name__, spec, bot_id)
                    return await fn(self, *args, **kwargs)
                except UnknownBot:
                    await self._core.threads.blocking(
                        self._record_refusal, bot_id,
                        f"{REFUSED_CHANGES.get(fn.__name__, fn.__name__)}: unknown bot")
                    raise
        elif inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def member(self: Caller, *args: Any, **kwargs: Any) -> Any:
                self._enter(fn.__name__, spec, named(args, kwargs))
                return await fn(self, *args, **kwargs)
        else:
            @functools.wraps(fn)
            def member(self: Caller, *args: Any, **kwargs: Any) -> Any:
                self._enter(fn.__name__, spec, named(args, kwargs))
                return fn(self, *args, **kwargs)
        setattr(member, RULE_ATTRIBUTE, spec)
        return member  # type: ignore[return-value]

    return decorate


def _nothing(args: tuple, kwargs: dict) -> None:
    return None


def _argument(fn: Callable[..., Any], name: str) -> Callable[[tuple, dict], Any]:
    """Reads argument `name` of a call of method `fn` from its (args, kwargs), self excluded."""
    parameters = list(inspect.signature(fn).parameters.values())[1:]
    found = [(i, p) for i, p in enumerate(parameters) if p.name == name]
    if not found:
        raise TypeError(f"{fn.__name__} has no argument {name!r} to check")
    index, parameter = found[0]
    positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    default = None if parameter.default is parameter.empty else parameter.default

    def read(args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        if positional and index < len(args):
            return args[index]
        return default

    return read


def rule_of(member: Any) -> Rule | None:
    """The rule recorded on a member (a function, or a property's getter), or None."""
    if isinstance(member, property):
        member = member.fget
    return getattr(member, RULE_ATTRIBUTE, None)


def surface(target: Any) -> dict[str, Rule]:
    """Every public member of a `Caller` class or instance, properties and instance attributes
    included, with its rule.

    Raises:
        TypeError: naming each public member without a rule.
    """
    rules: dict[str, Rule] = {}
    missing = []
    for name in dir(target):
        if name.startswith("_"):
            continue
        found = rule_of(inspect.getattr_static(target, name))
        if found is None:
            missing.append(name)
        else:
            rules[name] = found
    if missing:
        raise TypeError(f"{getattr(target, '__name__', type(target).__name__)}: public "
                        f"member(s) without a rule (@rule): {', '.join(missing)}")
    return rules


@dataclass(frozen=True)
class Core:
    """What of one process's `Service` a `Caller` reaches (built once by the service)."""

    settings: Settings
    auth: Authenticator
    store: HeadStore
    threads: Threads
    lifecycle: Lifecycle
    bots: Bots
    tenancy: Tenancy
    inference: Inference


class Caller:
    """The service as the caller of one call sees it (see the module doc): what `dispatch`
    (and the gRPC transport) hand to a codec, so that every protocol gets the same tenant
    rules at one place.

    A key's caller reaches only its tenant's bots: another tenant's bot is an unknown bot for
    every lookup, listing and change, and a new bot goes into the key's tenant. The operator
    (and anyone with --auth none) reaches every bot; a new bot goes into the tenant asked for,
    else the bot's own, else `default`. Changes are recorded in the audit log under the
    caller's name (`Principal.actor`).

    A classification is charged to the tenant that owns the bots (a key's own tenant; for the
    operator, the tenant of the first bot named): its quota and fair share (`Engine`).
    """

    # NOTE: no instance attribute can be added by mistake: what a codec reaches is the rules.
    __slots__ = ("_core", "_principal", "_route_key", "_charged", "_resolved")

    def __init__(self, core: Core, principal: Principal, *,
                 route_key: str | None = None) -> None:
        self._core = core
        self._principal = principal
        self._route_key = route_key  # the call's routing key for canaries, if it gave one
        self._charged: str | None = None  # the tenant of this call's classification
        # The heads this caller resolved (HEADS), by (bot id, version).
        self._resolved: dict[tuple[str, int], Head] = {}

    # -- the rules at each call --------------------------------------------------------------------

    def _enter(self, name: str, spec: Rule, named: Any) -> None:
        """Applies `spec` to a call of member `name` whose owned argument is `named`."""
        if not self._core.auth.allows(spec.access, self._principal):
            raise Forbidden(f"'{name}' is not open to this caller (it needs {spec.access} "
                            f"access)")
        if spec.owns in (BOTS, HEADS) and (isinstance(named, str)
                                           or not isinstance(named, Sequence)):
            # NOTE: an iterator would be used up by the checks, and a string is not a list.
            raise TypeError(f"'{name}' takes a sequence of {spec.owns}, not {type(named)}")
        bot_ids = (named,) if spec.owns == BOT else named if spec.owns == BOTS else ()
        if spec.ready:
            logs.note(bots=bot_ids)  # the request's bots, whatever answers it
            self._core.lifecycle.require_ready()
        tenant = self._principal.tenant
        if spec.owns == HEADS:
            for head in named:
                if self._resolved.get((head.bot_id, head.version)) is not head:
                    raise UnknownBot(head.bot_id)
        elif tenant is None:
            return
        elif spec.owns == TENANT:
            if named not in (None, tenant):
                raise Forbidden(spec.refusal)
        else:
            owner = self._core.store.owner  # from memory (`HeadStore.owner`): no thread hop
            for bot_id in bot_ids:
                if owner(bot_id) != tenant:
                    raise UnknownBot(bot_id)

    def _record_refusal(self, bot_id: str, detail: str) -> None:
        """Audits a key's caller refused a change of `bot_id` (`HeadStore.record_refusal`),
        best effort: the refusal is answered even if the store cannot record it. Blocking."""
        tenant = self._principal.tenant
        if tenant is None:
            return  # the operator sees every bot: nothing to probe
        try:
            self._core.store.record_refusal(bot_id, tenant=tenant, actor=self._principal.actor,
                                            detail=detail)
        except Exception as exc:  # noqa: BLE001 - the answer must not depend on the audit
            log.warning("could not audit the refusal of %r to %s: %s", bot_id,
                        self._principal.actor, exc)

    # -- who calls ---------------------------------------------------------------------------------

    @property
    @rule(PUBLIC)
    def principal(self) -> Principal:
        """Who calls."""
        return self._principal

    @property
    @rule(PUBLIC)
    def tenant(self) -> str | None:
        """The one tenant this caller sees, or None for every tenant."""
        return self._principal.tenant

    @rule(PUBLIC)
    def may(self, access: str) -> bool:
        """Whether this caller may call an endpoint (or a member) with rule `access`."""
        return self._core.auth.allows(access, self._principal)

    # -- readiness and operations ------------------------------------------------------------------

    @property
    @rule(PUBLIC)
    def ready(self) -> bool:
        """Whether the service is ready (the trunk is warm, the hot heads are resident)."""
        return self._core.lifecycle.readiness.ready

    @property
    @rule(PUBLIC)
    def status(self) -> str:
        """Readiness as the minimal /readyz says it: loading, ready or failed."""
        return self._core.lifecycle.readiness.status

    @property
    @rule(INFER)
    def readiness(self) -> Readiness:
        """Where the bring-up is, its error included (a model's status tells it)."""
        return self._core.lifecycle.readiness

    @property
    @rule(METRICS)
    def metrics_scope(self) -> Scope | None:
        """What of the metrics and the full readiness report this caller reads: None (all
        of it) for the operator and with --auth none; for a key's caller its tenant and the
        tenant's bots as the store snapshot owns them now (`service.core.metrics_scope`)."""
        tenant = self._principal.tenant
        if tenant is None:
            return None
        owners = self._core.store.snapshot.owners
        return Scope(tenant, frozenset(bot for bot, owner in owners.items() if owner == tenant))

    @rule(METRICS)
    def readiness_report(self) -> dict[str, Any]:
        """The full readiness report (`/readyz` for who may read metrics); a key's caller
        reads its own bots only (`Lifecycle.readiness_report`)."""
        return self._core.lifecycle.readiness_report(self.metrics_scope)

    @rule(METRICS)
    def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus text and its content type: a key's caller reads its own tenant's
        series only (`service.core.metrics_scope`)."""
        return self._core.lifecycle.render_metrics(self.metrics_scope)

    @rule(PUBLIC)
    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the default executor (parsing, registrations, file reads)."""
        return await self._core.threads.blocking(fn, *args)

    # -- classification ----------------------------------------------------------------------------

    @property
    @rule(INFER)
    def top_k_default(self) -> int:
        """Labels per image when a request does not say (`--top-k-default`)."""
        return self._core.settings.top_k_default

    @rule(INFER, owns=BOTS, ready=True)
    async def heads_for(self, bot_ids: Sequence[str]) -> list[Head]:
        """The active heads of the bots a request will be scored with: this is the request's
        one readiness check, before any work on it: NotReady (503 + Retry-After) while the
        trunk loads or after it failed; then UnknownBot (404, another tenant's bot too),
        HeadUnavailable, StoreUnavailable per bot, in order."""
        return await self._heads(bot_ids)

    @rule(INFER, owns=BOT, ready=True)
    async def head(self, bot_id: str) -> Head:
        """`heads_for([bot_id])[0]`: readiness, then the bot's active head."""
        (head,) = await self._heads((bot_id,))
        return head

    async def _heads(self, bot_ids: Sequence[str]) -> list[Head]:
        heads = await self._core.bots.heads(bot_ids)
        for head in heads:
            self._resolved[head.bot_id, head.version] = head
        self._charged = self._charge_to(heads)
        logs.note(tenant=self._charged, heads=heads)
        return heads

    def _charge_to(self, heads: Sequence[Head]) -> str:
        if self._principal.tenant is not None:
            return self._principal.tenant
        if not heads:
            return DEFAULT_TENANT
        try:
            return self._core.store.owner(heads[0].bot_id)
        except UnknownBot:  # removed since its head was resolved: the request still runs
            return DEFAULT_TENANT

    @rule(INFER, owns=HEADS)
    async def classify(self, images: Images, heads: Sequence[Head], *,
                       top_k: int, route_key: str | None = None,
                       all_scores: bool = False) -> list[list[Prediction]]:
        """Every image under every head (resolved by `head` / `heads_for`): result[i][j] is
        image i under heads[j] (`Inference.classify`; `all_scores`: the protocol renders every
        class's probability, counted in the answer's bound), charged to the bots' tenant.
        `route_key` (an OIP request's parameter) wins over the call's own (its header or
        metadata)."""
        tenant = self._charged if self._charged is not None else self._charge_to(heads)
        return await self._core.inference.classify(images, heads, top_k=top_k, tenant=tenant,
                                                   route_key=route_key or self._route_key,
                                                   all_scores=all_scores)

    # -- bots --------------------------------------------------------------------------------------

    @rule(INFER)
    async def bots(self) -> list[BotInfo]:
        """Every bot this caller sees: a key's caller, its tenant's only."""
        infos = await self._core.bots.list()
        tenant = self._principal.tenant
        return infos if tenant is None else [i for i in infos if i.tenant == tenant]

    @rule(INFER, owns=BOT)
    async def info(self, bot_id: str) -> BotInfo:
        """The registry's view of one bot (no head load)."""
        return await self._core.bots.info(bot_id)

    @rule(INFER)
    def is_pinned(self, bot_id: str) -> bool:
        """Whether the bot is pinned (`--pin`): from the settings alone, no store read."""
        return self._core.bots.is_pinned(bot_id)

    @rule(MANAGE)
    def candidate_report(self, info: BotInfo) -> dict | None:
        """The candidate of a bot this caller reached (`info`), as a caller that may manage
        it sees it (`Bots.candidate_report`)."""
        return self._core.bots.candidate_report(info)

    @rule(INFER)
    async def int8_agreement(self, info: BotInfo) -> float | None:
        """The agreement with the INT8 trunk of a bot this caller reached (`info`), scored
        once per version (`Bots.int8_agreement`)."""
        return await self._core.bots.int8_agreement(info)

    @rule(MANAGE, owns=TENANT, refusal="an API key registers bots in its own tenant only")
    def register_checkpoint(self, bot_id: str, prefix: Path, labels_path: Path, *,
                            tenant: str | None = None, **options: Any) -> int:
        """Registers a head checkpoint as the bot's new active version (`options` as
        `HeadStore.register_checkpoint` takes them), in `tenant`: a key's own; for the operator
        the one asked for, else the bot's own if it exists, else `default`. Blocking (it reads
        the checkpoint): call it in a worker thread (`run_blocking`).

        A key's candidate (`options["candidate"]`) for a bot of another tenant is refused as
        for an unknown bot (UnknownBot, before the checkpoint is read), a new bot whose id
        another tenant owns with BotOwnedElsewhere (ids are one namespace: its answer names no
        tenant); both are audited ("refused")."""
        own = self._principal.tenant
        change = "candidate_add" if options.get("candidate") is not None else "register"
        try:
            if own is not None and change == "candidate_add" \
                    and self._core.store.owner(bot_id) != own:
                raise UnknownBot(bot_id)
            owner = self._tenant_for(bot_id, tenant)
            # The owner's limits, whoever registers (the operator too).
            self._core.tenancy.take_registration(owner)
            return self._core.bots.register_checkpoint(
                bot_id, prefix, labels_path, tenant=owner, actor=self._principal.actor,
                defaults=self._core.tenancy.defaults, **options)
        except UnknownBot:
            self._record_refusal(bot_id, f"{change}: unknown bot")
            raise
        except BotOwnedElsewhere:
            self._record_refusal(bot_id, f"{change}: bot id taken")
            raise

    def _tenant_for(self, bot_id: str, asked: str | None) -> str:
        if self._principal.tenant is not None:
            return self._principal.tenant
        if asked is not None:
            return asked
        try:
            return self._core.store.owner(bot_id)
        except UnknownBot:
            return DEFAULT_TENANT

    @rule(MANAGE, owns=BOT)
    async def remove(self, bot_id: str) -> None:
        """Removes a bot and every version of it."""
        await self._core.bots.remove(bot_id, actor=self._principal.actor)

    @rule(MANAGE, owns=BOT)
    async def rollback(self, bot_id: str, to: int | None) -> int:
        """Makes version `to` (default: the previous one) the bot's active version."""
        return await self._core.bots.rollback(bot_id, to, actor=self._principal.actor)

    @rule(MANAGE, owns=BOT)
    async def promote(self, bot_id: str) -> tuple[int, int]:
        """Makes the bot's candidate its active version: (previous, new active version)."""
        return await self._core.bots.promote(bot_id, actor=self._principal.actor)

    @rule(MANAGE, owns=BOT)
    async def discard(self, bot_id: str) -> int:
        """Deletes the bot's candidate; returns its version."""
        return await self._core.bots.discard(bot_id, actor=self._principal.actor)

    # -- tenants, keys, audit ----------------------------------------------------------------------

    @rule(OPERATOR)
    async def tenants(self) -> list[TenantInfo]:
        """Every tenant with its count of bots and its limits."""
        return await self._core.tenancy.tenants()

    @rule(OPERATOR)
    async def add_tenant(self, name: str, *, limits: TenantLimits | None = None) -> TenantInfo:
        """Creates a tenant, with its limits if given."""
        return await self._core.tenancy.add_tenant(name, actor=self._principal.actor,
                                                   limits=limits)

    @rule(OPERATOR)
    async def set_tenant_limits(self, name: str, **changes: float | int | None) -> TenantLimits:
        """Changes a tenant's limits (`Tenancy.set_tenant_limits`); returns them."""
        return await self._core.tenancy.set_tenant_limits(name, actor=self._principal.actor,
                                                          **changes)

    @rule(OPERATOR)
    async def remove_tenant(self, name: str, *, force: bool = False) -> None:
        """Deletes a tenant and revokes its keys (`force`: its bots too)."""
        await self._core.tenancy.remove_tenant(name, force=force,
                                               actor=self._principal.actor)

    @rule(OPERATOR)
    async def keys(self, tenant: str | None = None) -> list[ApiKey]:
        """Every key (only `tenant`'s if given), revoked ones included."""
        return await self._core.tenancy.keys(tenant)

    @rule(OPERATOR)
    async def add_key(self, tenant: str, scope: str) -> tuple[ApiKey, str]:
        """Makes an API key of `tenant`: (the key, its token, shown this once)."""
        return await self._core.tenancy.add_key(tenant, scope, actor=self._principal.actor)

    @rule(OPERATOR)
    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revokes a key."""
        return await self._core.tenancy.revoke_key(key_id, actor=self._principal.actor)

    @rule(MANAGE, owns=TENANT, refusal="an API key reads its own tenant's audit log only")
    async def audit(self, *, tenant: str | None = None, since: str | None = None,
                    limit: int = 1000) -> list[AuditRecord]:
        """The audit log, oldest first: a key's caller reads its own tenant's only."""
        return await self._core.tenancy.audit(tenant=self._principal.tenant or tenant,
                                              since=since, limit=limit)


# Every public member of Caller with its rule: a member without one fails here, at import.
RULES = surface(Caller)
