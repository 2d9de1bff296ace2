"""Parsing rules shared by several protocols: JSON bodies, base64, `top_k`, model versions."""
from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from heads import Head
from service.codecs.base import Param, Request
from service.core.engine import Images, Prediction
from service.core.errors import BadRequest
from store import BotInfo, UnknownVersion

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller


# A bot id as a path parameter of the interop routes: no '/', no ':' (TF Serving's `:predict`).
BOT_PARAM = "{bot_id:[^{}/:]+}"
VERSION_PARAM = "{version:[^{}/:]+}"

# -- what the API description says of the shared parameters ------------------------------------

# What `heads.validate_bot_id` accepts (a test keeps the two in step); any other id is a 400.
BOT_ID_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
BOT_ID_SCHEMA = {"type": "string", "pattern": BOT_ID_PATTERN,
                 "description": "a bot id: 1-64 characters from A-Z a-z 0-9 . _ -, starting with "
                                "a letter or digit"}
VERSION_SCHEMA = {"type": "string", "pattern": "^[0-9]{1,18}$",
                  "description": "a version number; only the bot's active version is served "
                                 "(any other: 404)"}
MODEL_PATH_PARAMS = {"bot_id": BOT_ID_SCHEMA, "version": VERSION_SCHEMA}
TOP_K = Param("top_k", "query", {"type": "integer", "minimum": 1},
              "labels per image, best first (default: the server's `top_k_default`; at most "
              "the bot's number of classes are listed, a larger top_k lists them all; a "
              "request whose answer could exceed `max_answer_bytes` is a 413)")


def model_paths(prefix: str) -> list[tuple[str, str]]:
    """(operation suffix, path) of a model route without and with a version:
    `{prefix}/{bot}` and `{prefix}/{bot}/versions/{v}`."""
    return [("", f"{prefix}/{BOT_PARAM}"),
            ("_version", f"{prefix}/{BOT_PARAM}/versions/{VERSION_PARAM}")]


def parse_json_object(raw: bytes | str, what: str) -> dict:
    """A JSON object, or BadRequest naming `what`."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadRequest(f"{what} is not valid JSON (or nests too deep)") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"{what} must be a JSON object")
    return obj


def b64decode(value: Any, where: str) -> bytes:
    """Standard or URL-safe base64 text -> bytes."""
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a base64 string, got {type(value).__name__}")
    altchars = b"-_" if ("-" in value or "_" in value) else None
    try:
        return base64.b64decode(value, altchars=altchars, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where} is not valid base64") from None


def float_array(data: Any, where: str) -> np.ndarray:
    """JSON numbers (flat or nested) -> float32 array; the shape is checked by the caller.

    null (which numpy turns into NaN), NaN and Infinity are refused here.
    """
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # out of range -> inf, refused below
            array = np.asarray(data, dtype=np.float32)
    except (TypeError, ValueError, RecursionError):
        raise BadRequest(f"{where} must be numbers (flat, or nested to the same depth)") \
            from None
    if not np.isfinite(array).all():
        raise BadRequest(f"{where} must be finite numbers (no null, NaN or Infinity)")
    return array


def parse_top_k(query: Mapping[str, str], default: int) -> int:
    """`?top_k=` as an integer >= 1, or `default` when absent."""
    raw = query.get("top_k")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"top_k must be an integer >= 1, got '{raw[:32]}'") from None
    if value < 1:
        raise BadRequest(f"top_k must be an integer >= 1, got {value}")
    return value


def is_number(text: str) -> bool:
    """ASCII digits only: `str.isdigit` also accepts '²' and '٣', which `int()` refuses."""
    return text.isascii() and text.isdigit()


def check_version(bot_id: str, active: int, raw: str | None) -> None:
    """A version named in the path must be the bot's active one: only that one is served."""
    if raw is None:
        return
    if not is_number(raw):
        raise BadRequest(f"model version must be a number, got '{raw[:32]}'")
    if int(raw) != active:
        raise UnknownVersion(f"bot '{bot_id}' version {int(raw)} is not served: only its active "
                             f"version {active} is")


# -- model-as-bot calls shared by the interop protocols (OIP v2, TF Serving), any transport -------

@dataclass(frozen=True)
class Model:
    """The model a call names: a bot, and the version asked for (None: the active one).

    REST carries it in the path (`{bot_id}`, `{version}`), gRPC in the request message.
    """

    bot_id: str
    version: str | None = None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's metadata as the protocols describe a model: name, datatype, shape (-1: any)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def model_of(request: Request) -> Model:
    """The model named by a REST route's path parameters."""
    return Model(request.params["bot_id"], request.params.get("version"))


async def model_info(service: Caller, model: Model) -> BotInfo:
    """The registry's view of the bot (no head load), its version checked."""
    info = await service.info(model.bot_id)
    check_version(info.bot_id, info.version, model.version)
    return info


async def model_head(service: Caller, model: Model) -> Head:
    """The active head of the bot, its version checked: readiness first (`Service.head`)."""
    head = await service.head(model.bot_id)
    check_version(head.bot_id, head.version, model.version)
    return head


async def classify_with(service: Caller, head: Head, images: Images,
                        top_k: int, route_key: str | None = None) -> list[Prediction]:
    """Every image under one head (or its bot's canary candidate, for the requests it
    answers: `Prediction.version` says which), in order. Its callers (TF Serving, OIP) render
    every class's probability: the answer's bound counts them (`all_scores`)."""
    return [r[0] for r in await service.classify(images, [head], top_k=top_k,
                                                 route_key=route_key, all_scores=True)]


def endpoint_name(name: str, version: object) -> str:
    """The name of the model route `name` a call corresponds to: `name`, or `name_version` when
    the call names a `version` (the routes of `model_paths`). For metrics and logs."""
    return f"{name}_version" if version else name
