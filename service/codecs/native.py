"""The native protocol: `POST /classify/{bot_id}` and `POST /classify?bots=a,b` (image uploads).

A request carries its images as the raw body (`Content-Type: image/*` or
`application/octet-stream`) or as multipart/form-data parts named `image`; `?top_k=` sets how
many labels each answer lists. Answers:

    {"bot_id": "acme", "version": 3, "results": [{"predictions": [{"label", "score"}, ...]}]}
    {"results": {"<bot_id>": <the above>, ...}}                       (several bots)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import multipart

from service.codecs.base import Body, Endpoint, Param, Reply, Request, json_answer, json_reply
from service.codecs.common import BOT_ID_PATTERN, BOT_ID_SCHEMA, TOP_K, parse_top_k
from service.core.auth import INFER
from service.core.engine import Images, Prediction
from service.core.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller

MAX_BOTS_PER_REQUEST = 64
IMAGE_FIELD = "image"
# Parts of any name a multipart body may hold; beyond it the body is refused unparsed.
MAX_MULTIPART_PARTS = 256


@dataclass(frozen=True)
class Part:
    """One multipart/form-data part."""

    name: str
    filename: str | None
    content_type: str | None
    data: bytes


def parse_multipart(content_type: str, body: bytes, *, max_parts: int = MAX_MULTIPART_PARTS
                    ) -> list[Part]:
    """All parts of a multipart/form-data body.

    Args:
        content_type: the full Content-Type header value (it carries the boundary).

    Raises:
        BadRequest: no boundary, or a body that is not a complete multipart stream (wrong or
            missing boundary, truncated part, missing final boundary, over-long headers).
        PayloadTooLarge: more than `max_parts` parts.
    """
    _, options = multipart.parse_options_header(content_type)
    boundary = options.get("boundary")
    if not boundary:
        raise BadRequest("multipart/form-data without a boundary parameter")
    parts: list[Part] = []
    chunks: list[bytes] = []
    segment = None
    try:
        with multipart.PushMultipartParser(boundary, max_segment_count=max_parts,
                                           strict=True) as parser:
            for event in parser.parse(body):
                if isinstance(event, multipart.MultipartSegment):
                    segment, chunks = event, []
                elif event is None:
                    parts.append(Part(segment.name, segment.filename, segment.content_type,
                                      b"".join(chunks)))
                else:
                    chunks.append(bytes(event))
        # NOTE: leaving the `with` closes the parser, which raises if the stream was cut.
    except multipart.ParserLimitReached:
        raise PayloadTooLarge(f"more than {max_parts} parts in one multipart body") from None
    except multipart.MultipartError as exc:
        raise BadRequest(f"malformed multipart body: {str(exc)[:120]}") from None
    return parts


def check_image_content_type(request: Request) -> None:
    """415 before the body is read, unless it is an image, octet-stream or multipart."""
    ctype = request.content_type
    if ctype.startswith("image/") or ctype in ("application/octet-stream",
                                               "multipart/form-data"):
        return
    raise UnsupportedMediaType(
        f"unsupported content type '{ctype[:64]}': send an image (image/jpeg, image/png, ...) "
        f"as the body, or multipart/form-data with '{IMAGE_FIELD}' parts")


def parse_images(request: Request, body: bytes) -> list[bytes]:
    """The encoded images of a raw image body or of the multipart `image` parts (their count is
    checked with every protocol's, by the engine)."""
    if request.content_type != "multipart/form-data":
        return [body]
    images = [p.data for p in parse_multipart(request.header("content-type") or "", body)
              if p.name == IMAGE_FIELD]
    if not images:
        raise BadRequest(f"multipart body has no part named '{IMAGE_FIELD}'")
    return images


def parse_bot_ids(raw: str) -> list[str]:
    """`?bots=a,b,c` -> ['a', 'b', 'c'] (deduplicated, in order)."""
    bot_ids = list(dict.fromkeys(b.strip() for b in raw.split(",") if b.strip()))
    if not bot_ids:
        raise BadRequest("name the bots to score with ?bots=a,b,c (or use /classify/{bot_id})")
    if len(bot_ids) > MAX_BOTS_PER_REQUEST:
        raise BadRequest(f"{len(bot_ids)} bots in one request, the limit is "
                         f"{MAX_BOTS_PER_REQUEST}")
    return bot_ids


def render_bot_result(predictions: Sequence[Prediction]) -> dict:
    """One bot's answers for the images of a request, in upload order."""
    first = predictions[0]
    return {"bot_id": first.bot_id, "version": first.version,
            "results": [{"predictions": [{"label": label, "score": score}
                                         for label, score in p.labels_scores]}
                        for p in predictions]}


async def _images(service: Caller, request: Request) -> Images:
    check_image_content_type(request)
    body = await request.body()
    if request.content_type == "multipart/form-data":
        # Parsing megabytes of multipart is pure Python: off the event loop.
        encoded = await service.run_blocking(parse_images, request, body)
    else:
        encoded = parse_images(request, body)
    return Images(encoded=encoded)


async def classify_one(service: Caller, request: Request) -> Reply:
    head = await service.head(request.params["bot_id"])
    top_k = parse_top_k(request.query, service.top_k_default)
    images = await _images(service, request)
    results = await service.classify(images, [head], top_k=top_k)
    return json_reply(render_bot_result([r[0] for r in results]))


async def classify_many(service: Caller, request: Request) -> Reply:
    heads = await service.heads_for(parse_bot_ids(request.query.get("bots", "")))
    top_k = parse_top_k(request.query, service.top_k_default)
    images = await _images(service, request)
    results = await service.classify(images, heads, top_k=top_k)
    return json_reply({"results": {
        head.bot_id: render_bot_result([r[j] for r in results]) for j, head in enumerate(heads)}})


# -- API description ---------------------------------------------------------------------------

_BINARY = {"type": "string", "format": "binary"}
IMAGES_BODY = Body(
    content={
        "image/*": {**_BINARY, "description": "one encoded image (JPEG, PNG, WebP, ...)"},
        "application/octet-stream": {**_BINARY, "description": "one encoded image"},
        "multipart/form-data": {
            "type": "object", "required": [IMAGE_FIELD],
            "properties": {IMAGE_FIELD: {"type": "array", "items": _BINARY, "minItems": 1,
                                         "description": "the images, in answer order (parts "
                                                        "of other names are ignored)"}}},
    },
    description="the image as the whole body, or several as multipart/form-data parts named "
                f"'{IMAGE_FIELD}' (at most `max_images_per_request`)",
    encoding={"multipart/form-data": {IMAGE_FIELD: {"contentType": "image/*"}}},
)
PREDICTION_SCHEMA = {
    "title": "Prediction", "type": "object", "additionalProperties": False,
    "required": ["label", "score"],
    "properties": {"label": {"type": "string"},
                   "score": {"type": "number", "minimum": 0, "maximum": 1}}}
BOT_RESULT_SCHEMA = {
    "title": "BotResult", "type": "object", "additionalProperties": False,
    "description": "one bot's answers for the images of a request, in upload order",
    "required": ["bot_id", "version", "results"],
    "properties": {
        "bot_id": {"type": "string"},
        "version": {"type": "integer", "minimum": 1},
        "results": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["predictions"],
            "properties": {"predictions": {"type": "array", "items": PREDICTION_SCHEMA}}}}}}
_CLASSIFY_ERRORS = (400, 404, 413, 415, 500, 503, 504)
_BOTS_PATTERN = BOT_ID_PATTERN.strip("^$")

ENDPOINTS = [
    Endpoint("POST", "/classify/{bot_id}", "classify", classify_one, access=INFER,
             summary="classify the uploaded image(s) with one bot", tag="native",
             path_params={"bot_id": BOT_ID_SCHEMA}, params=(TOP_K,), body=IMAGES_BODY,
             answers={200: json_answer("the bot's top labels for each image", BOT_RESULT_SCHEMA)},
             errors=_CLASSIFY_ERRORS),
    Endpoint("POST", "/classify", "classify_many", classify_many, access=INFER,
             summary="classify the uploaded image(s) with every bot of ?bots=a,b", tag="native",
             description="Each image runs through the trunk once, whatever the number of bots.",
             params=(Param("bots", "query",
                           {"type": "string",
                            "pattern": f"^{_BOTS_PATTERN}(,{_BOTS_PATTERN}){{0,"
                                       f"{MAX_BOTS_PER_REQUEST - 1}}}$"},
                           f"the bots, comma-separated (at most {MAX_BOTS_PER_REQUEST})",
                           required=True), TOP_K),
             body=IMAGES_BODY,
             answers={200: json_answer("each bot's top labels for each image", {
                 "type": "object", "additionalProperties": False, "required": ["results"],
                 "properties": {"results": {"type": "object",
                                            "additionalProperties": BOT_RESULT_SCHEMA}}})},
             errors=_CLASSIFY_ERRORS),
]
