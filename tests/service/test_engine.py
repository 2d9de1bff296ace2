"""The data plane's logic without TensorFlow: the feature cache, `score`, and `Engine` around a
fake trunk (the subject is which rows reach the trunk and which heads score which rows; the real
trunk's end-to-end behaviour is tested over HTTP in test_app.py)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backbone.spec import FEATURE_DIM, INPUT
from heads import Head
from service.core.batcher import Row
from service.core.engine import Engine, FeatureCache, Item, score
from service.core.errors import BadRequest, PayloadTooLarge
from service.core.metrics import Metrics
from service.core.settings import Settings
from tests.backbone.helpers import encode, pattern
from tests.service.conftest import random_head

pytestmark = pytest.mark.timeout(60)


def vec(value: float) -> np.ndarray:
    return np.full(FEATURE_DIM, value, np.float32)


# -- FeatureCache ---------------------------------------------------------------------------------


def test_feature_cache_keeps_the_most_recently_used_within_its_bound():
    cache = FeatureCache(2)
    cache.put(b"a", vec(1))
    cache.put(b"b", vec(2))
    assert cache.get(b"a")[0] == 1  # "a" is now the most recent
    cache.put(b"c", vec(3))  # evicts "b", the least recently used
    assert len(cache) == 2
    assert cache.get(b"b") is None
    assert cache.get(b"a")[0] == 1 and cache.get(b"c")[0] == 3
    cache.put(b"a", vec(4))  # replacing refreshes too
    cache.put(b"d", vec(5))
    assert cache.get(b"c") is None and cache.get(b"a")[0] == 4 and len(cache) == 2


def test_feature_cache_stores_a_read_only_float32_copy():
    cache = FeatureCache(4)
    batch = np.ones((2, FEATURE_DIM), np.float64)
    cache.put(b"k", batch[0])
    batch[0] = 7  # the batch array is reused: the cache must not see it
    got = cache.get(b"k")
    assert got.dtype == np.float32 and (got == 1).all() and not got.flags.writeable


@pytest.mark.parametrize("size", [0, -1])
def test_feature_cache_of_size_zero_keeps_nothing(size):
    cache = FeatureCache(size)
    cache.put(b"k", vec(1))
    assert cache.get(b"k") is None and len(cache) == 0


# -- score ----------------------------------------------------------------------------------------


class CountingHead:
    """A real head's arithmetic, counting calls (score must apply each head once per batch)."""

    def __init__(self, head: Head, *, fail: bool = False) -> None:
        self.head, self.fail, self.calls = head, fail, []
        self.bot_id, self.version, self.labels = head.bot_id, head.version, head.labels

    def probabilities(self, features):
        self.calls.append(len(features))
        if self.fail:
            raise RuntimeError(f"head {self.bot_id} is broken")
        return self.head.probabilities(features)


def head(bot_id: str, seed: int, n: int, version: int = 1, **kwargs) -> CountingHead:
    w, b, labels = random_head(seed, n)
    return CountingHead(Head(bot_id, version, tuple(labels), w, b), **kwargs)


def item(heads, top_k=2) -> Item:
    return Item(None, None, b"", tuple(heads), top_k)


def test_score_applies_each_head_once_to_the_rows_that_asked_for_it():
    a, b = head("a", 1, 3), head("b", 2, 5, version=4)
    features = np.random.default_rng(0).standard_normal((3, FEATURE_DIM)).astype(np.float32)
    items = [item([a]), item([b, a], top_k=3), item([b], top_k=9)]
    results = score(features, items)
    assert a.calls == [2] and b.calls == [2]
    assert [[(p.bot_id, p.version) for p in r] for r in results] == [
        [("a", 1)], [("b", 4), ("a", 1)], [("b", 4)]]
    for r, row, heads_, k in [(results[0], 0, [a], 2), (results[1], 1, [b, a], 3),
                              (results[2], 2, [b], 9)]:
        for prediction, h in zip(r, heads_):
            want = h.head.top_k(features[row:row + 1], k)[0]
            assert [label for label, _ in prediction.labels_scores] == [w[0] for w in want]
            np.testing.assert_allclose([s for _, s in prediction.labels_scores],
                                       [w[1] for w in want], rtol=1e-5)
            np.testing.assert_allclose(prediction.probabilities,
                                       h.head.probabilities(features[row:row + 1])[0], rtol=1e-5)
            assert not prediction.probabilities.flags.writeable


def test_a_failing_head_fails_only_its_own_rows():
    good, bad = head("good", 1, 3), head("bad", 2, 3, fail=True)
    features = np.zeros((3, FEATURE_DIM), np.float32)
    results = score(features, [item([good]), item([bad]), item([good, bad])])
    assert [p.bot_id for p in results[0]] == ["good"]
    for failed in results[1:]:
        assert isinstance(failed, RuntimeError) and str(failed) == "head bad is broken"
    assert good.calls == [2] and bad.calls == [2]


# -- Engine around a fake trunk ---------------------------------------------------------------------


class FakeTrunk:
    """Features = a fixed projection of the pixels; records every batch it is given."""

    checkpoint_prefix, device = "fake", "/cpu:0"

    def __init__(self) -> None:
        self.batches: list[int] = []

    def features(self, images):
        self.batches.append(len(images))
        flat = images.reshape(len(images), -1)
        return np.stack([np.resize(row[:4096], FEATURE_DIM) for row in flat]).astype(np.float32)


@pytest.fixture
def engine(tmp_path):
    settings = Settings(store=str(tmp_path / "store"), max_wait_ms=0.0, max_images_per_request=3,
                        feature_cache_size=8)
    e = Engine(FakeTrunk(), settings, Metrics())
    yield e
    e.decode_pool.shutdown(wait=True)


def test_run_batch_sends_only_uncached_rows_to_the_trunk_and_caches_them(engine):
    a = head("a", 1, 3)
    image = np.zeros(INPUT.shape, np.float32)
    image[0, 0, 0] = 0.5
    cached = Item(None, vec(0.25), b"cached", (a,), 2)
    fresh = Item(image, None, b"fresh", (a,), 2)
    rows = [Row(p, "a", None, 0.0) for p in (cached, fresh, cached)]
    results = engine.run_batch(rows)
    assert engine.trunk.batches == [1]  # one trunk call, for the one uncached row
    fresh_features = engine.trunk.features(image[None])[0]
    np.testing.assert_array_equal(engine.cache.get(b"fresh"), fresh_features)
    want = [a.head.top_k(f[None], 2)[0] for f in (vec(0.25), fresh_features, vec(0.25))]
    assert [[lbl for lbl, _ in r[0].labels_scores] for r in results] == [
        [lbl for lbl, _ in w] for w in want]
    assert a.calls == [3]  # the head once, over cached and computed rows alike


def test_run_batch_of_cached_rows_only_never_calls_the_trunk(engine):
    a = head("a", 1, 3)
    results = engine.run_batch([Row(Item(None, vec(1), b"k", (a,), 1), "a", None, 0.0)])
    assert engine.trunk.batches == [] and len(results) == 1


async def test_classify_decodes_caches_and_skips_the_trunk_on_a_repeat(engine):
    a = head("a", 1, 3)
    png = [encode(pattern(i, size=(40, 30))) for i in range(2)]
    first = await engine.classify(png, [a], top_k=2)
    assert engine.trunk.batches == [2] and len(engine.cache) == 2
    again = await engine.classify(png[::-1], [a], top_k=2)
    assert engine.trunk.batches == [2]  # all cached: no trunk
    assert [r[0].labels_scores for r in again] == [r[0].labels_scores for r in first[::-1]]
    mixed = await engine.classify([png[0], encode(pattern(7, size=(40, 30)))], [a], top_k=2)
    assert engine.trunk.batches == [2, 1]  # only the new image reached the trunk
    assert mixed[0][0].labels_scores == first[0][0].labels_scores
    await engine.batcher.close()


@pytest.mark.parametrize("arrays, error, message", [
    (np.zeros((1, 10, 10, 3), np.float32), BadRequest, "preprocessed images must have shape"),
    (np.full((1, *INPUT.shape), 1.5, np.float32), BadRequest, "values in [1.5, 1.5]"),
    (np.full((1, *INPUT.shape), np.nan, np.float32), BadRequest, "no finite value and NaN/Inf"),
    (np.zeros((0, *INPUT.shape), np.float32), BadRequest, "no image in the request"),
    (np.zeros((4, *INPUT.shape), np.float32), PayloadTooLarge, "more than 3 images in one request"),
])
async def test_classify_arrays_refuses_bad_input_before_any_work(engine, arrays, error, message):
    with pytest.raises(error) as info:
        await engine.classify_arrays(arrays, [head("a", 1, 3)], top_k=1)
    assert message in str(info.value)
    assert engine.trunk.batches == [] and engine.batcher.queue_depth == 0


async def test_classify_arrays_within_the_slack_are_scored_and_cached(engine):
    a = head("a", 1, 3)
    arrays = np.zeros((2, *INPUT.shape), np.float32)
    arrays[0, 0, 0, 0], arrays[1, 0, 0, 0] = 1.0005, -1.0005  # inside the rounding slack
    out = await engine.classify_arrays(arrays, [a], top_k=1)
    assert len(out) == 2 and engine.trunk.batches == [2]
    await engine.classify_arrays(arrays, [a], top_k=1)
    assert engine.trunk.batches == [2]
    await asyncio.wait_for(engine.batcher.close(), 5)
