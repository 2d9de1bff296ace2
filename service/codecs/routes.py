"""Every endpoint of every protocol, in routing order: what each transport serves."""
from __future__ import annotations

from service.codecs import admin, native, oip, openapi, ops, stream, tenancy, tfserving
from service.codecs.base import Endpoint

ENDPOINTS: tuple[Endpoint, ...] = (
    *native.ENDPOINTS, *stream.ENDPOINTS, *admin.ENDPOINTS, *tenancy.ENDPOINTS, *ops.ENDPOINTS,
    # The API description covers the whole table, its own endpoints included.
    *openapi.endpoints(lambda: ENDPOINTS),
    *oip.ENDPOINTS, *tfserving.ENDPOINTS)
