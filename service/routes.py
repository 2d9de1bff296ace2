"""Every endpoint of every protocol, in routing order: what each transport serves."""
from __future__ import annotations

from service.codecs import admin, native, oip, ops, tfserving
from service.codecs.base import Endpoint

ENDPOINTS: tuple[Endpoint, ...] = (*native.ENDPOINTS, *admin.ENDPOINTS, *ops.ENDPOINTS,
                                   *oip.ENDPOINTS, *tfserving.ENDPOINTS)
