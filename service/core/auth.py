"""Who is calling and what they may do: the operator credential, tenants' API keys, and the
access rule of every endpoint. No web framework here: `dispatch` (HTTP, Ray) and the gRPC
transport both call `Authenticator.identify` then `Authenticator.authorize`, once per call.

Credentials travel as `Authorization: Bearer <credential>` (gRPC: the `authorization`
metadata):

- the operator credential: the server's admin token (`MULTIHEAD_ADMIN_TOKEN`), compared in
  constant time. It manages tenants and keys and sees every tenant's bots;
- a tenant's API key (`multihead keys add`): `mhk_<id>_<secret>`. Only its SHA-256 is stored;
  the keys are read from the store's cached key table (`HeadStore.key_table`, refreshed when
  the store changes: a revocation anywhere reaches every process within a fraction of a
  second), so checking one costs no store round trip.

Access rules (`Endpoint.access`):

    PUBLIC    anyone (liveness, the minimal /readyz, the API description, the page)
    INFER     a key of scope infer or manage (its tenant's bots only), or the operator
    MANAGE    a key of scope manage (its tenant's bots only), or the operator
    METRICS   a key of scope metrics, or the operator (/metrics, the full /readyz)
    OPERATOR  the operator only (tenants, keys)

`--auth none` turns keys off: PUBLIC, INFER and METRICS routes are open to anyone for every
bot, and MANAGE and OPERATOR routes need the operator credential (the behaviour before
tenants existed). Missing or unusable credentials are 401 (with `WWW-Authenticate`), a
credential without the right is 403; a bot of another tenant is never 403 but 404, exactly
as an unknown bot (see `service.core.caller.Caller`).
"""
from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from accounts.tenants import OPERATOR as OPERATOR_ACTOR
from accounts.tenants import parse_token, token_hash
from service.core.errors import Forbidden, Unauthorized

log = logging.getLogger(__name__)

PUBLIC, INFER, MANAGE, METRICS, OPERATOR = "public", "infer", "manage", "metrics", "operator"
ACCESS = (PUBLIC, INFER, MANAGE, METRICS, OPERATOR)
AUTH_MODES = ("keys", "none")
# Which key scopes each rule accepts (the operator passes every rule).
_SCOPES = {INFER: ("infer", "manage"), MANAGE: ("manage",), METRICS: ("metrics",),
           OPERATOR: ()}
USED_FLUSH_S = 10.0  # how often the keys' `last_used` times are written to the store


@dataclass(frozen=True)
class Principal:
    """Who a call comes from.

    Attributes:
        kind: "operator", "key", "anonymous" (no credential) or "presented" (with --auth
            none, a credential that is not the operator's).
        tenant: a key's tenant; None: every tenant (the operator, or anyone with --auth none).
        scope: a key's scope.
        key_id: a key's public id (never its secret).
    """

    kind: str
    tenant: str | None = None
    scope: str | None = None
    key_id: str | None = None

    @property
    def actor(self) -> str:
        """How the audit log names it: "operator", "key:<id>" or "anonymous"."""
        if self.kind == "key":
            return f"key:{self.key_id}"
        return OPERATOR_ACTOR if self.kind == "operator" else "anonymous"


ANONYMOUS = Principal("anonymous")
THE_OPERATOR = Principal("operator")
# With --auth none, a credential that is not the operator's: anyone, as without one (but a
# MANAGE or OPERATOR route answers 403 'admin token not accepted' rather than 401).
PRESENTED = Principal("presented")


def bearer(authorization: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <credential>` value; None when absent.

    Raises:
        Unauthorized: present but not a bearer credential.
    """
    if authorization is None:
        return None
    scheme, _, given = authorization.strip().partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given or any(c.isspace() for c in given):
        raise Unauthorized("malformed Authorization header: send 'Authorization: Bearer "
                           "<API key or operator token>'")
    return given


class Authenticator:
    """Identifies callers and applies the access rules (see the module doc).

    Args:
        mode: "keys" or "none".
        operator_token: the admin token; None disables the operator credential.
        keys: returns the live keys by id (`HeadStore.key_table`: cached, cheap).
        mark_used: records {key id: ISO time} of keys used (`HeadStore.mark_used`), called
            from a background thread at most every USED_FLUSH_S.
        clock: wall-clock time (tests).
    """

    def __init__(self, mode: str, operator_token: str | None, *,
                 keys: Callable[[], Mapping] | None = None,
                 mark_used: Callable[[dict[str, str]], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if mode not in AUTH_MODES:
            raise ValueError(f"auth mode must be one of {AUTH_MODES}, not {mode!r}")
        self.mode = mode
        self._operator = operator_token.encode() if operator_token else None
        self._keys = keys or dict
        self._mark_used = mark_used
        self._clock = clock
        self._used: dict[str, str] = {}
        self._used_lock = threading.Lock()
        self._next_flush = 0.0

    @property
    def keys_enabled(self) -> bool:
        return self.mode == "keys"

    def identify(self, authorization: str | None) -> Principal:
        """The caller of a call with this `Authorization` value.

        Raises:
            Unauthorized: a malformed header; with --auth keys, a key that is unknown or
                revoked (the same answer: which keys exist is not told).
        """
        credential = bearer(authorization)
        if credential is None:
            return ANONYMOUS
        if self._operator is not None and hmac.compare_digest(credential.encode(),
                                                              self._operator):
            return THE_OPERATOR
        if not self.keys_enabled:
            return PRESENTED
        key_id = parse_token(credential)
        key = self._keys().get(key_id) if key_id is not None else None
        if key is None or not hmac.compare_digest(token_hash(credential), key.hash):
            raise Unauthorized("API key not accepted (unknown or revoked)")
        self._record_use(key.id)
        return Principal("key", tenant=key.tenant, scope=key.scope, key_id=key.id)

    def admit(self, authorization: str | None, access: str) -> Principal:
        """The caller of a call with this `Authorization` value to an endpoint with rule
        `access`, once it may make it (a public route ignores an unusable header).

        Raises:
            Unauthorized, Forbidden: as `identify` and `authorize`.
        """
        try:
            principal = self.identify(authorization)
        except Unauthorized:
            if access != PUBLIC:
                raise
            principal = ANONYMOUS
        self.authorize(access, principal)
        return principal

    def allows(self, access: str, principal: Principal) -> bool:
        """Whether `principal` may call an endpoint with rule `access`."""
        try:
            self.authorize(access, principal)
        except (Unauthorized, Forbidden):
            return False
        return True

    def authorize(self, access: str, principal: Principal) -> None:
        """Raises unless `principal` may call an endpoint with rule `access`.

        Raises:
            Unauthorized: no usable credential where one is needed (401).
            Forbidden: the credential has not that right, or the operator credential is
                needed and none is configured (403).
        """
        if access == PUBLIC or principal.kind == "operator":
            return
        if not self.keys_enabled:
            if access in (INFER, METRICS):
                return
            self._need_operator(principal)
        if access == OPERATOR:
            self._need_operator(principal)
        if principal.kind == "anonymous":
            raise Unauthorized(f"this route needs 'Authorization: Bearer <API key>' (a key of "
                               f"scope {' or '.join(_SCOPES[access])}, or the operator token)")
        if principal.scope not in _SCOPES[access]:
            raise Forbidden(f"an API key of scope {principal.scope} may not call this route "
                            f"(it needs scope {' or '.join(_SCOPES[access])})")

    def _need_operator(self, principal: Principal) -> None:
        if self._operator is None:
            raise Forbidden("admin API disabled: start the server with MULTIHEAD_ADMIN_TOKEN "
                            "set (or --admin-token) and send 'Authorization: Bearer <token>'")
        if principal.kind == "anonymous":
            raise Unauthorized("admin API needs 'Authorization: Bearer <token>'")
        raise Forbidden("admin token not accepted")

    def _record_use(self, key_id: str) -> None:
        now = self._clock()
        with self._used_lock:
            self._used[key_id] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
            if self._mark_used is None or now < self._next_flush:
                return
            self._next_flush = now + USED_FLUSH_S
            used, self._used = self._used, {}
        threading.Thread(target=self._flush, args=(used,), name="multihead-keys-used",
                         daemon=True).start()

    def _flush(self, used: dict[str, str]) -> None:
        try:
            self._mark_used(used)
        except Exception as exc:  # noqa: BLE001 - bookkeeping only: never fail a call
            log.warning("cannot record when %d API key(s) were last used: %s", len(used), exc)
