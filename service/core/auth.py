"""Admin authentication: a bearer token compared in constant time. No web framework here."""
from __future__ import annotations

import hmac

from service.core.errors import Forbidden, Unauthorized


def check_admin(token: str | None, authorization: str | None) -> None:
    """Raises unless `authorization` (the header's value) is `Bearer <token>`.

    Raises:
        Forbidden: admin is disabled (no token configured), or the token is not accepted.
        Unauthorized: no bearer credentials were sent (401, with `WWW-Authenticate`).
    """
    if not token:
        raise Forbidden("admin API disabled: start the server with MULTIHEAD_ADMIN_TOKEN set "
                        "(or --admin-token) and send 'Authorization: Bearer <token>'")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("admin API needs 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Forbidden("admin token not accepted")
