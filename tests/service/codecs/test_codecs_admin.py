"""The admin, ops and native codecs (and the codec base types) as pure code against a fake
Service (or a store that refuses an upload): no server, no trunk. End to end: test_admin.py and
test_app.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from accounts import CandidateMode
from heads import InvalidHead
from service.codecs import admin, native, ops
from service.codecs.admin import DEFAULT_SHARD, HeadUpload, parse_head_upload, register_upload
from service.codecs.base import JSON, Endpoint, Reply, Request, dispatch, json_reply
from service.codecs.native import Part, check_image_content_type, render_bot_result
from service.core.auth import PUBLIC
from service.core.engine import Prediction
from service.core.errors import BadRequest, UnsupportedMediaType
from service.core.settings import Settings
from tests.support.fakes import FakeService, failed, loading, make_head, probabilities, req

BOUNDARY = "b0und"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
TOKEN = {"Authorization": "Bearer s3cret"}


def multipart_body(*parts: tuple[str, bytes, str | None]) -> bytes:
    out = b""
    for name, data, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename
                                                     else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + \
            b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def p(name: str, data: bytes, filename: str | None = None) -> Part:
    return Part(name, filename, None, data)


# -- base ------------------------------------------------------------------------------------

async def test_request_and_reply_basics():
    request = Request("GET", "/x", headers={"x-thing": "1"})
    assert request.header("X-Thing") == "1" and request.header("other") is None
    assert await request.body() == b""
    assert Reply() == Reply(200, b"", JSON, {})
    assert JSON == "application/json"
    reply = json_reply({"a": [1]}, 201, {"X": "y"})
    assert (reply.status, json.loads(reply.body), reply.content_type, reply.headers) == (
        201, {"a": [1]}, "application/json", {"X": "y"})
    assert json_reply(None).status == 200 and json_reply(None).headers == {}


async def test_dispatch_does_not_check_auth_of_public_routes():
    async def handle(service, request):
        return Reply(204)

    service = FakeService(settings=Settings(admin_token="s3cret", auth="none"))
    reply = await dispatch(service, Endpoint("GET", "/x", "x", handle, access=PUBLIC), Request("GET", "/x"))
    assert reply.status == 204


# -- admin: parse_head_upload ----------------------------------------------------------------

def test_upload_by_file_names_keeps_every_shard():
    upload = parse_head_upload([
        p("files", b"IDX", "head.ckpt.index"),
        p("files", b"D0", "head.ckpt.data-00000-of-00002"),
        p("files", b"D1", "head.ckpt.data-00001-of-00002"),
        p("labels", b"cat\ndog\n", "labels.txt"),
        p("note", b"ignored"),
    ])
    assert upload == HeadUpload(b"IDX", {".data-00000-of-00002": b"D0",
                                         ".data-00001-of-00002": b"D1"}, b"cat\ndog\n", {})


def test_a_checkpoint_prefix_holding_data_keeps_its_shard_suffix():
    """The last `.data-` starts the shard suffix (it used to be the first, so a prefix like
    `run.data-v2` made the shard `.data-v2.data-…` and the upload a 422)."""
    upload = parse_head_upload([p("files", b"IDX", "run.data-v2.index"),
                                p("files", b"D", "run.data-v2.data-00000-of-00001"),
                                p("labels", b"a\nb")])
    assert upload.shards == {".data-00000-of-00001": b"D"} and upload.index == b"IDX"


def test_upload_by_part_names_uses_the_default_shard_and_tensor_names():
    upload = parse_head_upload([
        p("index", b"IDX"), p("data", b"D"), p("labels", b"a\nb"),
        p("weights_name", b" my/W \n"), p("biases_name", b"my/b"),
    ])
    assert DEFAULT_SHARD == ".data-00000-of-00001"
    assert upload == HeadUpload(b"IDX", {DEFAULT_SHARD: b"D"}, b"a\nb",
                                {"weights_name": "my/W", "biases_name": "my/b"})


def test_a_labels_part_is_labels_whatever_its_file_name():
    upload = parse_head_upload([p("labels", b"L", "x.index"), p("index", b"I", "y.index"),
                                p("data", b"D", "z.data-00000-of-00001")])
    assert (upload.labels, upload.index, upload.shards) == (
        b"L", b"I", {".data-00000-of-00001": b"D"})


@pytest.mark.parametrize("parts,missing", [
    ([], "checkpoint .index file, checkpoint .data file, labels"),
    ([p("index", b"I")], "checkpoint .data file, labels"),
    ([p("data", b"D")], "checkpoint .index file, labels"),
    ([p("labels", b"L")], "checkpoint .index file, checkpoint .data file"),
    ([p("index", b"I"), p("data", b"D")], "labels"),
    ([p("x", b"I", "ckpt.idx"), p("labels", b"")], "checkpoint .index file, checkpoint .data file"),
], ids=["none", "index", "data", "labels", "no-labels", "empty-labels"])
def test_missing_parts_are_all_named(parts, missing):
    with pytest.raises(BadRequest) as info:
        parse_head_upload(parts)
    assert str(info.value) == f"missing multipart part(s): {missing}"


@pytest.mark.parametrize("filename", ["h.data-0/../../etc", "h.data-0\\..\\x"])
def test_a_shard_name_with_a_path_separator_is_refused(filename):
    with pytest.raises(BadRequest) as info:
        parse_head_upload([p("files", b"D", filename)])
    assert str(info.value) == f"bad checkpoint shard file name '{filename}'"


def test_tensor_names_must_be_utf8():
    with pytest.raises(BadRequest) as info:
        parse_head_upload([p("weights_name", b"\xff")])
    assert str(info.value) == "weights_name is not UTF-8 text"


def test_register_upload_writes_the_files_and_registers_them(tmp_path):
    service = FakeService()
    upload = HeadUpload(b"IDX", {".data-00000-of-00002": b"D0", ".data-00001-of-00002": b"D1"},
                        b"cat\n", {"weights_name": "W"})
    assert register_upload(service.store, "acme", upload) == 1
    assert service.store.calls == [("register_checkpoint", "acme", "head.ckpt", "labels.txt",
                                    {"source": "http", "weights_name": "W"})]
    assert service.store.written == {
        "head.ckpt.data-00000-of-00002": b"D0", "head.ckpt.data-00001-of-00002": b"D1",
        "head.ckpt.index": b"IDX", "labels.txt": b"cat\n"}


# -- admin: a refused upload names no server path -----------------------------------------

REFUSED_UPLOAD = HeadUpload(b"IDX", {".data-00000-of-00001": b"D0"}, b"cat\n", {})


class RefusingStore:
    """`register_checkpoint` refuses with `make_error(prefix, labels_path)`; remembers where the
    upload was written."""

    def __init__(self, make_error) -> None:
        self.make_error = make_error
        self.prefix: Path | None = None

    def register_checkpoint(self, bot_id, prefix, labels_path, **kwargs) -> int:
        self.prefix = Path(prefix)
        raise self.make_error(Path(prefix), Path(labels_path))


def test_the_upload_is_written_to_a_temporary_directory_named_for_it():
    store = RefusingStore(lambda prefix, labels: InvalidHead("no"))
    with pytest.raises(InvalidHead):
        register_upload(store, "acme", REFUSED_UPLOAD)
    assert store.prefix.parent.name.startswith("multihead-upload-")
    assert not store.prefix.parent.exists()  # removed after the refusal


def test_a_refusal_names_the_uploaded_parts_instead_of_server_paths():
    def error(prefix: Path, labels: Path) -> InvalidHead:
        return InvalidHead(f"cannot read '{labels}' (bad UTF-8); {prefix}.index is truncated; "
                           f"nothing kept in {prefix.parent}")

    with pytest.raises(InvalidHead) as info:  # the same class: the same status and code
        register_upload(RefusingStore(error), "acme", REFUSED_UPLOAD)
    assert info.value.args == (
        "cannot read <labels part> (bad UTF-8); <uploaded checkpoint>.index is truncated; "
        "nothing kept in <upload>",)


def test_a_refusal_without_a_path_is_raised_unchanged():
    original = InvalidHead("labels", "as the store said it")  # two args: kept as they are
    with pytest.raises(InvalidHead) as info:
        register_upload(RefusingStore(lambda prefix, labels: original), "acme", REFUSED_UPLOAD)
    assert info.value is original and original.args == ("labels", "as the store said it")


# -- admin endpoints -------------------------------------------------------------------------

ACME = make_head("acme", 3, ["cat", "dog"])
ZED = make_head("zed", 1, ["x", "y", "z"])


def admin_service(**kwargs) -> FakeService:
    return FakeService(heads={"acme": ACME, "zed": ZED},
                       settings=Settings(admin_token="s3cret", auth="none"), **kwargs)


async def call(service, module, name: str, **kwargs):
    (e,) = [e for e in module.ENDPOINTS if e.name == name]
    reply = await dispatch(service, e, req(e.method, e.path, **kwargs))
    return reply.status, reply


def info_dict(head, *, manager: bool = False) -> dict:
    """`GET /bots/{id}` of the head's bot; a `manager` (who may manage it) sees its candidate
    (none here)."""
    out = {"bot_id": head.bot_id, "version": head.version, "n_classes": head.n_classes,
           "labels": list(head.labels), "created": "2024-01-01T00:00:00Z",
           "versions": [head.version], "tenant": "default", "pinned": False,
           "int8_agreement": None}
    return {**out, "candidate": None} if manager else out


def test_admin_routes():
    assert [(e.method, e.path, e.name, e.admin) for e in admin.ENDPOINTS] == [
        ("GET", "/bots", "list_bots", False), ("GET", "/bots/{bot_id}", "show_bot", False),
        ("PUT", "/bots/{bot_id}", "put_bot", True),
        ("DELETE", "/bots/{bot_id}", "delete_bot", True),
        ("POST", "/bots/{bot_id}/rollback", "rollback_bot", True),
        ("POST", "/bots/{bot_id}/candidate/promote", "promote_candidate", True),
        ("DELETE", "/bots/{bot_id}/candidate", "discard_candidate", True)]


async def test_list_and_show_bots():
    status, reply = await call(admin_service(), admin, "list_bots")
    assert (status, json.loads(reply.body)) == (200, {"bots": [
        {"bot_id": "acme", "version": 3, "n_classes": 2, "tenant": "default",
         "pinned": False},
        {"bot_id": "zed", "version": 1, "n_classes": 3, "tenant": "default",
         "pinned": False}]})
    status, reply = await call(admin_service(), admin, "show_bot", params={"bot_id": "acme"})
    assert (status, json.loads(reply.body)) == (200, info_dict(ACME))
    status, reply = await call(admin_service(), admin, "show_bot", params={"bot_id": "acme"},
                               headers=TOKEN)
    assert (status, json.loads(reply.body)) == (200, info_dict(ACME, manager=True))
    status, reply = await call(admin_service(), admin, "show_bot", params={"bot_id": "nope"})
    assert (status, json.loads(reply.body)["code"]) == (404, "unknown_bot")


UPLOAD = multipart_body(("files", b"IDX", "h.ckpt.index"), ("files", b"D", "h.ckpt.data-0"),
                        ("labels", b"cat\ndog", "labels.txt"))


@pytest.mark.parametrize("version,status", [(1, 201), (2, 200), (7, 200)])
async def test_put_bot_is_201_for_a_new_bot_200_for_a_new_version(version, status):
    service = admin_service()
    service.store.next_version = version
    got, reply = await call(service, admin, "put_bot", params={"bot_id": "acme"},
                            headers={**TOKEN, "Content-Type": MULTIPART}, body=UPLOAD)
    assert (got, json.loads(reply.body)) == (status, info_dict(ACME, manager=True))
    assert service.store.calls == [("register_checkpoint", "acme", "head.ckpt", "labels.txt",
                                    {"source": "http"})]
    assert service.store.written == {"head.ckpt.index": b"IDX", "head.ckpt.data-0": b"D",
                                     "labels.txt": b"cat\ndog"}
    assert service.blocking == ["parse_multipart", "register_upload"]


@pytest.mark.parametrize("ctype", [None, "application/json", "image/png"])
async def test_put_bot_needs_multipart_before_reading_the_body(ctype):
    service = admin_service()
    headers = {**TOKEN, **({"Content-Type": ctype} if ctype else {})}
    status, reply = await call(service, admin, "put_bot", params={"bot_id": "acme"},
                               headers=headers)
    assert (status, json.loads(reply.body)) == (415, {
        "error": "PUT /bots/{bot_id} takes multipart/form-data with the checkpoint files "
                 "(.index, .data-*) and a 'labels' part", "code": "unsupported_media_type"})
    assert not service.store.calls


async def test_put_bot_without_files_is_400_and_registers_nothing():
    service = admin_service()
    status, reply = await call(service, admin, "put_bot", params={"bot_id": "acme"},
                               headers={**TOKEN, "Content-Type": MULTIPART},
                               body=multipart_body(("labels", b"a", None)))
    assert (status, json.loads(reply.body)["code"]) == (400, "bad_request")
    assert not service.store.calls


async def test_delete_bot():
    service = admin_service()
    status, reply = await call(service, admin, "delete_bot", params={"bot_id": "zed"},
                               headers=TOKEN)
    assert (status, json.loads(reply.body)) == (200, {"bot_id": "zed", "removed": True})
    assert service.store.calls == [("remove", "zed")]


@pytest.mark.parametrize("query,to", [({}, None), ({"to": "2"}, 2), ({"to": "0"}, 0)])
async def test_rollback_bot(query, to):
    service = admin_service()
    status, reply = await call(service, admin, "rollback_bot", params={"bot_id": "acme"},
                               query=query, headers=TOKEN)
    assert (status, json.loads(reply.body)) == (200, info_dict(ACME, manager=True))
    assert service.store.calls == [("rollback", "acme", to)]


@pytest.mark.parametrize("to", ["x", "-1", "1.0", ""])
async def test_rollback_to_a_non_number_is_400(to):
    service = admin_service()
    status, reply = await call(service, admin, "rollback_bot", params={"bot_id": "acme"},
                               query={"to": to}, headers=TOKEN)
    assert (status, json.loads(reply.body)) == (400, {
        "error": f"to must be a version number, got '{to}'", "code": "bad_request"})
    assert not service.store.calls


@pytest.mark.parametrize("mode", ["shadow", "canary:30", " canary:2.5\n"])
async def test_put_bot_with_a_candidate_part_registers_a_candidate(mode):
    service = admin_service()
    service.store.next_version = 4
    body = multipart_body(("files", b"IDX", "h.ckpt.index"), ("files", b"D", "h.ckpt.data-0"),
                          ("labels", b"cat\ndog", "labels.txt"),
                          ("candidate", mode.encode(), None))
    status, reply = await call(service, admin, "put_bot", params={"bot_id": "acme"},
                               headers={**TOKEN, "Content-Type": MULTIPART}, body=body)
    assert (status, json.loads(reply.body)) == (200, info_dict(ACME, manager=True))
    assert service.store.calls == [("register_checkpoint", "acme", "head.ckpt", "labels.txt",
                                    {"source": "http",
                                     "candidate": CandidateMode.parse(mode)})]


@pytest.mark.parametrize("mode", [b"canary:0", b"canary:100", b"canary:x", b"blue", b"\xff"])
async def test_put_bot_with_a_bad_candidate_is_400_and_registers_nothing(mode):
    service = admin_service()
    body = multipart_body(("files", b"IDX", "h.ckpt.index"), ("files", b"D", "h.ckpt.data-0"),
                          ("labels", b"cat\ndog", "labels.txt"), ("candidate", mode, None))
    status, reply = await call(service, admin, "put_bot", params={"bot_id": "acme"},
                               headers={**TOKEN, "Content-Type": MULTIPART}, body=body)
    answer = json.loads(reply.body)
    assert status == 400 and not service.store.calls
    assert answer["code"] == ("bad_request" if mode == b"\xff" else "invalid_candidate")


async def test_promote_and_discard_the_candidate():
    service = admin_service()
    status, reply = await call(service, admin, "promote_candidate", params={"bot_id": "acme"},
                               headers=TOKEN)
    assert (status, json.loads(reply.body)) == (200, info_dict(ACME, manager=True))
    status, reply = await call(service, admin, "discard_candidate", params={"bot_id": "acme"},
                               headers=TOKEN)
    assert (status, json.loads(reply.body)) == (200, {"bot_id": "acme", "discarded": 2})
    assert service.store.calls == [("promote", "acme"), ("discard", "acme")]
    for name in ("promote_candidate", "discard_candidate"):
        status, reply = await call(service, admin, name, params={"bot_id": "nope"},
                                   headers=TOKEN)
        assert (status, json.loads(reply.body)["code"]) == (404, "unknown_bot")
    assert len(service.store.calls) == 2


@pytest.mark.parametrize("name", ["put_bot", "delete_bot", "rollback_bot", "promote_candidate",
                                  "discard_candidate"])
async def test_admin_endpoints_without_a_token_touch_nothing(name):
    service = admin_service()
    status, _ = await call(service, admin, name, params={"bot_id": "acme"},
                           headers={"Content-Type": MULTIPART}, body=UPLOAD)
    assert status == 401 and not service.store.calls and not service.blocking


# -- ops -------------------------------------------------------------------------------------

def test_ops_routes():
    assert [(e.method, e.path, e.name, e.admin) for e in ops.ENDPOINTS] == [
        ("GET", "/healthz", "healthz", False), ("GET", "/readyz", "readyz", False),
        ("GET", "/metrics", "metrics", False)]


@pytest.mark.parametrize("readiness", [None, loading(), failed()])
async def test_healthz_answers_whatever_the_readiness(readiness):
    service = FakeService() if readiness is None else FakeService(readiness=readiness)
    status, reply = await call(service, ops, "healthz")
    assert (status, json.loads(reply.body)) == (200, {"status": "alive"})


@pytest.mark.parametrize("readiness,status,body", [
    (None, 200, {"status": "ready"}),
    (loading(), 503, {"status": "loading"}),
    (failed("trunk failed to load: gone"), 503,
     {"status": "failed", "error": "trunk failed to load: gone"}),
], ids=["ready", "loading", "failed"])
async def test_readyz_reports_the_service_readiness(readiness, status, body):
    service = FakeService() if readiness is None else FakeService(readiness=readiness)
    got, reply = await call(service, ops, "readyz")
    assert (got, json.loads(reply.body)) == (status, body)


async def test_metrics_refreshes_the_resident_heads_then_renders():
    service = FakeService()
    status, reply = await call(service, ops, "metrics")
    assert (status, reply.body, reply.content_type) == (200, b"# metrics\n",
                                                        "text/plain; version=0.0.4")
    assert service.metrics.resident == (3, 4096)


# -- native ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ctype", ["image/jpeg", "IMAGE/PNG; q=1", "image/x-anything",
                                   "application/octet-stream", MULTIPART])
def test_image_content_types_are_accepted(ctype):
    check_image_content_type(req(headers={"Content-Type": ctype}))


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/json", "imagex/png",
                                   "multipart/mixed"])
def test_other_content_types_are_415(ctype):
    with pytest.raises(UnsupportedMediaType) as info:
        check_image_content_type(req(headers={"Content-Type": ctype} if ctype else {}))
    assert str(info.value) == (
        f"unsupported content type '{(ctype or '').split(';')[0]}': send an image (image/jpeg, "
        f"image/png, ...) as the body, or multipart/form-data with 'image' parts")


def test_render_bot_result():
    predictions = [Prediction("acme", 3, [("cat", 0.75), ("dog", 0.25)]),
                   Prediction("acme", 3, [("dog", 0.5)])]
    assert render_bot_result(predictions) == {"bot_id": "acme", "version": 3, "results": [
        {"predictions": [{"label": "cat", "score": 0.75}, {"label": "dog", "score": 0.25}]},
        {"predictions": [{"label": "dog", "score": 0.5}]}]}


def test_bot_ids_limit_is_64_and_an_empty_list_says_how_to_name_them():
    ids = [f"b{i}" for i in range(native.MAX_BOTS_PER_REQUEST)]
    assert native.MAX_BOTS_PER_REQUEST == 64
    assert native.parse_bot_ids(",".join(ids)) == ids
    with pytest.raises(BadRequest) as info:
        native.parse_bot_ids(",".join([*ids, "one-more"]))
    assert str(info.value) == "65 bots in one request, the limit is 64"
    with pytest.raises(BadRequest) as info:
        native.parse_bot_ids("")
    assert str(info.value) == "name the bots to score with ?bots=a,b,c (or use /classify/{bot_id})"


def native_service(**kwargs) -> FakeService:
    return FakeService(heads={"acme": ACME, "zed": ZED},
                       settings=Settings(top_k_default=2, max_images_per_request=2, auth="none"), **kwargs)


def result(head, n_images: int, head_index: int, top_k: int) -> dict:
    rows = []
    for i in range(n_images):
        pr = probabilities(i, head_index, head.n_classes)
        order = np.argsort(-pr, kind="stable")[:top_k]
        rows.append({"predictions": [{"label": head.labels[c], "score": float(pr[c])}
                                     for c in order]})
    return {"bot_id": head.bot_id, "version": head.version, "results": rows}


async def test_classify_one_raw_body():
    service = native_service()
    status, reply = await call(service, native, "classify", params={"bot_id": "zed"},
                               headers={"Content-Type": "image/png"}, body=b"PNG")
    assert (status, json.loads(reply.body)) == (200, result(ZED, 1, 0, 2))
    ((images, bots, top_k),) = service.classified
    assert (images.encoded, bots, top_k) == ([b"PNG"], ["zed"], 2)
    assert service.blocking == []  # a raw body needs no parsing thread


async def test_classify_one_multipart_with_top_k():
    service = native_service()
    body = multipart_body(("image", b"A", "a.jpg"), ("other", b"x", None), ("image", b"B", None))
    status, reply = await call(service, native, "classify", params={"bot_id": "zed"},
                               query={"top_k": "3"}, headers={"Content-Type": MULTIPART},
                               body=body)
    assert (status, json.loads(reply.body)) == (200, result(ZED, 2, 0, 3))
    assert service.classified[0][0].encoded == [b"A", b"B"]
    assert service.blocking == ["parse_images"]


async def test_classify_one_with_more_images_than_allowed_is_413():
    body = multipart_body(*[("image", b"I", None)] * 3)
    status, reply = await call(native_service(), native, "classify", params={"bot_id": "zed"},
                               headers={"Content-Type": MULTIPART}, body=body)
    assert (status, json.loads(reply.body)) == (413, {
        "error": "more than 2 images in one request", "code": "payload_too_large"})


async def test_classify_many_answers_per_bot_in_the_query_order():
    service = native_service()
    status, reply = await call(service, native, "classify_many",
                               query={"bots": "zed, acme,zed", "top_k": "1"},
                               headers={"Content-Type": "image/jpeg"}, body=b"JPG")
    body = json.loads(reply.body)
    assert (status, body) == (200, {"results": {"zed": result(ZED, 1, 0, 1),
                                                "acme": result(ACME, 1, 1, 1)}})
    assert list(body["results"]) == ["zed", "acme"]
    assert service.classified[0][1:] == (["zed", "acme"], 1)


async def test_classify_many_uses_the_default_top_k():
    service = native_service()
    status, reply = await call(service, native, "classify_many", query={"bots": "acme"},
                               headers={"Content-Type": "image/jpeg"}, body=b"JPG")
    assert (status, json.loads(reply.body)) == (200, {"results": {"acme": result(ACME, 1, 0, 2)}})
    assert service.classified[0][2] == 2


@pytest.mark.parametrize("name,params,query,headers,status,code", [
    ("classify", {"bot_id": "nope"}, {}, {"Content-Type": "image/png"}, 404, "unknown_bot"),
    ("classify", {"bot_id": "zed"}, {"top_k": "0"}, {"Content-Type": "image/png"}, 400,
     "bad_request"),
    ("classify", {"bot_id": "zed"}, {}, {"Content-Type": "text/plain"}, 415,
     "unsupported_media_type"),
    ("classify_many", {}, {"bots": "zed,nope"}, {"Content-Type": "image/png"}, 404,
     "unknown_bot"),
    ("classify_many", {}, {}, {"Content-Type": "image/png"}, 400, "bad_request"),
    ("classify_many", {}, {"bots": "zed", "top_k": "x"}, {"Content-Type": "image/png"}, 400,
     "bad_request"),
], ids=["unknown-bot", "top-k", "content-type", "many-unknown", "many-no-bots", "many-top-k"])
async def test_classify_refuses_before_reading_the_body(name, params, query, headers, status,
                                                        code):
    def explode():
        raise AssertionError("body read")

    service = native_service()
    (e,) = [e for e in native.ENDPOINTS if e.name == name]
    request = Request(e.method, e.path, params, query, {k.lower(): v for k, v in headers.items()},
                      explode)
    reply = await dispatch(service, e, request)
    assert (reply.status, json.loads(reply.body)["code"]) == (status, code)
    assert not service.classified


@pytest.mark.parametrize("name,params", [("classify", {"bot_id": "zed"}),
                                         ("classify_many", {})])
async def test_classify_while_loading_is_503(name, params):
    service = native_service(readiness=loading())
    status, reply = await call(service, native, name, params=params, query={"bots": "zed"},
                               headers={"Content-Type": "image/png"}, body=b"P")
    assert (status, reply.headers["Retry-After"], json.loads(reply.body)["code"]) == (
        503, "5", "not_ready")


def test_native_routes():
    assert [(e.method, e.path, e.name, e.admin) for e in native.ENDPOINTS] == [
        ("POST", "/classify/{bot_id}", "classify", False),
        ("POST", "/classify", "classify_many", False)]


# -- what the mutation run showed untested ---------------------------------------------------

def test_multipart_refuses_what_only_a_strict_parser_refuses():
    body = multipart_body(("image", b"A", "a.jpg")).replace(
        b'Content-Disposition: form-data; name="image"',
        b'Content-Disposition: form-data;\r\n name="image"')  # an obsolete header continuation
    with pytest.raises(BadRequest) as info:
        native.parse_multipart(MULTIPART, body)
    assert str(info.value) == "malformed multipart body: Unexpected segment header continuation"


def test_multipart_keeps_part_content_types_and_large_parts_whole():
    big = bytes(range(256)) * 1200  # 300 KiB: more than one chunk of the parser's buffer
    body = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\""
            f"\r\nContent-Type: image/png\r\n\r\n").encode() + big + \
        f"\r\n--{BOUNDARY}--\r\n".encode()
    (part,) = native.parse_multipart(MULTIPART, body)
    assert (part.name, part.filename, part.content_type, part.data == big) == (
        "image", "a.png", "image/png", True)


def test_multipart_error_messages():
    with pytest.raises(BadRequest) as info:
        native.parse_multipart("multipart/form-data", b"")
    assert str(info.value) == "multipart/form-data without a boundary parameter"
    body = multipart_body(*[("x", b"1", None)] * 3)
    with pytest.raises(native.PayloadTooLarge) as too_many:
        native.parse_multipart(MULTIPART, body, max_parts=2)
    assert str(too_many.value) == "more than 2 parts in one multipart body"
    with pytest.raises(BadRequest) as info:
        native.parse_multipart(MULTIPART, body[:-4])
    assert str(info.value).startswith("malformed multipart body: ") and \
        len(str(info.value)) > len("malformed multipart body: ") + 5


def test_internal_errors_are_logged_with_their_traceback_domain_errors_are_not(caplog):
    import logging

    from service.codecs.base import error_reply
    from service.core.errors import HeadUnavailable

    with caplog.at_level(logging.ERROR, logger="service.codecs.base"):
        for exc in (BadRequest("x"), HeadUnavailable("y"), UnsupportedMediaType("z")):
            error_reply(exc)
        assert caplog.records == []
        reply = error_reply(RuntimeError("boom"))
    assert reply.status == 500
    (record,) = caplog.records
    assert record.getMessage() == "internal error" and str(record.exc_info[1]) == "boom"


@pytest.mark.parametrize("text,want", [("-A==", b"\xf8"), ("_w==", b"\xff"), ("a-_b", b"k\xef\xdb")])
def test_b64decode_takes_either_urlsafe_character_alone(text, want):
    from service.codecs.common import b64decode

    assert b64decode(text, "x") == want


async def test_a_version_mismatch_names_the_bot():
    from service.codecs import oip

    service = FakeService(heads={"acme": ACME})
    for e in oip.ENDPOINTS:
        if e.name in ("oip_model_metadata_version", "oip_infer_version"):
            reply = await dispatch(service, e, req(e.method, e.path, body=b"{}",
                                                   params={"bot_id": "acme", "version": "9"}))
            assert json.loads(reply.body) == {
                "error": "bot 'acme' version 9 is not served: only its active version 3 is",
                "code": "unknown_version"}
