"""Bounds on what a tenant stores and on what an answer can be (issue 34, item 4), on a real
server: a head upload with a label against the label rules is a 400 naming the label; an
answer whose upper bound is over `max_answer_bytes` is a 413 before any image is decoded."""
from __future__ import annotations

import base64
import json

import aiohttp
import pytest

from backbone.checkpoint import write_checkpoint
from heads import MAX_LABEL_CHARS
from service.core.inference import answer_bound
from tests.support.builders import random_head
from tests.support.prometheus import metric

pytestmark = pytest.mark.timeout(300)
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DECODED = "multihead_decode_seconds_count"


def upload(tmp_path, labels: list[str]) -> aiohttp.FormData:
    weights, biases, _ = random_head(len(labels), seed=3)
    prefix = write_checkpoint(str(tmp_path / "up" / "head.ckpt"),
                              {"weights": weights, "biases": biases})
    form = aiohttp.FormData()
    form.add_field("index", open(f"{prefix}.index", "rb").read(), filename="head.ckpt.index")
    form.add_field("data", open(f"{prefix}.data-00000-of-00001", "rb").read(),
                   filename="head.ckpt.data-00000-of-00001")
    form.add_field("labels", "".join(f"{label}\n" for label in labels), filename="labels.txt")
    return form


@pytest.mark.parametrize("label, said", [
    ("x" * (MAX_LABEL_CHARS + 1), "257 characters, at most 256"),
    ("\x07" * 2**20, "1,048,576 characters, at most 256"),
    ("red\x1b[31m", "control character U+001B at character 4"),
])
async def test_a_head_upload_with_a_bad_label_is_a_400_naming_it(make_client, tmp_path,
                                                                 label, said):
    # was: 201 for a 1 MB label of control characters
    client = await make_client(admin_token=TOKEN)
    for as_candidate in (False, True):  # a new bot, then a `candidate` part for a live one
        form = upload(tmp_path, ["cat", label])
        if as_candidate:
            form.add_field("candidate", "shadow")
        resp = await client.put("/bots/alpha" if as_candidate else "/bots/newbie", data=form,
                                headers=AUTH)
        body = await resp.json()
        assert resp.status == 400 and body["code"] == "invalid_label", body
        assert body["error"].startswith("label 1 (line 2 of labels file <labels part>)"), body
        assert said in body["error"] and len(body["error"]) < 300
        assert "\x1b" not in body["error"] and "\x07" not in body["error"]
    assert (await client.get("/bots/newbie")).status == 404


async def test_a_label_of_the_longest_length_is_registered(make_client, tmp_path):
    client = await make_client(admin_token=TOKEN)
    resp = await client.put("/bots/newbie", data=upload(tmp_path, ["cat", "y" * 256]),
                            headers=AUTH)
    assert resp.status == 201, await resp.text()
    assert (await resp.json())["labels"] == ["cat", "y" * 256]


def images_form(images) -> aiohttp.FormData:
    form = aiohttp.FormData()
    for i, data in enumerate(images):
        form.add_field("image", data, filename=f"{i}.jpg", content_type="image/jpeg")
    return form


async def test_an_answer_over_the_bound_is_a_413_before_any_decode(make_client, store, jpegs):
    # was: a 48 MB answer for 8 images, built on the event loop
    weights, biases, _ = random_head(10, seed=9)
    wordy = [f"{i}" + "w" * (MAX_LABEL_CHARS - 1) for i in range(10)]
    store.register("wordy", weights, biases, wordy)
    heads = [store.get("wordy"), store.get("alpha")]
    limit = 20_000
    assert answer_bound(1, heads, 10) < limit < answer_bound(8, heads, 10)
    client = await make_client(max_answer_bytes=limit)
    before = metric(await (await client.get("/metrics")).text(), DECODED)
    resp = await client.post("/classify?bots=wordy,alpha&top_k=10", data=images_form(jpegs))
    body = await resp.json()
    assert resp.status == 413 and body["code"] == "answer_too_large", body
    assert f"{answer_bound(8, heads, 10):,} bytes" in body["error"]
    assert "8 image(s) x 2 bot(s) x up to 10 prediction(s)" in body["error"]
    assert "20,000 (max_answer_bytes)" in body["error"]
    assert metric(await (await client.get("/metrics")).text(), DECODED) == before
    # TF Serving renders every class's probability: counted too.
    tfs = {"instances": [{"b64": base64.b64encode(j).decode()} for j in jpegs]}
    resp = await client.post("/v1/models/wordy:predict?top_k=10", json=tfs)
    assert resp.status == 413 and (await resp.json())["code"] == "answer_too_large"
    assert metric(await (await client.get("/metrics")).text(), DECODED) == before

    # Within the bound: answered, and the answer is within its bound.
    resp = await client.post("/classify?bots=wordy,alpha&top_k=10", data=images_form(jpegs[:1]))
    assert resp.status == 200, await resp.text()
    raw = await resp.read()
    assert len(raw) <= answer_bound(1, heads, 10)
    results = json.loads(raw)["results"]
    assert len(results["wordy"]["results"][0]["predictions"]) == 10  # top_k capped at classes
    assert len(results["alpha"]["results"][0]["predictions"]) == 2


async def test_the_bound_holds_the_real_answers(make_client, store, jpegs):
    """The default bound is an upper bound of every protocol's real answer."""
    weights, biases, _ = random_head(10, seed=9)
    store.register("wordy", weights, biases,
                   ["\u00e9\U0001F600" * 128] + [f"c{i}" for i in range(9)])
    head = store.get("wordy")
    client = await make_client()
    resp = await client.post("/classify/wordy?top_k=99", data=images_form(jpegs[:4]))
    assert resp.status == 200 and len(await resp.read()) <= answer_bound(4, [head], 99)
    tfs = {"instances": [{"b64": base64.b64encode(j).decode()} for j in jpegs[:4]]}
    resp = await client.post("/v1/models/wordy:predict?top_k=99", json=tfs)
    assert resp.status == 200 and len(await resp.read()) <= answer_bound(4, [head], 99,
                                                                         all_scores=True)
