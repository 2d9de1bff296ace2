"""Candidates served: a shadow scored on every image and compared with the live version, a
canary answering its share of the requests by a sticky routing key, a failing candidate that
leaves the live answers alone, and promote / discard by the CLI in another process while a
server runs.

The end-to-end tests run a real server on loopback (`make_client`: the session's real trunk, a
real directory store); their expectations are computed here with numpy from the two heads and
the trunk's own features of the same images (`features_of`). The pure logic (routing, the
comparison, the tally, the metrics' labels, `score` with a candidate that raises) is tested on
its own first.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from accounts import Candidate, CandidateMode
from backbone.spec import FEATURE_DIM
from bench.prometheus import samples
from heads import Head
from service.core.candidates import (
    ROUTE_KEY_HEADER,
    CandidateStats,
    Route,
    compare,
    route_bucket,
    route_for,
    route_key,
)
from service.core.metrics import Metrics
from service.core.scoring import Item, score
from service.transports.http.app import LISTENERS
from store import open_store
from tests.support.builders import random_head
from tests.support.polling import until_checked
from tests.support.prometheus import metric

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
TOKEN = "candidates-operator"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JPEG = {"Content-Type": "image/jpeg"}
# The contract is 1 s from a change in another process to the server serving it; on a loaded
# 2-core machine we allow 2 s of stated slack on top (tests/store/test_changes.py).
SEEN_WITHIN_S = 1.0 + 2.0


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def head(bot_id: str, version: int, weights, biases, labels, cls: type[Head] = Head) -> Head:
    return cls(bot_id, version, tuple(labels), np.asarray(weights, np.float32),
               np.asarray(biases, np.float32))


# -- routing ----------------------------------------------------------------------------------


def test_the_split_is_stable_across_processes_and_close_to_its_share():
    keys = [f"user-{i}" for i in range(10_000)]
    buckets = [route_bucket("acme", route_key(k, b"")) for k in keys]
    assert all(0 <= b < 100 for b in buckets)
    assert abs(sum(b < 30 for b in buckets) / len(keys) - 0.30) < 0.02
    assert abs(sum(b < 5 for b in buckets) / len(keys) - 0.05) < 0.01
    # Another bot splits the same keys otherwise (its canary is its own experiment).
    other = [route_bucket("beta", route_key(k, b"")) for k in keys[:200]]
    assert other != buckets[:200]
    # Another interpreter with another hash seed: the same buckets (Python's `hash` would not).
    code = ("from service.core.candidates import route_bucket, route_key\n"
            "print([route_bucket('acme', route_key(f'user-{i}', b'')) for i in range(50)])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                             text=True, timeout=60, env={"PYTHONHASHSEED": seed,
                                                         "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == repr(buckets[:50])


def test_a_key_given_and_an_image_digest_never_route_alike():
    digest = b"\x01" * 20
    assert route_key(None, digest) == b"d:" + digest and route_key("", digest) == b"d:" + digest
    assert route_key("k", digest) == b"k:k"
    assert route_key(digest.decode("latin-1"), b"") != route_key(None, digest)


def test_raising_the_share_keeps_the_canarys_keys():
    w, b, labels = random_head(3, seed=1)
    candidate = head("acme", 2, w, b, labels)
    keys = [route_key(f"k{i}", b"") for i in range(2000)]

    def answered(percent):
        c = Candidate(candidate, CandidateMode("canary", percent))
        return {k for k in keys if route_for(c, "acme", k).answers}

    small, large = answered(10), answered(40)
    assert small < large and 0.08 < len(small) / 2000 < 0.12
    shadow = Candidate(candidate, CandidateMode("shadow"))
    assert not any(route_for(shadow, "acme", k).answers for k in keys)


# -- the comparison, the tally, the metrics ---------------------------------------------------


def test_compare_matches_labels_not_indices():
    live = head("acme", 1, np.zeros((FEATURE_DIM, 3)), np.zeros(3), ["cat", "dog", "fish"])
    candidate = head("acme", 2, np.zeros((FEATURE_DIM, 3)), np.zeros(3), ["dog", "cat", "owl"])
    live_p = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]])
    cand_p = np.array([[0.1, 0.6, 0.3], [0.3, 0.6, 0.1], [0.5, 0.1, 0.4], [0.2, 0.2, 0.6]])
    result = compare(live, live_p, candidate, cand_p)
    # top-1: cat/cat agree, dog/cat, fish/dog (the candidate has no fish: p = 0), cat/owl
    assert (result.images, result.agreed) == (4, 1)
    assert result.abs_diff == pytest.approx(abs(0.7 - 0.6) + abs(0.8 - 0.3) + abs(0.6 - 0.0)
                                            + abs(0.5 - 0.2))
    assert result.disagreements == {("dog", "cat"): 1, ("fish", "dog"): 1, ("cat", "owl"): 1}


def test_the_tally_reports_the_most_frequent_disagreements_and_restarts_per_version():
    live = head("acme", 1, np.zeros((FEATURE_DIM, 2)), np.zeros(2), ["a", "b"])
    other = head("acme", 2, np.zeros((FEATURE_DIM, 2)), np.zeros(2), ["b", "a"])
    stats = CandidateStats()
    assert stats.report("acme", 2) == {
        "since": None, "images": 0, "agreed": 0, "agreement": None, "mean_abs_diff": None,
        "answered": 0, "failures": 0, "disagreements": []}
    sure_a, sure_b = [[0.9, 0.1]], [[0.2, 0.8]]
    for live_p, cand_p in ((sure_a, sure_a), (sure_a, sure_a), (sure_b, sure_b)):
        # candidate's class 0 is "b": sure_a means "b" for it
        stats.observe("acme", 2, "canary", compare(live, np.array(live_p), other,
                                                   np.array(cand_p)), answered=1)
    stats.observe("acme", 2, "canary", None, failed=3)
    report = stats.report("acme", 2)
    assert {k: report[k] for k in ("images", "agreed", "answered", "failures")} == {
        "images": 3, "agreed": 0, "answered": 3, "failures": 3}
    assert report["agreement"] == 0 and report["since"] is not None
    assert report["mean_abs_diff"] == pytest.approx((0.8 + 0.8 + 0.6) / 3)
    assert report["disagreements"] == [{"live": "a", "candidate": "b", "images": 2},
                                       {"live": "b", "candidate": "a", "images": 1}]
    stats.observe("acme", 3, "shadow", compare(live, np.array(sure_a), live, np.array(sure_a)))
    assert stats.report("acme", 2)["images"] == 0  # a new candidate, a new tally
    assert stats.report("acme", 3)["agreed"] == 1


def test_candidate_series_follow_the_bots_labels():
    metrics = Metrics(top_bots=1)
    metrics.observe_bot("acme", 10)
    assert metrics.observe_candidate("acme", 2, images=4, agreed=3, abs_diff=0.5) == (
        "acme", "2")
    assert metrics.observe_candidate("beta", 7, images=1, failed=2) == ("other", "other")
    text = metrics.render()[0].decode()
    assert metric(text, 'multihead_candidate_images_total{bot="acme",version="2"}') == 4
    assert metric(text, 'multihead_candidate_agreed_total{bot="acme",version="2"}') == 3
    assert metric(text, 'multihead_candidate_top1_abs_diff_total{bot="acme",version="2"}') \
        == 0.5
    assert metric(text, 'multihead_candidate_failures_total{bot="other",version="other"}') == 2
    metrics.observe_candidate("acme", 3, images=1)  # a new candidate: the old series go
    text = metrics.render()[0].decode()
    assert not any(("version", "2") in labels for _, labels in samples(text)) and metric(
        text, 'multihead_candidate_images_total{bot="acme",version="3"}') == 1
    metrics.observe_bot("beta", 100)  # beta takes acme's label: acme's series go too
    assert not any(name.startswith("multihead_candidate") and ("bot", "acme") in labels
                   for name, labels in samples(metrics.render()[0].decode()))


def test_a_candidate_that_raises_fails_alone():
    features = np.random.default_rng(3).standard_normal((4, FEATURE_DIM)).astype(np.float32)
    live = head("acme", 1, *random_head(3, seed=1))
    beta = head("beta", 1, *random_head(2, seed=2))

    class Broken(Head):
        def probabilities(self, features):
            raise FloatingPointError("overflow in the candidate's logits")

    broken = head("acme", 2, *random_head(3, seed=3), cls=Broken)
    seen = []
    route = Route(broken, "canary", True)
    items = [Item(None, f, b"d", (live, beta), 2, routes=(route, None)) for f in features]
    results = score(features, items, lambda *args: seen.append(args))
    expected = score(features, [Item(None, f, b"d", (live, beta), 2) for f in features])
    assert results == expected and all(p[0].version == 1 for p in results)
    assert [(s[0], s[2], s[3], s[4]) for s in seen] == [(live, None, 0, 4)]


# -- end to end: a shadow ---------------------------------------------------------------------


def designed_heads(features: np.ndarray):
    """A live head (cat, dog, bird, fish) whose top-1 is cat for half the images and dog for
    the other half, and a candidate (dog, cat, bird, owl, ant: no fish) that never says cat:
    it agrees on the dog images only."""
    rng = np.random.default_rng(7)
    u = rng.standard_normal(FEATURE_DIM)
    u /= (features @ u).std()
    threshold = float(np.median(features @ u))
    live_w = np.zeros((FEATURE_DIM, 4))
    live_w[:, 0], live_w[:, 1] = u, -u
    live_b = np.array([-threshold, threshold, -8.0, -8.0])
    cand_w = np.zeros((FEATURE_DIM, 5))
    cand_w[:, 0], cand_w[:, 1] = -1.5 * u, u
    cand_b = np.array([1.5 * threshold, -1000.0, -8.0, -8.0, -9.0])
    return ((live_w, live_b, ["cat", "dog", "bird", "fish"]),
            (cand_w, cand_b, ["dog", "cat", "bird", "owl", "ant"]))


def expected_comparison(features, live, candidate) -> dict:
    """What the stats must say, from the heads and the features alone (numpy)."""
    (lw, lb, ll), (cw, cb, cl) = live, candidate
    live_p, cand_p = softmax(features @ lw + lb), softmax(features @ cw + cb)
    top, theirs = live_p.argmax(axis=1), cand_p.argmax(axis=1)
    pairs = [(ll[t], cl[c]) for t, c in zip(top, theirs)]
    agreed = sum(a == b for a, b in pairs)
    diffs = [abs(live_p[i, t] - (cand_p[i, cl.index(ll[t])] if ll[t] in cl else 0.0))
             for i, t in enumerate(top)]
    counts = collections.Counter(p for p in pairs if p[0] != p[1])
    return {"images": len(features), "agreed": agreed, "mean_abs_diff": float(np.mean(diffs)),
            "sum_abs_diff": float(np.sum(diffs)),
            "disagreements": [{"live": a, "candidate": b, "images": n}
                              for (a, b), n in sorted(counts.items(),
                                                      key=lambda kv: (-kv[1], kv[0]))]}


async def test_a_shadow_is_compared_on_every_image_and_never_answers(make_client, store, jpegs,
                                                                     features_of):
    features = np.stack([features_of[j] for j in jpegs]).astype(np.float64)
    live, candidate = designed_heads(features)
    want = expected_comparison(features, live, candidate)
    assert want["agreed"] == 4 and want["disagreements"] == [
        {"live": "cat", "candidate": "dog", "images": 4}]  # the design holds on these images
    store.register("acme", *live)
    assert store.register("acme", *candidate, candidate="shadow") == 2
    client = await make_client(admin_token=TOKEN)

    form = aiohttp.FormData()
    for i, data in enumerate(jpegs):
        form.add_field("image", data, filename=f"{i}.jpg", content_type="image/jpeg")
    resp = await client.post("/classify/acme?top_k=4", data=form)
    body = await resp.json()
    assert resp.status == 200 and body["version"] == 1, body  # never the shadow's answer
    live_p = softmax(features @ live[0] + live[1])
    for row, result in zip(live_p, body["results"]):
        got = {p["label"]: p["score"] for p in result["predictions"]}
        assert set(got) == set(live[2])
        np.testing.assert_allclose([got[label] for label in live[2]], row, atol=1e-4)

    info = await (await client.get("/bots/acme", headers=AUTH)).json()
    assert info["version"] == 1 and info["versions"] == [1]
    shown = info["candidate"]
    assert {k: shown[k] for k in ("version", "mode", "percent", "n_classes", "labels")} == {
        "version": 2, "mode": "shadow", "percent": None, "n_classes": 5,
        "labels": candidate[2]}
    stats = shown["stats"]
    assert (stats["images"], stats["agreed"], stats["answered"], stats["failures"]) == (
        want["images"], want["agreed"], 0, 0)
    assert stats["agreement"] == want["agreed"] / want["images"]
    assert stats["mean_abs_diff"] == pytest.approx(want["mean_abs_diff"], abs=1e-4)
    assert stats["disagreements"] == want["disagreements"]
    # A caller that may not manage the bot is not shown its candidate.
    assert "candidate" not in await (await client.get("/bots/acme")).json()

    text = await (await client.get("/metrics")).text()
    series = '{bot="acme",version="2"}'
    assert metric(text, f"multihead_candidate_images_total{series}") == want["images"]
    assert metric(text, f"multihead_candidate_agreed_total{series}") == want["agreed"]
    assert metric(text, f"multihead_candidate_top1_abs_diff_total{series}") == pytest.approx(
        want["sum_abs_diff"], abs=1e-3)
    assert metric(text, f"multihead_candidate_answers_total{series}") == 0


# -- end to end: a canary ---------------------------------------------------------------------


def _string_tensor(data: bytes):
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[data])
    tensor.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
    return tensor


async def test_a_canary_answers_its_share_by_a_sticky_key_on_every_protocol(
        make_client, store, jpegs, features_of):
    live, candidate = random_head(3, seed=31), random_head(4, seed=32)
    store.register("acme", *live)
    store.register("acme", *candidate, candidate="canary:30")
    client = await make_client(admin_token=TOKEN, grpc_port=0)
    heads = {1: live, 2: candidate}

    served: list[int] = []  # the version that answered each request (one image each)

    async def classify(key: str | None, image: bytes) -> int:
        headers = {**JPEG, **({ROUTE_KEY_HEADER: key} if key is not None else {})}
        resp = await client.post("/classify/acme?top_k=4", data=image, headers=headers)
        body = await resp.json()
        assert resp.status == 200, body
        w, b, labels = heads[body["version"]]  # the answer is the version it names
        p = softmax(features_of[image][None].astype(np.float64) @ w + b)[0]
        got = {x["label"]: x["score"] for x in body["results"][0]["predictions"]}
        assert set(got) == set(labels)
        np.testing.assert_allclose([got[label] for label in labels], p, atol=1e-4)
        served.append(body["version"])
        return body["version"]

    # 400 requests, each its own routing key; 8 images, their features cached after the first.
    keys = [f"user-{i}" for i in range(400)]
    limit = asyncio.Semaphore(16)

    async def one(i: int) -> int:
        async with limit:
            return await classify(keys[i], jpegs[i % len(jpegs)])

    versions = dict(zip(keys, await asyncio.gather(*(one(i) for i in range(400)))))
    canary = {k for k, v in versions.items() if v == 2}
    assert 0.25 * 400 <= len(canary) <= 0.35 * 400, len(canary)
    # The split is the documented one: blake2b of the bot and the key, below 30.
    assert canary == {k for k in keys if route_bucket("acme", route_key(k, b"")) < 30}
    # Sticky: the same key gets the same version, whatever the image.
    again = await asyncio.gather(*(classify(k, jpegs[(i + 3) % 8]) for i, k in
                                   enumerate(keys[:40])))
    assert again == [versions[k] for k in keys[:40]]
    # No key: the image's digest routes it, the same way every time.
    first = [await classify(None, j) for j in jpegs]
    assert [await classify(None, j) for j in jpegs] == first

    # OIP: the route_key parameter wins over the header; model_version names the answerer.
    for key in keys[:12]:
        request = {"parameters": {"route_key": key},
                   "inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [1],
                               "data": [base64.b64encode(jpegs[0]).decode()]}]}
        resp = await client.post("/v2/models/acme/infer", json=request,
                                 headers={ROUTE_KEY_HEADER: "not-this-one"})
        body = await resp.json()
        assert resp.status == 200, body
        assert int(body["model_version"]) == versions[key]
        assert body["outputs"][0]["shape"] == [1, len(heads[versions[key]][2])]
        served.append(versions[key])
    # TF Serving REST: the X-Multihead-Version header names the answerer.
    for key in keys[:12]:
        resp = await client.post("/v1/models/acme:predict", headers={ROUTE_KEY_HEADER: key},
                                 json={"instances": [{"b64": base64.b64encode(
                                     jpegs[1]).decode()}]})
        body = await resp.json()
        assert resp.status == 200 and int(resp.headers["X-Multihead-Version"]) == versions[key]
        assert set(body["predictions"][0]["classes"]) <= set(heads[versions[key]][2])
        served.append(versions[key])

    # gRPC: the x-multihead-route-key metadata (KServe v2 and TF Serving).
    server = client.app[LISTENERS][0]
    await asyncio.wait_for(server.wait_started(), 60)
    address = f"127.0.0.1:{server.port}"

    def over_grpc() -> tuple[list[int], list[int]]:
        kserve, tfs = [], []
        client = triton.InferenceServerClient(address)
        try:
            for key in keys[:12]:
                inp = triton.InferInput("image_bytes", [1], "BYTES")
                inp.set_data_from_numpy(np.array([jpegs[2]], dtype=object))
                result = client.infer("acme", [inp], headers={"x-multihead-route-key": key})
                kserve.append(int(result.get_response().model_version))
        finally:
            client.close()
        with grpc.insecure_channel(address) as channel:
            predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
            for key in keys[:12]:
                request = predict_pb2.PredictRequest()
                request.model_spec.name = "acme"
                request.inputs["image_bytes"].CopyFrom(_string_tensor(jpegs[3]))
                answer = predict(request, metadata=(("x-multihead-route-key", key),),
                                 timeout=60)
                tfs.append(answer.model_spec.version.value)
        return kserve, tfs

    kserve, tfs = await asyncio.get_running_loop().run_in_executor(None, over_grpc)
    assert kserve == tfs == [versions[k] for k in keys[:12]]
    served += kserve + tfs

    # The live version is scored on the canary's requests too: every image is compared.
    info = await (await client.get("/bots/acme", headers=AUTH)).json()
    stats = info["candidate"]["stats"]
    assert len(served) == 400 + 40 + 16 + 4 * 12
    assert (stats["images"], stats["answered"], stats["failures"]) == (
        len(served), served.count(2), 0)
    assert info["candidate"]["mode"] == "canary" and info["candidate"]["percent"] == 30
    text = await (await client.get("/metrics")).text()
    assert metric(text, 'multihead_candidate_answers_total{bot="acme",version="2"}') == \
        served.count(2)


# -- end to end: a failing candidate ----------------------------------------------------------


async def test_a_failing_candidate_leaves_the_live_answers_intact(make_client, store, jpegs,
                                                                  monkeypatch, caplog):
    for bot, seed in (("acme", 41), ("beta", 51)):
        store.register(bot, *random_head(3, seed=seed))
    client = await make_client(admin_token=TOKEN)

    async def answers(keys) -> list[dict]:
        out = []
        for key in keys:
            resp = await client.post("/classify?bots=acme,beta&top_k=3", data=jpegs[0],
                                     headers={**JPEG, ROUTE_KEY_HEADER: key})
            assert resp.status == 200, await resp.text()
            out.append((await resp.json())["results"])
        return out

    keys = [f"k{i}" for i in range(6)]
    before = await answers(keys)  # no candidates yet
    # acme: a canary at 99 % whose head raises when scored; beta: a shadow whose files are
    # gone before its head is first loaded.
    store.register("acme", *random_head(3, seed=42), candidate="canary:99")
    store.register("beta", *random_head(3, seed=52), candidate="shadow")
    for entry in (Path(store.root) / "heads" / "beta" / "v2").iterdir():
        entry.unlink()
    original = Head.probabilities

    def overflowing(self, features):
        if (self.bot_id, self.version) == ("acme", 2):
            raise FloatingPointError("overflow in the candidate's logits")
        return original(self, features)

    monkeypatch.setattr(Head, "probabilities", overflowing)
    after = await answers(keys)
    assert after == before  # the live answers, version 1, as if there were no candidates
    for bot in ("acme", "beta"):
        stats = (await (await client.get(f"/bots/{bot}", headers=AUTH)).json())["candidate"]
        assert (stats["version"], stats["stats"]["failures"], stats["stats"]["images"],
                stats["stats"]["answered"]) == (2, len(keys), 0, 0)
    text = await (await client.get("/metrics")).text()
    for bot in ("acme", "beta"):
        assert metric(text, f'multihead_candidate_failures_total{{bot="{bot}",version="2"}}') \
            == len(keys)
    assert "candidate v2 of bot acme failed" in caplog.text
    assert "candidate of bot 'beta' cannot be loaded" in caplog.text


# -- end to end: promote and discard from another process --------------------------------------


def _cli(root, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *argv, "--store", str(root)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.subprocess
async def test_the_cli_promotes_and_discards_while_a_server_serves(make_client, store, jpegs):
    store.register("acme", *random_head(3, seed=61))
    client = await make_client(admin_token=TOKEN)
    loop = asyncio.get_running_loop()

    async def version() -> int:
        resp = await client.post("/classify/acme", data=jpegs[0], headers=JPEG)
        return (await resp.json())["version"]

    async def candidate() -> dict | None:
        return (await (await client.get("/bots/acme", headers=AUTH)).json())["candidate"]

    async def has(v) -> bool:
        shown = await candidate()
        return (shown and shown["version"]) == v

    with open_store(store.root) as other:  # another connection, as another process's
        other.register("acme", *random_head(5, seed=62), candidate="canary:50")
    await until_checked(lambda: has(2), SEEN_WITHIN_S, what="the canary")
    proc = await loop.run_in_executor(None, _cli, store.root, "bots", "promote", "acme")
    assert proc.returncode == 0, proc.stderr
    assert "active version 1 -> 2" in proc.stdout

    async def promoted() -> bool:
        return await version() == 2 and await candidate() is None

    await until_checked(promoted, SEEN_WITHIN_S, what="the promotion")
    with open_store(store.root) as other:
        other.register("acme", *random_head(3, seed=63), candidate="shadow")
    await until_checked(lambda: has(3), SEEN_WITHIN_S, what="the shadow")
    proc = await loop.run_in_executor(None, _cli, store.root, "bots", "discard", "acme")
    assert proc.returncode == 0, proc.stderr
    await until_checked(lambda: has(None), SEEN_WITHIN_S, what="the discard")
    assert await version() == 2
    # The CLI's one-line refusals, with nothing left to promote or discard.
    for action in ("promote", "discard"):
        proc = await loop.run_in_executor(None, _cli, store.root, "bots", action, "acme")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1
        assert "multihead bots: error: bot 'acme' has no candidate" in proc.stderr
