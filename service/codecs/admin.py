"""Bots: `GET /bots`, `GET /bots/{bot_id}` (public), and the admin routes `PUT /bots/{bot_id}`
(upload a head checkpoint), `DELETE /bots/{bot_id}`, `POST /bots/{bot_id}/rollback` (bearer
token, checked once by `dispatch` for every endpoint marked admin)."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.codecs.base import Endpoint, Reply, Request, json_reply
from service.codecs.common import is_number
from service.codecs.native import Part, parse_multipart
from service.errors import BadRequest, UnsupportedMediaType

if TYPE_CHECKING:  # pragma: no cover
    from service.runtime import Service

DEFAULT_SHARD = ".data-00000-of-00001"


@dataclass(frozen=True)
class HeadUpload:
    """The parts of a `PUT /bots/{bot_id}`: a TF checkpoint's files and the labels."""

    index: bytes
    shards: dict[str, bytes]  # ".data-00000-of-00001" -> bytes
    labels: bytes
    names: dict[str, str]  # optional weights_name / biases_name


def parse_head_upload(parts: list[Part]) -> HeadUpload:
    """Checkpoint `.index` and `.data-*` parts (by file name, or named index/data) and `labels`.

    Raises:
        BadRequest: naming every missing part.
    """
    index = labels = None
    shards: dict[str, bytes] = {}
    names: dict[str, str] = {}
    for part in parts:
        filename = part.filename or ""
        if part.name == "labels":
            labels = part.data
        elif filename.endswith(".index") or part.name == "index":
            index = part.data
        elif ".data-" in filename or part.name == "data":
            shard = filename[filename.index(".data-"):] if ".data-" in filename \
                else DEFAULT_SHARD
            if "/" in shard or "\\" in shard:
                raise BadRequest(f"bad checkpoint shard file name '{filename[:64]}'")
            shards[shard] = part.data
        elif part.name in ("weights_name", "biases_name"):
            try:
                names[part.name] = part.data.decode().strip()
            except UnicodeDecodeError:
                raise BadRequest(f"{part.name} is not UTF-8 text") from None
    missing = [n for n, ok in (("checkpoint .index file", index is not None),
                               ("checkpoint .data file", bool(shards)),
                               ("labels", labels is not None)) if not ok]
    if missing:
        raise BadRequest(f"missing multipart part(s): {', '.join(missing)}")
    return HeadUpload(index, shards, labels, names)


def register_upload(store, bot_id: str, upload: HeadUpload) -> int:
    """Writes the upload to a temporary directory and registers it. Blocking: a worker thread."""
    with tempfile.TemporaryDirectory(prefix="multihead-upload-") as tmp:
        prefix = Path(tmp) / "head.ckpt"
        Path(f"{prefix}.index").write_bytes(upload.index)
        for shard, data in upload.shards.items():
            Path(f"{prefix}{shard}").write_bytes(data)
        labels_path = Path(tmp) / "labels.txt"
        labels_path.write_bytes(upload.labels)
        return store.register_checkpoint(bot_id, prefix, labels_path, source="http",
                                         **upload.names)


async def list_bots(service: Service, request: Request) -> Reply:
    infos = await service.bots()
    return json_reply({"bots": [
        {"bot_id": i.bot_id, "version": i.version, "n_classes": i.n_classes} for i in infos]})


async def show_bot(service: Service, request: Request) -> Reply:
    info = await service.info(request.params["bot_id"])
    return json_reply(info.to_dict(with_source=False))


async def put_bot(service: Service, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    if request.content_type != "multipart/form-data":
        raise UnsupportedMediaType("PUT /bots/{bot_id} takes multipart/form-data with the "
                                   "checkpoint files (.index, .data-*) and a 'labels' part")
    body = await request.body()
    parts = await service.run_blocking(parse_multipart, request.header("content-type"), body)
    upload = parse_head_upload(parts)
    version = await service.run_blocking(register_upload, service.store, bot_id, upload)
    info = await service.info(bot_id)
    return json_reply(info.to_dict(with_source=False), status=201 if version == 1 else 200)


async def delete_bot(service: Service, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    await service.run_blocking(service.store.remove, bot_id)
    return json_reply({"bot_id": bot_id, "removed": True})


async def rollback_bot(service: Service, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    to = request.query.get("to")
    if to is not None and not is_number(to):
        raise BadRequest(f"to must be a version number, got '{to[:32]}'")
    await service.run_blocking(service.store.rollback, bot_id, int(to) if to else None)
    info = await service.info(bot_id)
    return json_reply(info.to_dict(with_source=False))


ENDPOINTS = [
    Endpoint("GET", "/bots", "list_bots", list_bots, summary="every registered bot"),
    Endpoint("GET", "/bots/{bot_id}", "show_bot", show_bot,
             summary="one bot: active version, labels, versions"),
    Endpoint("PUT", "/bots/{bot_id}", "put_bot", put_bot, admin=True,
             summary="register a new version of a bot from an uploaded head checkpoint"),
    Endpoint("DELETE", "/bots/{bot_id}", "delete_bot", delete_bot, admin=True,
             summary="unregister a bot and delete its versions"),
    Endpoint("POST", "/bots/{bot_id}/rollback", "rollback_bot", rollback_bot, admin=True,
             summary="make an earlier version of a bot active (?to=N)"),
]
