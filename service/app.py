"""The aiohttp application: routes, error mapping, readiness, admin API, metrics.

Handlers stay thin: parse and validate, resolve the heads (404 before any work), `await
engine.classify(...)`, serialise. Domain errors are mapped to JSON `{"error", "code"}` with
their status by ONE middleware (`service.errors.error_status`).

Lifecycle (`cleanup_ctx`): the store opens at once; the trunk is built (or taken as given) and
warmed in a background task so that `/healthz` answers and `/readyz` says 503 meanwhile; the
engine (batcher + feature cache) starts when the trunk is warm. On shutdown (SIGTERM included)
aiohttp stops accepting, then the engine drains its queued rows, then the store and the trunk
session close.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from heads import HeadStore
from service.engine import Engine, Prediction
from heads import HeadLoadError
from service.errors import (BadRequest, Forbidden, HeadUnavailable, NotReady, PayloadTooLarge,
                            ServiceError, Unauthorized, UnsupportedMediaType, error_body,
                            error_status)
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
MAX_BOTS_PER_REQUEST = 64


@dataclass
class Runtime:
    """What the app owns at run time; filled in by the lifecycle context."""

    trunk: object | None = None
    engine: Engine | None = None
    ready: bool = False
    error: str | None = None
    trunk_kind: str = "unknown"
    started_s: float = field(default_factory=time.monotonic)
    ready_s: float | None = None


SETTINGS = web.AppKey("settings", Settings)
STORE = web.AppKey("store", HeadStore)
METRICS = web.AppKey("metrics", Metrics)
RUNTIME = web.AppKey("runtime", Runtime)


def _json_error(exc: BaseException) -> web.Response:
    status, _, headers = error_status(exc)
    if status >= 500 and not isinstance(exc, ServiceError):
        log.error("internal error", exc_info=exc)
    return web.json_response(error_body(exc), status=status, headers=headers)


_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
               413: "payload_too_large", 415: "unsupported_media_type"}


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Maps every error to JSON `{"error", "code"}` and counts requests by route template."""
    start = time.perf_counter()
    route = "unmatched"
    resource = request.match_info.route.resource
    if resource is not None:
        route = resource.canonical
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            response = _json_error(PayloadTooLarge(
                f"request body over the limit of {request.app[SETTINGS].max_body_bytes} bytes"))
        else:
            response = web.json_response(
                {"error": exc.reason, "code": _HTTP_CODES.get(exc.status, "http_error")},
                status=exc.status, headers={k: v for k, v in exc.headers.items()
                                            if k.lower() == "allow"})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
        response = _json_error(exc)
    elapsed_s = time.perf_counter() - start
    if not response.prepared:  # a WebSocket answer is already on the wire
        response.headers["Server-Timing"] = f"app;dur={elapsed_s * 1000:.1f}"
    request.app[METRICS].observe_request(route, response.status, elapsed_s)
    return response


# -- helpers --------------------------------------------------------------------------------

def _engine(request: web.Request) -> Engine:
    runtime = request.app[RUNTIME]
    if runtime.engine is None:
        raise NotReady(runtime.error or "the trunk is still loading; retry shortly")
    return runtime.engine


async def _head(request: web.Request, bot_id: str):
    # NOTE: resolved once, before any work: the request keeps this version even if the bot is
    # replaced or removed while it waits in the queue.
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, request.app[STORE].get, bot_id)
    except HeadLoadError as exc:
        log.error("bot %r cannot be loaded: %s", bot_id, exc)
        raise HeadUnavailable(f"bot '{bot_id}' is registered but its head cannot be loaded") \
            from None


def _top_k(request: web.Request) -> int:
    raw = request.query.get("top_k")
    if raw is None:
        return request.app[SETTINGS].top_k_default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"top_k must be an integer >= 1, got '{raw[:32]}'") from None
    if value < 1:
        raise BadRequest(f"top_k must be an integer >= 1, got {value}")
    return value


async def _read_images(request: web.Request) -> list[bytes]:
    """Raw `image/*` (or application/octet-stream) body, or multipart `image` parts."""
    settings = request.app[SETTINGS]
    ctype = request.content_type
    if ctype.startswith("image/") or ctype == "application/octet-stream":
        body = await request.read()
        return [body]
    if ctype == "multipart/form-data":
        images = []
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if part.name != "image":
                await part.release()
                continue
            if len(images) >= settings.max_images_per_request:
                raise PayloadTooLarge(f"more than {settings.max_images_per_request} images in one "
                                 f"request")
            images.append(bytes(await part.read()))
        if not images:
            raise BadRequest("multipart body has no part named 'image'")
        return images
    raise UnsupportedMediaType(
        f"unsupported content type '{ctype}': send an image (image/jpeg, image/png, ...) as "
        f"the body, or multipart/form-data with 'image' parts")


def _deadline(settings: Settings) -> float:
    return time.monotonic() + settings.request_timeout_s


def _bot_result(predictions: list[Prediction]) -> dict:
    first = predictions[0]
    return {"bot_id": first.bot_id, "version": first.version,
            "results": [{"predictions": [{"label": label, "score": score}
                                         for label, score in p.labels_scores]}
                        for p in predictions]}


# -- classification ----------------------------------------------------------------------

async def classify_one(request: web.Request) -> web.Response:
    engine = _engine(request)
    head = await _head(request, request.match_info["bot_id"])
    top_k = _top_k(request)
    images = await _read_images(request)
    results = await engine.classify(images, [head], top_k=top_k,
                                    deadline=_deadline(request.app[SETTINGS]))
    return web.json_response(_bot_result([r[0] for r in results]))


async def classify_many(request: web.Request) -> web.Response:
    engine = _engine(request)
    raw = request.query.get("bots", "")
    bot_ids = list(dict.fromkeys(b.strip() for b in raw.split(",") if b.strip()))
    if not bot_ids:
        raise BadRequest("name the bots to score with ?bots=a,b,c (or use /classify/{bot_id})")
    if len(bot_ids) > MAX_BOTS_PER_REQUEST:
        raise BadRequest(f"{len(bot_ids)} bots in one request, the limit is "
                         f"{MAX_BOTS_PER_REQUEST}")
    heads = [await _head(request, b) for b in bot_ids]
    top_k = _top_k(request)
    images = await _read_images(request)
    results = await engine.classify(images, heads, top_k=top_k,
                                    deadline=_deadline(request.app[SETTINGS]))
    return web.json_response({"results": {
        head.bot_id: _bot_result([r[j] for r in results]) for j, head in enumerate(heads)}})


async def classify_ws(request: web.Request) -> web.WebSocketResponse:
    """One image per binary message, one JSON reply per image, in order."""
    await _head(request, request.match_info["bot_id"])  # 404 before the upgrade
    top_k = _top_k(request)
    settings = request.app[SETTINGS]
    ws = web.WebSocketResponse(max_msg_size=settings.max_body_bytes, heartbeat=30)
    await ws.prepare(request)
    async for message in ws:
        if message.type != web.WSMsgType.BINARY:
            await ws.send_json({"error": "send each image as one binary message",
                                "code": "bad_request"})
            continue
        try:
            # Resolved per message: a long-lived socket follows the bot's active version.
            head = await _head(request, request.match_info["bot_id"])
            results = await _engine(request).classify([message.data], [head], top_k=top_k,
                                                      deadline=_deadline(settings))
            await ws.send_json(_bot_result([results[0][0]]))
        except Exception as exc:  # noqa: BLE001 - answer this message, keep the socket
            status, code, _ = error_status(exc)
            await ws.send_json({**error_body(exc), "status": status})
    return ws


# -- bots (public) and admin ---------------------------------------------------------------

def _bot_json(info) -> dict:
    return {"bot_id": info.bot_id, "version": info.version, "n_classes": info.n_classes,
            "labels": list(info.labels), "created": info.created, "versions": info.versions}


async def list_bots(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    infos = await loop.run_in_executor(None, request.app[STORE].list)
    return web.json_response({"bots": [
        {"bot_id": i.bot_id, "version": i.version, "n_classes": i.n_classes} for i in infos]})


async def show_bot(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    info = await loop.run_in_executor(None, request.app[STORE].info, request.match_info["bot_id"])
    return web.json_response(_bot_json(info))


def _check_admin(request: web.Request) -> None:
    token = request.app[SETTINGS].admin_token
    if not token:
        raise Forbidden("admin API disabled: start the server with MULTIHEAD_ADMIN_TOKEN set "
                        "(or --admin-token) and send 'Authorization: Bearer <token>'")
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("admin API needs 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Forbidden("admin token not accepted")


async def put_bot(request: web.Request) -> web.Response:
    """Multipart: the head checkpoint's `.index` and `.data-*` files, and `labels`."""
    _check_admin(request)
    bot_id = request.match_info["bot_id"]
    if request.content_type != "multipart/form-data":
        raise UnsupportedMediaType("PUT /bots/{bot_id} takes multipart/form-data with the "
                                   "checkpoint files (.index, .data-*) and a 'labels' part")
    fields: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="multihead-upload-") as tmp:
        prefix = Path(tmp) / "head.ckpt"
        labels_path = Path(tmp) / "labels.txt"
        have_index = have_data = have_labels = False
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            filename = part.filename or ""
            if part.name == "labels":
                labels_path.write_bytes(bytes(await part.read()))
                have_labels = True
            elif filename.endswith(".index") or part.name == "index":
                Path(f"{prefix}.index").write_bytes(bytes(await part.read()))
                have_index = True
            elif ".data-" in filename or part.name == "data":
                shard = filename[filename.index(".data-"):] if ".data-" in filename \
                    else ".data-00000-of-00001"
                Path(f"{prefix}{shard}").write_bytes(bytes(await part.read()))
                have_data = True
            elif part.name in ("weights_name", "biases_name"):
                fields[part.name] = (await part.text()).strip()
            else:
                await part.release()
        missing = [n for n, ok in (("checkpoint .index file", have_index),
                                   ("checkpoint .data file", have_data),
                                   ("labels", have_labels)) if not ok]
        if missing:
            raise BadRequest(f"missing multipart part(s): {', '.join(missing)}")
        store = request.app[STORE]
        loop = asyncio.get_running_loop()
        version = await loop.run_in_executor(None, lambda: store.register_checkpoint(
            bot_id, prefix, labels_path, source="http", **fields))
    info = await loop.run_in_executor(None, store.info, bot_id)
    return web.json_response(_bot_json(info), status=201 if version == 1 else 200)


async def delete_bot(request: web.Request) -> web.Response:
    _check_admin(request)
    bot_id = request.match_info["bot_id"]
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, request.app[STORE].remove, bot_id)
    return web.json_response({"bot_id": bot_id, "removed": True})


async def rollback_bot(request: web.Request) -> web.Response:
    _check_admin(request)
    bot_id = request.match_info["bot_id"]
    to = request.query.get("to")
    if to is not None and not to.isdigit():
        raise BadRequest(f"to must be a version number, got '{to[:32]}'")
    store = request.app[STORE]
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: store.rollback(bot_id, int(to) if to else None))
    info = await loop.run_in_executor(None, store.info, bot_id)
    return web.json_response(_bot_json(info))


# -- operations --------------------------------------------------------------------------

async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


def _trunk_info(request: web.Request) -> dict:
    runtime = request.app[RUNTIME]
    trunk = runtime.trunk
    info = {"weights": runtime.trunk_kind}
    if trunk is not None:
        info.update(checkpoint=trunk.checkpoint_prefix, device=trunk.device)
    return info


async def readyz(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    body = {"status": "ready" if runtime.ready else "loading", "trunk": _trunk_info(request)}
    if runtime.error:
        body.update(status="failed", error=runtime.error)
    return web.json_response(body, status=200 if runtime.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    stats = app[STORE].cache_stats()
    app[METRICS].set_resident_heads(stats["resident_heads"], stats["resident_bytes"])
    body, content_type = app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": content_type})


# -- lifecycle ---------------------------------------------------------------------------

def trunk_kind(prefix: str) -> str:
    """What /readyz reports: the official weights, the demo random ones, or another file."""
    from backbone.checkpoint import DEMO_CHECKPOINT, OFFICIAL_CHECKPOINT

    name = Path(prefix).name
    if name == OFFICIAL_CHECKPOINT:
        return "official"
    if name == DEMO_CHECKPOINT:
        return "demo (seeded random weights)"
    return "custom"


def warmup_batch_sizes(max_batch_size: int, device: str) -> tuple[int, ...]:
    """Batch sizes run before /readyz says ready.

    On a GPU: 1, 2, 4, ... and max_batch_size, since cuDNN picks its kernels per shape and a
    first run at a new shape can take seconds. On the CPU: batch 1 only (session start-up, memory
    arenas, oneDNN primitives): measured here, a first run at a new batch size costs 20-100 ms
    more than the next one, while warming every size would add about 3 s to each restart.
    """
    if "GPU" not in device.upper():
        return (1,)
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [max_batch_size])


async def _bring_up(app: web.Application, trunk) -> None:
    settings, runtime = app[SETTINGS], app[RUNTIME]
    loop = asyncio.get_running_loop()
    try:
        if trunk is None:
            from backbone import Trunk, default_trunk_checkpoint

            prefix = settings.trunk_checkpoint or default_trunk_checkpoint(settings.store)
            runtime.trunk_kind = trunk_kind(prefix)
            cache_dir = Path(settings.store) / "trunk" / "graph_cache" if settings.graph_cache \
                else None
            trunk = await loop.run_in_executor(None, lambda: Trunk.from_checkpoint(
                prefix, device=settings.device, warmup_batch_sizes=(), graph_cache_dir=cache_dir))
        else:
            runtime.trunk_kind = trunk_kind(trunk.checkpoint_prefix)
        runtime.trunk = trunk
        if settings.warmup:
            import numpy as np

            for size in warmup_batch_sizes(settings.max_batch_size, trunk.device):
                batch = np.zeros((size, 299, 299, 3), np.float32)
                await loop.run_in_executor(None, trunk.features, batch)
        runtime.engine = Engine(trunk, settings, app[METRICS])
        await runtime.engine.batcher.start()
        runtime.ready = True
        runtime.ready_s = time.monotonic()
        log.info("ready: trunk %s (%s) in %.1fs", trunk.checkpoint_prefix, runtime.trunk_kind,
                 runtime.ready_s - runtime.started_s)
    except Exception as exc:  # noqa: BLE001 - reported by /readyz and the log
        runtime.error = f"trunk failed to load: {exc}"
        log.error("%s", runtime.error)


def _lifecycle(trunk, store):
    async def context(app: web.Application):
        settings = app[SETTINGS]
        own_store = store is None
        app[STORE] = store if store is not None else HeadStore(
            settings.store, heads_memory_mb=settings.heads_memory_mb)
        runtime = app[RUNTIME]
        task = asyncio.create_task(_bring_up(app, trunk))
        yield
        if not task.done():  # shut down while the trunk was loading: let it finish first
            await task
        if runtime.engine is not None:
            await runtime.engine.close()
        if own_store:
            app[STORE].close()
        if trunk is None and runtime.trunk is not None:
            runtime.trunk.close()

    return context


async def index(request: web.Request) -> web.StreamResponse:
    page = STATIC_DIR / "index.html"
    if not page.exists():
        raise web.HTTPNotFound(reason="no web page installed")
    return web.FileResponse(page)


def create_app(settings: Settings, *, trunk=None, store: HeadStore | None = None) -> web.Application:
    """The application. Pass `trunk`/`store` to share already-built ones (tests, benchmark);
    the app then neither builds nor closes them."""
    app = web.Application(middlewares=[error_middleware], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[METRICS] = Metrics(top_bots=settings.metrics_top_bots)
    app[RUNTIME] = Runtime()
    app.cleanup_ctx.append(_lifecycle(trunk, store))
    app.router.add_get("/", index)
    app.router.add_post("/classify/{bot_id}", classify_one)
    app.router.add_post("/classify", classify_many)
    app.router.add_get("/ws/classify/{bot_id}", classify_ws)
    app.router.add_get("/bots", list_bots)
    app.router.add_get("/bots/{bot_id}", show_bot)
    app.router.add_put("/bots/{bot_id}", put_bot)
    app.router.add_delete("/bots/{bot_id}", delete_bot)
    app.router.add_post("/bots/{bot_id}/rollback", rollback_bot)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    from service.interop import add_interop_routes  # NOTE: here, as interop imports this module
    add_interop_routes(app)
    if STATIC_DIR.exists():
        app.router.add_static("/static", STATIC_DIR)
    return app
