"""`Caller`, the one way from a codec to the core (`service.core.caller`): its public surface
is its rules, and each rule is enforced at the call.

The real `Service` and a real directory store (two tenants, `acme` and `globex`, a bot each,
acme's keys of every scope), the engine on a `FakeTrunk` (no TensorFlow). Callers come from
`Service.caller`, as every transport gets them.

- The surface: every public member of `Caller` (properties and instance attributes included)
  has a rule; the checker itself refuses a subclass with one member without a rule.
- Access: every member, called by a principal of each kind (anonymous, `--auth none`
  callers, keys of scope infer, manage and metrics, the operator), is refused (Forbidden)
  exactly when `Authenticator.allows` refuses that principal the member's access: generated
  from `RULES`, so a new member cannot skip it (`CALLS` must name it).
- Ownership: a key's caller naming another tenant's bot gets the very UnknownBot of an
  unknown bot, and nothing changes; its own bot passes. A tenant named must be the key's;
  `classify` scores only heads the same caller resolved.
- One entry per request: readiness first and once, then ownership; one trip to the lookup
  threads for the heads.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

from heads import UnknownBot
from service.core import caller as caller_module
from service.core.auth import MANAGE, PUBLIC
from service.core.caller import BOT, BOTS, HEADS, RULES, TENANT, Caller, rule, surface
from service.core.engine import Images
from service.core.errors import Forbidden, NotReady, error_body, error_status
from service.core.lifecycle import LOADING
from service.core.service import Service
from store import HeadStore
from tests.backbone.helpers import encode, pattern
from tests.support.builders import random_head
from tests.support.fakes import FakeTrunk
from tests.support.servers import make_settings

pytestmark = pytest.mark.timeout(120)

TOKEN = "operator-s3cret-token"
OWN, OTHER = "acme", "globex"
OWN_BOT, OWN_BOT_2, OTHER_BOT = "acme-bot", "acme-two", "globex-bot"
SCOPES = ("infer", "manage", "metrics")
# name -> (the service's --auth, the credential: None, "operator", a scope's key, or any text)
PRINCIPALS = {
    "anonymous": ("keys", None),
    "key_infer": ("keys", "infer"),
    "key_manage": ("keys", "manage"),
    "key_metrics": ("keys", "metrics"),
    "operator": ("keys", "operator"),
    "anonymous_auth_none": ("none", None),
    "presented_auth_none": ("none", "not-the-operator-token"),
    "operator_auth_none": ("none", "operator"),
}
KINDS = {"anonymous": "anonymous", "key_infer": "key", "key_manage": "key",
         "key_metrics": "key", "operator": "operator", "anonymous_auth_none": "anonymous",
         "presented_auth_none": "presented", "operator_auth_none": "operator"}


@dataclass
class World:
    store: HeadStore
    services: dict[str, Service]
    tokens: dict[str, str]
    tmp_path: Path

    def caller(self, principal: str) -> Caller:
        mode, credential = PRINCIPALS[principal]
        token = self.tokens.get(credential, credential)
        caller = self.services[mode].caller(None if token is None else f"Bearer {token}",
                                            PUBLIC)
        assert caller.principal.kind == KINDS[principal]
        return caller


@pytest.fixture
async def world(tmp_path):
    store = HeadStore(tmp_path / "store")
    for tenant in (OWN, OTHER):
        store.add_tenant(tenant)
    for version in range(2):  # two versions: the own bot can be rolled back
        store.register(OWN_BOT, *random_head(3, seed=1 + version), tenant=OWN)
    store.register(OWN_BOT, *random_head(3, seed=5), tenant=OWN, candidate="shadow")
    store.register(OWN_BOT_2, *random_head(2, seed=7), tenant=OWN)
    store.register(OTHER_BOT, *random_head(4, seed=2), tenant=OTHER)
    store.register(OTHER_BOT, *random_head(4, seed=6), tenant=OTHER, candidate="shadow")
    tokens = {scope: store.add_key(OWN, scope)[1] for scope in SCOPES}
    tokens["operator"] = TOKEN
    services = {mode: Service(make_settings(tmp_path, auth=mode, admin_token=TOKEN),
                              store=store, trunk=FakeTrunk()) for mode in ("keys", "none")}
    for service in services.values():
        await service.start()
        assert await service.wait_ready()
    yield World(store, services, tokens, tmp_path)
    for service in services.values():
        await service.close()
    store.close()


async def outcome(call) -> BaseException | None:
    """Runs a member call (a value, or a coroutine to await); its exception, or None."""
    try:
        result = call()
        if inspect.isawaitable(result):
            await result
    except Exception as exc:  # noqa: BLE001 - the outcome is the subject
        return exc
    return None


# -- the surface -------------------------------------------------------------------------------

def test_every_public_member_of_caller_has_a_rule():
    public = [name for name in dir(Caller) if not name.startswith("_")]
    assert sorted(RULES) == sorted(public)
    assert {"ready", "status", "readiness", "top_k_default", "principal", "tenant"} <= set(
        RULES)  # properties are members too
    assert surface(Caller) == RULES


async def test_a_caller_has_no_public_state_beyond_its_rules(world):
    caller = world.caller("operator")
    assert surface(caller) == RULES
    with pytest.raises(AttributeError):
        caller.store = world.store  # no attribute can be added to a caller


def test_the_surface_checker_refuses_a_member_without_a_rule():
    class Leaky(Caller):
        async def delete_everything(self) -> None:
            """A member added without a rule."""

    class LeakyProperty(Caller):
        @property
        def engine(self):
            return None

    class Ruled(Caller):
        @rule(PUBLIC)
        def hello(self) -> str:
            return "hello"

    with pytest.raises(TypeError, match="without a rule.*: delete_everything$"):
        surface(Leaky)
    with pytest.raises(TypeError, match=": engine$"):
        surface(LeakyProperty)
    assert "hello" in surface(Ruled)


async def test_the_surface_checker_refuses_an_instance_attribute(world):
    class Open(Caller):
        pass  # no __slots__: instances get a __dict__

    caller = world.caller("operator")
    opened = Open(caller._core, caller.principal)  # noqa: SLF001 - built as Service.caller does
    opened.store = world.store
    with pytest.raises(TypeError, match=": store$"):
        surface(opened)


def test_a_rule_is_refused_when_it_cannot_be_checked():
    with pytest.raises(ValueError, match="access must be one of"):
        rule("everyone")
    with pytest.raises(ValueError, match="names its bots"):
        rule(PUBLIC, ready=True)
    with pytest.raises(ValueError, match="refusal"):
        rule(PUBLIC, owns=TENANT)
    with pytest.raises(TypeError, match="no argument 'bot_id'"):
        rule(PUBLIC, owns=BOT)(lambda self, name: name)


# -- access: every member x every principal, from the rules ---------------------------------------

def _image() -> bytes:
    return encode(pattern(7, size=(64, 64)))


# One call of each member, with arguments that change nothing when it is allowed (an unknown
# tenant, key or bot; an existing tenant to add; a version that does not exist; a head this
# caller never resolved): the subject is only whether the member refuses the caller.
CALLS = {
    "principal": lambda w, c: c.principal,
    "tenant": lambda w, c: c.tenant,
    "may": lambda w, c: c.may(PUBLIC),
    "ready": lambda w, c: c.ready,
    "status": lambda w, c: c.status,
    "readiness": lambda w, c: c.readiness,
    "readiness_report": lambda w, c: c.readiness_report(),
    "metrics_scope": lambda w, c: c.metrics_scope,
    "render_metrics": lambda w, c: c.render_metrics(),
    "run_blocking": lambda w, c: c.run_blocking(int),
    "top_k_default": lambda w, c: c.top_k_default,
    "heads_for": lambda w, c: c.heads_for([OWN_BOT]),
    "head": lambda w, c: c.head(OWN_BOT),
    "classify": lambda w, c: c.classify(Images(encoded=[_image()]), [w.store.get(OWN_BOT)],
                                        top_k=1),
    "bots": lambda w, c: c.bots(),
    "info": lambda w, c: c.info(OWN_BOT),
    "is_pinned": lambda w, c: c.is_pinned(OWN_BOT),
    "candidate_report": lambda w, c: c.candidate_report(w.store.info(OWN_BOT)),
    "int8_agreement": lambda w, c: c.int8_agreement(w.store.info(OWN_BOT)),
    "register_checkpoint": lambda w, c: c.register_checkpoint(
        "acme-new", w.tmp_path / "missing.ckpt", w.tmp_path / "missing.txt"),
    "remove": lambda w, c: c.remove("ghost"),
    "rollback": lambda w, c: c.rollback(OWN_BOT, 99),
    "promote": lambda w, c: c.promote("ghost"),
    "discard": lambda w, c: c.discard("ghost"),
    "tenants": lambda w, c: c.tenants(),
    "add_tenant": lambda w, c: c.add_tenant(OWN),
    "set_tenant_limits": lambda w, c: c.set_tenant_limits("ghost-tenant", weight=2.0),
    "remove_tenant": lambda w, c: c.remove_tenant("ghost-tenant"),
    "keys": lambda w, c: c.keys(),
    "add_key": lambda w, c: c.add_key("ghost-tenant", "infer"),
    "revoke_key": lambda w, c: c.revoke_key("ghost"),
    "audit": lambda w, c: c.audit(),
}


def test_every_member_has_a_call_in_the_access_matrix():
    assert sorted(CALLS) == sorted(RULES)


@pytest.mark.parametrize("principal", PRINCIPALS)
async def test_each_member_refuses_exactly_whom_its_access_rule_refuses(world, principal):
    caller = world.caller(principal)
    auth = world.services[PRINCIPALS[principal][0]].auth
    audit = world.store.audit()
    wrong = {}
    for name, spec in RULES.items():
        exc = await outcome(lambda name=name: CALLS[name](world, caller))
        refused = isinstance(exc, Forbidden)
        if refused != (not auth.allows(spec.access, caller.principal)):
            wrong[name] = (spec.access, repr(exc))
    assert wrong == {}
    # Nothing changed; what a key was refused for an unknown bot is audited ("refused").
    changes = [r for r in world.store.audit() if r.action != "refused"]
    assert changes == audit
    assert world.store.info(OWN_BOT).version == 2
    assert [t.name for t in world.store.tenants()] == [OWN, "default", OTHER]


# -- ownership -----------------------------------------------------------------------------------

OWNED_CALLS = {
    "heads_for": lambda c, bot: c.heads_for([OWN_BOT, bot]),
    "head": lambda c, bot: c.head(bot),
    "info": lambda c, bot: c.info(bot),
    "remove": lambda c, bot: c.remove(bot),
    "rollback": lambda c, bot: c.rollback(bot, 1),
    "promote": lambda c, bot: c.promote(bot),
    "discard": lambda c, bot: c.discard(bot),
}


def test_every_bot_owning_member_is_in_the_ownership_test():
    assert sorted(OWNED_CALLS) == sorted(n for n, r in RULES.items() if r.owns in (BOT, BOTS))


@pytest.mark.parametrize("name", sorted(OWNED_CALLS))
async def test_a_key_naming_another_tenant_s_bot_finds_an_unknown_bot(world, name):
    caller = world.caller("key_manage")  # passes every access these members need
    before = (world.store.info(OTHER_BOT), world.store.audit())
    exc = await outcome(lambda: OWNED_CALLS[name](caller, OTHER_BOT))
    assert isinstance(exc, UnknownBot), repr(exc)
    unknown = UnknownBot(OTHER_BOT)
    assert (str(exc), error_status(exc), error_body(exc)) == (
        str(unknown), error_status(unknown), error_body(unknown))
    # Nothing changed; a refused change (a MANAGE member) is audited as for an unknown bot.
    after = world.store.audit()
    assert world.store.info(OTHER_BOT) == before[0] and after[:len(before[1])] == before[1]
    refused = [(r.action, r.tenant, r.bot_id) for r in after[len(before[1]):]]
    writes = RULES[name].access == MANAGE
    assert refused == ([("refused", OWN, OTHER_BOT)] if writes else [])
    unknown_id = "nobody-" + OTHER_BOT[len("nobody-"):]
    assert len(unknown_id) == len(OTHER_BOT)
    exc = await outcome(lambda: OWNED_CALLS[name](caller, unknown_id))
    assert isinstance(exc, UnknownBot) and error_body(exc) == {
        k: v.replace(OTHER_BOT, unknown_id) for k, v in error_body(unknown).items()}
    again = world.store.audit()[len(after):]
    assert [(r.action, r.tenant, r.bot_id, r.detail) for r in again] == [
        (r.action, r.tenant, unknown_id, r.detail) for r in after[len(before[1]):]]
    # The own bot passes the same check (the member then answers, or refuses for its own
    # reason: never as an unknown bot).
    exc = await outcome(lambda: OWNED_CALLS[name](caller, OWN_BOT))
    assert not isinstance(exc, UnknownBot), repr(exc)


async def test_bots_or_heads_that_cannot_be_checked_as_given_are_refused(world):
    caller = world.caller("key_infer")
    for bots in (iter([OTHER_BOT]), OTHER_BOT):  # the checks would use up an iterator
        with pytest.raises(TypeError, match="sequence of bots"):
            await caller.heads_for(bots)
    with pytest.raises(TypeError, match="sequence of heads"):
        await caller.classify(Images(encoded=[_image()]), iter([world.store.get(OTHER_BOT)]),
                              top_k=1)


@pytest.mark.parametrize("name", sorted(OWNED_CALLS))
async def test_the_operator_reaches_every_tenant_s_bot(world, name):
    exc = await outcome(lambda: OWNED_CALLS[name](world.caller("operator"), OTHER_BOT))
    assert not isinstance(exc, UnknownBot), repr(exc)


async def test_a_key_names_only_its_own_tenant(world):
    assert sorted(n for n, r in RULES.items() if r.owns == TENANT) == [
        "audit", "register_checkpoint"]
    key, operator = world.caller("key_manage"), world.caller("operator")
    with pytest.raises(Forbidden, match="own tenant's audit log"):
        await key.audit(tenant=OTHER)
    assert {r.tenant for r in await key.audit(tenant=OWN)} == {OWN}
    assert {r.tenant for r in await key.audit()} == {OWN}
    assert OTHER in {r.tenant for r in await operator.audit(tenant=OTHER)}
    with pytest.raises(Forbidden, match="registers bots in its own tenant"):
        key.register_checkpoint("acme-new", world.tmp_path / "x", world.tmp_path / "y",
                                tenant=OTHER)
    for caller in (key, operator):  # past the rule: the missing files are the store's refusal
        exc = await outcome(lambda c=caller: c.register_checkpoint(
            "acme-new", world.tmp_path / "x", world.tmp_path / "y", tenant=OWN))
        assert exc is not None and not isinstance(exc, Forbidden), repr(exc)
    assert not world.store.exists("acme-new")


async def test_the_bots_a_key_lists_are_its_tenant_s(world):
    assert [i.bot_id for i in await world.caller("key_infer").bots()] == [OWN_BOT, OWN_BOT_2]
    assert [i.bot_id for i in await world.caller("operator").bots()] == [
        OWN_BOT, OWN_BOT_2, OTHER_BOT]


@pytest.mark.parametrize("principal", ["key_infer", "operator"])
async def test_classify_scores_only_heads_its_caller_resolved(world, principal):
    assert RULES["classify"].owns == HEADS
    caller, image = world.caller(principal), Images(encoded=[_image()])
    foreign = [world.store.get(OTHER_BOT)]  # never resolved by this caller
    with pytest.raises(UnknownBot, match=OTHER_BOT):
        await caller.classify(image, foreign, top_k=1)
    # The own bot's head, resolved by another caller, is not this one's either.
    elsewhere = await world.caller(principal).head(OWN_BOT)
    with pytest.raises(UnknownBot, match=OWN_BOT):
        await caller.classify(image, [elsewhere], top_k=1)
    head = await caller.head(OWN_BOT)
    ((prediction,),) = await caller.classify(image, [head], top_k=1)
    assert (prediction.bot_id, prediction.version) == (OWN_BOT, head.version)


# -- one entry per request ------------------------------------------------------------------------

async def test_readiness_is_checked_first_and_once_then_ownership(world, monkeypatch):
    service = world.services["keys"]
    caller = world.caller("key_infer")
    service.readiness.status = LOADING
    with pytest.raises(NotReady):  # not UnknownBot: readiness before ownership
        await caller.heads_for([OTHER_BOT])
    with pytest.raises(NotReady):
        await caller.head(OTHER_BOT)
    service.readiness.status = "ready"

    checks, hops, notes = [], [], []
    lifecycle, threads = service.lifecycle, caller._core.threads  # noqa: SLF001
    monkeypatch.setattr(lifecycle, "require_ready",
                        lambda real=lifecycle.require_ready: checks.append(1) or real())
    real_lookup = threads.lookup

    async def lookup(fn, *args):
        hops.append(fn)
        return await real_lookup(fn, *args)

    monkeypatch.setattr(threads, "lookup", lookup)
    monkeypatch.setattr(caller_module.logs, "note", lambda **kw: notes.append(sorted(kw)))
    heads = await caller.heads_for([OWN_BOT, OWN_BOT_2])
    assert [h.bot_id for h in heads] == [OWN_BOT, OWN_BOT_2]
    assert (len(checks), len(hops)) == (1, 1)  # one readiness check, one trip for the heads
    assert notes == [["bots"], ["heads", "tenant"]]  # each noted once
    with pytest.raises(UnknownBot):
        await caller.heads_for([OWN_BOT, OTHER_BOT])
    assert len(hops) == 1  # refused before any lookup
