"""Bots: `GET /bots`, `GET /bots/{bot_id}` (INFER), and the MANAGE routes `PUT /bots/{bot_id}`
(upload a head checkpoint, as the active version or, with a `candidate` part, as the bot's
candidate), `DELETE /bots/{bot_id}`, `POST /bots/{bot_id}/rollback`,
`POST /bots/{bot_id}/candidate/promote` and `DELETE /bots/{bot_id}/candidate` (checked once by
`dispatch`; each sees only the caller's tenant's bots: `service.core.caller.Caller`).
`GET /bots/{bot_id}` shows the bot's candidate, with this process's comparison of it with the
live version, to a caller that may manage the bot."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from accounts import CandidateMode
from accounts.errors import AccountsError
from backbone.gate import MIN_HEAD_AGREEMENT
from heads import HeadsError
from service.codecs.base import Body, Endpoint, Param, Reply, Request, json_answer, json_reply
from service.codecs.common import BOT_ID_SCHEMA, is_number
from service.codecs.native import Part, parse_multipart
from service.core.auth import INFER, MANAGE
from service.core.candidates import TOP_DISAGREEMENTS
from service.core.errors import BadRequest, UnsupportedMediaType
from store.errors import StoreError

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller

DEFAULT_SHARD = ".data-00000-of-00001"


@dataclass(frozen=True)
class HeadUpload:
    """The parts of a `PUT /bots/{bot_id}`: a TF checkpoint's files and the labels."""

    index: bytes
    shards: dict[str, bytes]  # ".data-00000-of-00001" -> bytes
    labels: bytes
    names: dict[str, str]  # optional weights_name / biases_name
    candidate: CandidateMode | None = None  # register it as the bot's candidate


def parse_head_upload(parts: list[Part]) -> HeadUpload:
    """Checkpoint `.index` and `.data-*` parts (by file name, or named index/data) and `labels`;
    an optional `candidate` part (`shadow` or `canary:P`).

    Raises:
        BadRequest: naming every missing part. InvalidCandidate: a bad `candidate`.
    """
    index = labels = candidate = None
    shards: dict[str, bytes] = {}
    names: dict[str, str] = {}
    for part in parts:
        filename = part.filename or ""
        if part.name == "labels":
            labels = part.data
        elif filename.endswith(".index") or part.name == "index":
            index = part.data
        elif ".data-" in filename or part.name == "data":
            # The last `.data-` starts the shard suffix: a prefix may hold `.data-` too.
            shard = filename[filename.rindex(".data-"):] if ".data-" in filename \
                else DEFAULT_SHARD
            if "/" in shard or "\\" in shard:
                raise BadRequest(f"bad checkpoint shard file name '{filename[:64]}'")
            shards[shard] = part.data
        elif part.name in ("weights_name", "biases_name", "candidate"):
            try:
                text = part.data.decode().strip()
            except UnicodeDecodeError:
                raise BadRequest(f"{part.name} is not UTF-8 text") from None
            if part.name == "candidate":
                candidate = CandidateMode.parse(text)
            else:
                names[part.name] = text
    missing = [n for n, ok in (("checkpoint .index file", index is not None),
                               ("checkpoint .data file", bool(shards)),
                               ("labels", labels is not None)) if not ok]
    if missing:
        raise BadRequest(f"missing multipart part(s): {', '.join(missing)}")
    return HeadUpload(index, shards, labels, names, candidate)


def register_upload(registry, bot_id: str, upload: HeadUpload, tenant: str | None = None) -> int:
    """Writes the upload to a temporary directory and registers it with `registry` (the
    `Service` as the caller sees it, or a store: anything with `register_checkpoint`), in
    `tenant` if given. Blocking: a worker thread.

    A refusal's message names the uploaded parts, never the server's temporary files.
    """
    with tempfile.TemporaryDirectory(prefix="multihead-upload-") as tmp:
        prefix = Path(tmp) / "head.ckpt"
        Path(f"{prefix}.index").write_bytes(upload.index)
        for shard, data in upload.shards.items():
            Path(f"{prefix}{shard}").write_bytes(data)
        labels_path = Path(tmp) / "labels.txt"
        labels_path.write_bytes(upload.labels)
        try:
            options = {"tenant": tenant} if tenant is not None else {}
            if upload.candidate is not None:
                options["candidate"] = upload.candidate
            return registry.register_checkpoint(bot_id, prefix, labels_path, source="http",
                                                **upload.names, **options)
        except (HeadsError, AccountsError, StoreError) as exc:
            message = str(exc)
            for path, name in ((labels_path, "<labels part>"),
                               (prefix, "<uploaded checkpoint>"), (tmp, "<upload>")):
                message = message.replace(f"'{path}'", name).replace(str(path), name)
            if message != str(exc):
                exc.args = (message,)  # same class, so the same status and code
            raise


async def render_info(service: Caller, info) -> dict:
    """A bot's public description: the registry's view (no training source: a server path),
    whether it is pinned (its head always resident) and its agreement with the INT8 trunk
    (null without one); for a caller that may manage the bot, its candidate (null if none)
    with this process's stats of it."""
    out = {**info.to_dict(with_source=False, with_candidate=False),
           "pinned": service.is_pinned(info.bot_id),
           "int8_agreement": await service.int8_agreement(info)}
    if service.may(MANAGE):
        out["candidate"] = service.candidate_report(info)
    return out


async def list_bots(service: Caller, request: Request) -> Reply:
    infos = await service.bots()
    return json_reply({"bots": [
        {"bot_id": i.bot_id, "version": i.version, "n_classes": i.n_classes,
         "tenant": i.tenant, "pinned": service.is_pinned(i.bot_id)} for i in infos]})


async def show_bot(service: Caller, request: Request) -> Reply:
    info = await service.info(request.params["bot_id"])
    return json_reply(await render_info(service, info))


async def put_bot(service: Caller, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    if request.content_type != "multipart/form-data":
        raise UnsupportedMediaType("PUT /bots/{bot_id} takes multipart/form-data with the "
                                   "checkpoint files (.index, .data-*) and a 'labels' part")
    body = await request.body()
    parts = await service.run_blocking(parse_multipart, request.header("content-type"), body)
    upload = parse_head_upload(parts)
    version = await service.run_blocking(register_upload, service, bot_id, upload,
                                         request.query.get("tenant"))
    info = await service.info(bot_id)
    return json_reply(await render_info(service, info), status=201 if version == 1 else 200)


async def promote_candidate(service: Caller, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    await service.promote(bot_id)
    return json_reply(await render_info(service, await service.info(bot_id)))


async def discard_candidate(service: Caller, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    version = await service.discard(bot_id)
    return json_reply({"bot_id": bot_id, "discarded": version})


async def delete_bot(service: Caller, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    await service.remove(bot_id)
    return json_reply({"bot_id": bot_id, "removed": True})


async def rollback_bot(service: Caller, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    to = request.query.get("to")
    if to is not None and not is_number(to):
        raise BadRequest(f"to must be a version number, got '{to[:32]}'")
    await service.rollback(bot_id, int(to) if to else None)
    info = await service.info(bot_id)
    return json_reply(await render_info(service, info))


# -- API description ---------------------------------------------------------------------------

_PINNED = {"type": "boolean",
           "description": "pinned with `--pin`: its head is always resident (never evicted)"}
_COUNT = {"type": "integer", "minimum": 0}
_SHARE = {"type": "number", "minimum": 0, "maximum": 1, "nullable": True}
CANDIDATE_SCHEMA = {
    "title": "Candidate", "type": "object", "additionalProperties": False, "nullable": True,
    "description": "the bot's candidate (shadow or canary), null if it has none; shown to a "
                   "caller that may manage the bot",
    "required": ["version", "mode", "percent", "n_classes", "labels", "created", "stats"],
    "properties": {
        "version": {"type": "integer", "minimum": 1},
        "mode": {"type": "string", "enum": ["shadow", "canary"]},
        "percent": {"type": "number", "minimum": 0, "maximum": 100, "nullable": True,
                    "description": "a canary's share of the bot's requests (null: a shadow)"},
        "n_classes": {"type": "integer", "minimum": 1},
        "labels": {"type": "array", "items": {"type": "string"}},
        "created": {"type": "string", "description": "when it was registered (ISO 8601, UTC)"},
        "stats": {
            "type": "object", "additionalProperties": False,
            "description": "its comparison with the live version in the process that answered "
                           "(in memory, from its start: /metrics has the counters of every "
                           "process)",
            "required": ["since", "images", "agreed", "agreement", "mean_abs_diff", "answered",
                         "failures", "disagreements"],
            "properties": {
                "since": {"type": "string", "nullable": True,
                          "description": "when this process first scored it"},
                "images": {**_COUNT, "description": "images scored by both versions"},
                "agreed": {**_COUNT, "description": "of them, with the same top-1 label"},
                "agreement": {**_SHARE, "description": "agreed / images"},
                "mean_abs_diff": {**_SHARE, "description": "mean over the images of |p_live - "
                                  "p_candidate| of the live version's top-1 label"},
                "answered": {**_COUNT, "description": "images the candidate answered (canary)"},
                "failures": {**_COUNT, "description": "images it failed on (the live version "
                                                      "answered)"},
                "disagreements": {
                    "type": "array", "maxItems": TOP_DISAGREEMENTS,
                    "description": "the most frequent (live label, candidate label) pairs of "
                                   "the images they disagree on, most frequent first",
                    "items": {"type": "object", "additionalProperties": False,
                              "required": ["live", "candidate", "images"],
                              "properties": {"live": {"type": "string"},
                                             "candidate": {"type": "string"},
                                             "images": _COUNT}}}}}}}
BOT_SUMMARY_SCHEMA = {
    "title": "BotSummary", "type": "object", "additionalProperties": False,
    "required": ["bot_id", "version", "n_classes", "tenant", "pinned"],
    "properties": {"bot_id": {"type": "string"},
                   "tenant": {"type": "string", "description": "the tenant that owns it"},
                   "version": {"type": "integer", "minimum": 1,
                               "description": "the active version"},
                   "n_classes": {"type": "integer", "minimum": 1},
                   "pinned": _PINNED}}
BOT_INFO_SCHEMA = {
    "title": "BotInfo", "type": "object", "additionalProperties": False,
    "required": ["bot_id", "version", "n_classes", "labels", "created", "versions", "tenant",
                 "pinned", "int8_agreement"],
    "properties": {
        "bot_id": {"type": "string"},
        "tenant": {"type": "string", "description": "the tenant that owns it"},
        "version": {"type": "integer", "minimum": 1, "description": "the active version"},
        "n_classes": {"type": "integer", "minimum": 1},
        "labels": {"type": "array", "items": {"type": "string"},
                   "description": "the active version's labels, in class index order"},
        "created": {"type": "string", "description": "when the active version was registered "
                                                      "(ISO 8601, UTC)"},
        "versions": {"type": "array", "items": {"type": "integer", "minimum": 1},
                     "description": "every version still on disk that can be made active, "
                                    "ascending (the candidate's is not one)"},
        "pinned": _PINNED,
        "int8_agreement": {
            "type": "number", "minimum": 0, "maximum": 1, "nullable": True,
            "description": "the share of the INT8 trunk's held-out images (`multihead "
                           "quantize`) on which the active version's top-1 class is the same "
                           "with the INT8 trunk's features as with the float trunk's; null "
                           "without an INT8 trunk for the serving checkpoint (or for about a "
                           "second after a registration elsewhere). Below "
                           f"{MIN_HEAD_AGREEMENT}, `--precision auto` serves the float trunk "
                           "from the next start"},
        "candidate": CANDIDATE_SCHEMA}}
_BINARY = {"type": "string", "format": "binary"}
HEAD_UPLOAD_BODY = Body(
    content={"multipart/form-data": {
        "type": "object", "required": ["index", "data", "labels"],
        "properties": {
            "index": {**_BINARY, "description": "the checkpoint's `.index` file (or any part "
                                                "whose file name ends in `.index`)"},
            "data": {**_BINARY, "description": "the checkpoint's `.data-00000-of-00001` file "
                                               "(or parts whose file names hold `.data-`)"},
            "labels": {**_BINARY, "description": "the labels, one per line, in class order "
                                                 "(UTF-8; each at most 256 characters, no "
                                                 "control, line-breaking or bidirectional "
                                                 "formatting character: else 400 "
                                                 "`invalid_label`)"},
            "weights_name": {"type": "string",
                             "description": "the weights variable (default: found by shape)"},
            "biases_name": {"type": "string",
                            "description": "the biases variable (default: found by shape)"},
            "candidate": {"type": "string", "pattern": "^(shadow|canary:[0-9.]+)$",
                          "description": "register it as the bot's candidate instead of its "
                                         "active version: `shadow` (scored, never returned) or "
                                         "`canary:P` (answers P % of the requests, 0 < P < "
                                         "100); replaces a candidate the bot had"}}}},
    description="a TF checkpoint of the head (weights [1536, n], biases [n]) and its labels",
)

ENDPOINTS = [
    Endpoint("GET", "/bots", "list_bots", list_bots, access=INFER,
             summary="every registered bot", tag="bots",
             answers={200: json_answer("the bots, ordered by id", {
                 "type": "object", "additionalProperties": False, "required": ["bots"],
                 "properties": {"bots": {"type": "array", "items": BOT_SUMMARY_SCHEMA}}})}),
    Endpoint("GET", "/bots/{bot_id}", "show_bot", show_bot, access=INFER,
             summary="one bot: active version, labels, versions", tag="bots",
             path_params={"bot_id": BOT_ID_SCHEMA},
             answers={200: json_answer("the bot", BOT_INFO_SCHEMA)}, errors=(400, 404)),
    Endpoint("PUT", "/bots/{bot_id}", "put_bot", put_bot, access=MANAGE,
             summary="register a new version of a bot from an uploaded head checkpoint",
             tag="bots", path_params={"bot_id": BOT_ID_SCHEMA}, body=HEAD_UPLOAD_BODY,
             params=(Param("tenant", "query", BOT_ID_SCHEMA,
                           "the operator's: the tenant of a new bot (default: `default`); a "
                           "key registers in its own tenant"),),
             answers={201: json_answer("a new bot, registered as version 1", BOT_INFO_SCHEMA),
                      200: json_answer("a new version of the bot, now active (or, with "
                                       "`candidate`, its candidate)", BOT_INFO_SCHEMA)},
             errors=(400, 404, 409, 415, 422)),
    Endpoint("DELETE", "/bots/{bot_id}", "delete_bot", delete_bot, access=MANAGE,
             summary="unregister a bot and delete its versions", tag="bots",
             path_params={"bot_id": BOT_ID_SCHEMA},
             answers={200: json_answer("the bot is gone", {
                 "type": "object", "additionalProperties": False,
                 "required": ["bot_id", "removed"],
                 "properties": {"bot_id": {"type": "string"},
                                "removed": {"type": "boolean", "enum": [True]}}})},
             errors=(400, 404)),
    Endpoint("POST", "/bots/{bot_id}/rollback", "rollback_bot", rollback_bot, access=MANAGE,
             summary="make an earlier version of a bot active (?to=N)", tag="bots",
             path_params={"bot_id": BOT_ID_SCHEMA},
             params=(Param("to", "query", {"type": "integer", "minimum": 0},
                           "the version to make active (default: the one before the active "
                           "version)"),),
             answers={200: json_answer("the bot, its active version changed", BOT_INFO_SCHEMA)},
             errors=(400, 404)),
    Endpoint("POST", "/bots/{bot_id}/candidate/promote", "promote_candidate", promote_candidate,
             access=MANAGE, summary="make the bot's candidate its active version", tag="bots",
             description="The version active until now stays stored: `rollback` goes back "
                         "to it. `no_candidate` (404) when the bot has none.",
             path_params={"bot_id": BOT_ID_SCHEMA},
             answers={200: json_answer("the bot, its candidate now active", BOT_INFO_SCHEMA)},
             errors=(400, 404)),
    Endpoint("DELETE", "/bots/{bot_id}/candidate", "discard_candidate", discard_candidate,
             access=MANAGE, summary="delete the bot's candidate", tag="bots",
             description="Its version is deleted; the live version goes on alone. "
                         "`no_candidate` (404) when the bot has none.",
             path_params={"bot_id": BOT_ID_SCHEMA},
             answers={200: json_answer("the candidate is gone", {
                 "type": "object", "additionalProperties": False,
                 "required": ["bot_id", "discarded"],
                 "properties": {"bot_id": {"type": "string"},
                                "discarded": {"type": "integer", "minimum": 1,
                                              "description": "its version"}}})},
             errors=(400, 404)),
]
