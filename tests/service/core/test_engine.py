"""`Engine`, the feature cache and `score` around fakes (no TensorFlow): which rows reach the
trunk and which heads score which rows, admission (rows queued plus rows being decoded never
exceed max_queue_rows) and the `incoming` hint, the exact messages of refused input, what reaches
the metrics, which threads do the work, the per-bot batch groups, and shutdown. The real trunk's
end-to-end behaviour is tested over HTTP in test_app.py.

The fakes: a trunk (tests/support/fakes.py) that can be held at a gate, heads that record what
they are given, a `perf_counter` that moves only when told, and (where decoding must block) a
`preprocess` stand-in."""
from __future__ import annotations

import asyncio
import threading
import time
import types

import numpy as np
import pytest
from PIL import Image

import service.core.engine as engine_module
from backbone.errors import ImageTooLarge, InvalidImage
from backbone.spec import FEATURE_DIM, INPUT
from heads import Head
from service.core.engine import Engine, FeatureCache, Images, Item, cache_key, score
from service.core.errors import (
    BadRequest,
    DeadlineExceeded,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    ShuttingDown,
    error_status,
)
from service.core.metrics import Metrics
from service.core.quota import Quotas
from service.core.rows import Row
from service.core.settings import Settings
from tests.backbone.helpers import encode, pattern, png_header
from tests.support.builders import random_head
from tests.support.fakes import FakeClock, FakeTrunk, GatedTrunk
from tests.support.polling import until

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0  # a bound no passing test comes near; only a broken engine makes a test wait it out


class RecordingHead:
    """A real head's arithmetic; records the number of rows, the dtype of the features and the
    thread of each call, can fail, and advances `clock` by `run_s` per call."""

    def __init__(self, bot_id: str, seed: int = 1, n: int = 3, *, version: int = 1,
                 fail: bool = False, clock: FakeClock | None = None, run_s: float = 0.0) -> None:
        w, b, labels = random_head(n, seed=seed)
        self.head = Head(bot_id, version, tuple(labels), w, b)
        self.bot_id, self.version, self.labels = bot_id, version, self.head.labels
        self.fail, self.clock, self.run_s = fail, clock, run_s
        self.calls: list[int] = []
        self.dtypes: list[np.dtype] = []
        self.threads: list[str] = []

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        self.calls.append(len(features))
        self.dtypes.append(features.dtype)
        self.threads.append(threading.current_thread().name)
        if self.clock is not None:
            self.clock.advance(self.run_s)
        if self.fail:
            raise RuntimeError(f"head {self.bot_id} is broken")
        return self.head.probabilities(features)


class BlockingDecode:
    """`preprocess` stand-in: inputs starting with b"slow" block until `release` is set, those
    starting with b"bad" are invalid; every other input becomes a blank preprocessed image. Records what it was given, in order."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[bytes] = []
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, data: bytes, *, max_pixels: int) -> np.ndarray:
        with self._lock:
            self.calls.append(data)
            self.threads.append(threading.current_thread().name)
        if data.startswith(b"slow"):
            assert self.release.wait(WAIT_S), "the test never released the decoding"
        if data.startswith(b"bad"):
            raise InvalidImage("not a recognised image format")
        return np.zeros(INPUT.shape, np.float32)


@pytest.fixture
def ticks(monkeypatch) -> FakeClock:
    """The engine's `time.perf_counter`, moving only when told."""
    clock = FakeClock(now=100.0)
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=clock,
                                                                   monotonic=time.monotonic))
    return clock


@pytest.fixture
def blocking_decode(monkeypatch) -> BlockingDecode:
    decode = BlockingDecode()
    monkeypatch.setattr(engine_module, "preprocess", decode)
    yield decode
    decode.release.set()


@pytest.fixture
async def make_engine(tmp_path):
    """`make_engine(trunk=None, **settings) -> Engine`; every engine is opened up and closed at
    teardown."""
    made: list[Engine] = []

    def make(trunk=None, batch_seconds=None, **overrides) -> Engine:
        values = dict(store=str(tmp_path / "store"), max_wait_ms=0.0, feature_cache_size=16)
        values.update(overrides)
        e = Engine(trunk or GatedTrunk(FakeTrunk(), open=True, wait_s=WAIT_S), Settings(**values),
                   Metrics(), batch_seconds=batch_seconds)
        made.append(e)
        return e

    yield make
    for e in made:
        e.trunk.gate.set()
        await asyncio.wait_for(e.close(), WAIT_S)


def vec(value: float) -> np.ndarray:
    return np.full(FEATURE_DIM, value, np.float32)


def spawn(coro) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(coro)


def sample(engine: Engine, name: str, **labels: str) -> float:
    value = engine.metrics.registry.get_sample_value(f"multihead_{name}", labels)
    return 0.0 if value is None else value


def pngs(n: int, start: int = 0) -> list[bytes]:
    return [encode(pattern(i, size=(40, 30))) for i in range(start, start + n)]


def blank(n: int = 1, dtype=np.float32) -> np.ndarray:
    return np.zeros((n, *INPUT.shape), dtype)


def item(heads, top_k: int = 2) -> Item:
    return Item(None, None, b"", tuple(heads), top_k)


# -- Images, FeatureCache -------------------------------------------------------------------------


def test_images_count_whichever_form_they_come_in():
    assert len(Images(encoded=[b"a", b"b"])) == 2
    assert len(Images(arrays=np.zeros((3, 1, 1, 3), np.float32))) == 3
    assert len(Images()) == 0


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


def test_a_feature_cache_of_one_entry_keeps_the_latest():
    cache = FeatureCache(1)
    cache.put(b"a", np.full(FEATURE_DIM, 1, np.float32))
    cache.put(b"b", np.full(FEATURE_DIM, 2, np.float32))
    assert cache.get(b"a") is None and cache.get(b"b")[0] == 2 and len(cache) == 1


# -- score ----------------------------------------------------------------------------------------


def test_score_applies_each_head_once_to_the_rows_that_asked_for_it():
    a, b = RecordingHead("a", 1, 3), RecordingHead("b", 2, 5, version=4)
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
    good, bad = RecordingHead("good", 1, 3), RecordingHead("bad", 2, 3, fail=True)
    features = np.zeros((3, FEATURE_DIM), np.float32)
    results = score(features, [item([good]), item([bad]), item([good, bad])])
    assert [p.bot_id for p in results[0]] == ["good"]
    for failed in results[1:]:
        assert isinstance(failed, RuntimeError) and str(failed) == "head bad is broken"
    assert good.calls == [2] and bad.calls == [2]


def test_a_failing_head_leaves_every_other_head_and_row_scored():
    # The failing head is the first one met and its rows come first: the rest still runs.
    bad, good = RecordingHead("bad", 2, fail=True), RecordingHead("good", 1)
    features = np.random.default_rng(0).standard_normal((3, FEATURE_DIM)).astype(np.float32)
    results = score(features, [item([bad, good]), item([bad]), item([good], top_k=3)])
    assert len(results) == 3
    assert all(isinstance(r, RuntimeError) and str(r) == "head bad is broken"
               for r in results[:2])
    (prediction,) = results[2]
    assert prediction.bot_id == "good"
    want = good.head.top_k(features[2:3], 3)[0]
    assert [label for label, _ in prediction.labels_scores] == [label for label, _ in want]
    assert [s for _, s in prediction.labels_scores] == pytest.approx([s for _, s in want], rel=1e-5)
    assert good.dtypes == [np.float32] and bad.dtypes == [np.float32]


# -- Engine: which rows reach the trunk, the cache ------------------------------------------------


async def test_run_batch_sends_only_uncached_rows_to_the_trunk_and_caches_them(make_engine):
    engine = make_engine(feature_cache_size=8)
    a = RecordingHead("a", 1, 3)
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


async def test_a_row_whose_deadline_passed_before_the_trunk_started_is_not_run(make_engine):
    engine = make_engine(feature_cache_size=0)
    a = RecordingHead("a", 1, 3)
    image = np.zeros(INPUT.shape, np.float32)
    now = time.monotonic()
    rows = [Row(Item(image, None, b"x", (a,), 2), "a", deadline, 0.0)
            for deadline in (None, now - 0.001, now + 60.0)]
    results = engine.run_batch(rows)
    assert engine.trunk.batches == [2]  # the expired row's image never reached the trunk
    assert isinstance(results[1], DeadlineExceeded)
    assert str(results[1]) == "the request's deadline passed while it waited for the trunk"
    assert [[p.bot_id for p in r] for r in (results[0], results[2])] == [["a"], ["a"]]
    assert a.calls == [2]
    assert engine.run_batch(rows[1:2]) and engine.trunk.batches == [2]  # none left: no call


async def test_a_row_whose_deadline_passes_as_the_trunk_is_called_is_run_and_counted(
        make_engine, monkeypatch):
    """Past the drop (the deadline still ahead) but past its deadline by the trunk's call: the
    row is run and answered, and counted per tenant in multihead_tenant_rows_run_expired_total
    (the bench's deadlines_expired target)."""
    engine = make_engine(feature_cache_size=0)
    a = RecordingHead("a", 1, 3)
    reads = iter([10.0, 12.0])  # the drop's clock, then the trunk call's
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
        perf_counter=time.perf_counter, monotonic=lambda: next(reads)))
    image = np.zeros(INPUT.shape, np.float32)
    results = engine.run_batch([Row(Item(image, None, b"x", (a,), 2), "a", 11.0, 0.0, "t1"),
                                Row(Item(image, None, b"y", (a,), 2), "a", 13.0, 0.0, "t2")])
    assert engine.trunk.batches == [2] and [len(r) for r in results] == [1, 1]

    def expired(tenant: str) -> float | None:
        return engine.metrics.registry.get_sample_value(
            "multihead_tenant_rows_run_expired_total", {"tenant": tenant})

    assert (expired("t1"), expired("t2")) == (1.0, None)


async def test_a_deadline_passing_while_the_trunk_waits_for_a_decode_drops_the_row(make_engine):
    """A CPU trunk waits for the decodes running as it starts (`Cores.trunk`): a row whose
    deadline passes meanwhile is failed, not run, and the batch's other rows are."""
    engine = make_engine(GatedTrunk(FakeTrunk(), open=True, wait_s=WAIT_S, owns_cores=True),
                         feature_cache_size=0)
    assert engine.cores.exclusive
    a = RecordingHead("a", 1, 3)
    image = np.zeros(INPUT.shape, np.float32)
    decoding, done = threading.Event(), threading.Event()

    def decode() -> None:
        with engine.cores.decode():
            decoding.set()
            done.wait(WAIT_S)

    threading.Thread(target=decode, daemon=True).start()
    assert decoding.wait(WAIT_S)
    rows = [Row(Item(image, None, b"x", (a,), 2), "a", deadline, 0.0)
            for deadline in (time.monotonic() + 0.05, None)]
    threading.Timer(0.1, done.set).start()  # the decode ends after the first row's deadline
    results = engine.run_batch(rows)
    assert isinstance(results[0], DeadlineExceeded)
    assert engine.trunk.batches == [1] and [p.bot_id for p in results[1]] == ["a"]


async def test_run_batch_of_cached_rows_only_never_calls_the_trunk(make_engine):
    engine = make_engine(feature_cache_size=8)
    a = RecordingHead("a", 1, 3)
    results = engine.run_batch([Row(Item(None, vec(1), b"k", (a,), 1), "a", None, 0.0)])
    assert engine.trunk.batches == [] and len(results) == 1


async def test_classify_decodes_caches_and_skips_the_trunk_on_a_repeat(make_engine):
    engine = make_engine(feature_cache_size=8)
    a = RecordingHead("a", 1, 3)
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


@pytest.mark.parametrize("scope", ["tenant", "shared"])
@pytest.mark.parametrize("arrays", [False, True], ids=["encoded", "preprocessed"])
async def test_the_feature_cache_is_per_tenant_unless_shared(make_engine, scope, arrays):
    """By default one tenant never hits an image another sent (the hit would tell it: a hit
    is faster and shows in Server-Timing); the tenant's own repeat hits. Shared: B hits A's."""
    engine = make_engine(feature_cache_size=8, **({} if scope == "tenant" else
                                                  {"feature_cache_scope": scope}))
    a = RecordingHead("a", 1, 3)
    image = blank() if arrays else pngs(1)
    classify = engine.classify_arrays if arrays else engine.classify

    async def send(tenant: str) -> tuple[float, float, list[int]]:
        hits, misses = sample(engine, "feature_cache_hits_total"), sample(
            engine, "feature_cache_misses_total")
        await classify(image, [a], top_k=1, tenant=tenant)
        return (sample(engine, "feature_cache_hits_total") - hits,
                sample(engine, "feature_cache_misses_total") - misses, list(engine.trunk.batches))

    assert await send("acme") == (0, 1, [1])
    assert await send("acme") == (1, 0, [1])  # its own repeat: a hit, no trunk
    if scope == "tenant":
        assert await send("globex") == (0, 1, [1, 1])  # another tenant: a miss, the trunk runs
        assert await send("globex") == (1, 0, [1, 1])
    else:
        assert await send("globex") == (1, 0, [1])


def test_cache_keys_differ_by_tenant_and_not_when_shared():
    digest = bytes(20)
    assert cache_key(digest, "acme", "shared") == cache_key(digest, "globex", "shared") == digest
    keys = {cache_key(digest, t, "tenant") for t in ("acme", "globex", "default", "x" * 64)}
    assert len(keys) == 4 and digest not in keys
    assert cache_key(digest, "acme", "tenant") == cache_key(digest, "acme", "tenant")


@pytest.mark.parametrize("arrays, error, message", [
    (np.zeros((1, 10, 10, 3), np.float32), BadRequest, "preprocessed images must have shape"),
    (np.full((1, *INPUT.shape), 1.5, np.float32), BadRequest, "values in [1.5, 1.5]"),
    (np.full((1, *INPUT.shape), np.nan, np.float32), BadRequest, "no finite value and NaN/Inf"),
    (np.zeros((0, *INPUT.shape), np.float32), BadRequest, "no image in the request"),
    (np.zeros((4, *INPUT.shape), np.float32), PayloadTooLarge, "more than 3 images in one request"),
])
async def test_classify_arrays_refuses_bad_input_before_any_work(make_engine, arrays, error,
                                                                 message):
    engine = make_engine(max_images_per_request=3, feature_cache_size=8)
    with pytest.raises(error) as info:
        await engine.classify_arrays(arrays, [RecordingHead("a", 1, 3)], top_k=1)
    assert message in str(info.value)
    assert engine.trunk.batches == [] and engine.batcher.queue_depth == 0


async def test_classify_arrays_within_the_slack_are_scored_and_cached(make_engine):
    engine = make_engine(feature_cache_size=8)
    a = RecordingHead("a", 1, 3)
    arrays = np.zeros((2, *INPUT.shape), np.float32)
    arrays[0, 0, 0, 0], arrays[1, 0, 0, 0] = 1.0005, -1.0005  # inside the rounding slack
    out = await engine.classify_arrays(arrays, [a], top_k=1)
    assert len(out) == 2 and engine.trunk.batches == [2]
    await engine.classify_arrays(arrays, [a], top_k=1)
    assert engine.trunk.batches == [2]
    await asyncio.wait_for(engine.batcher.close(), 5)


# -- admission and the incoming hint ---------------------------------------------------------------


async def test_a_request_alone_is_not_held_for_max_wait_ms(make_engine):
    # Nobody else is decoding: waiting out max_wait_ms (a minute here) would only add latency.
    e = make_engine(max_wait_ms=60_000.0)
    out = await asyncio.wait_for(e.classify(pngs(2), [RecordingHead("a")], top_k=1), WAIT_S)
    assert len(out) == 2 and e.trunk.batches == [2]


async def test_admission_counts_rows_being_decoded_and_rows_queued(make_engine, blocking_decode):
    e = make_engine(max_queue_rows=4, max_images_per_request=4, max_wait_ms=60_000.0,
                    preprocess_threads=4)
    a = RecordingHead("a")
    decoding = spawn(e.classify([b"slow-1", b"slow-2", b"slow-3"], [a], top_k=1))
    await until(lambda: len(blocking_decode.calls) == 3)
    with pytest.raises(Overloaded):  # 4 rows - 3 being decoded: no room for 2
        await asyncio.wait_for(e.classify([b"fast-1", b"fast-2"], [a], top_k=1), WAIT_S)
    fits = spawn(e.classify([b"fast-3"], [a], top_k=1))  # room for exactly one
    await until(lambda: e.batcher.queue_depth == 1)
    assert sample(e, "queue_depth") == 1
    with pytest.raises(Overloaded):  # 4 rows - 3 being decoded - 1 queued
        await asyncio.wait_for(e.classify([b"fast-4"], [a], top_k=1), WAIT_S)
    await asyncio.sleep(0.05)  # a real wait: the queued row must still wait for the others
    assert not fits.done()
    blocking_decode.release.set()
    results = await asyncio.wait_for(asyncio.gather(decoding, fits), WAIT_S)
    assert [len(r) for r in results] == [3, 1]
    assert e.trunk.batches == [4]  # the rows decoded meanwhile shared the queued row's batch
    assert sorted(blocking_decode.calls) == [b"fast-3", b"slow-1", b"slow-2", b"slow-3"]
    assert sample(e, "queue_depth") == 0


async def test_at_most_preprocess_threads_images_are_decoded_at_once(make_engine,
                                                                     blocking_decode):
    e = make_engine(preprocess_threads=2)
    task = spawn(e.classify([b"slow-1", b"slow-2", b"slow-3"], [RecordingHead("a")], top_k=1))
    await until(lambda: len(blocking_decode.calls) == 2)
    await asyncio.sleep(0.05)  # a real wait: a third decoding thread would start meanwhile
    assert len(blocking_decode.calls) == 2
    blocking_decode.release.set()
    assert len(await asyncio.wait_for(task, WAIT_S)) == 3
    assert set(blocking_decode.threads) == {"multihead-decode_0", "multihead-decode_1"}


async def test_after_close_a_request_is_refused_before_anything_is_decoded(make_engine,
                                                                           blocking_decode):
    e = make_engine()
    await e.batcher.close()
    for call in (e.classify([b"fast-1"], [RecordingHead("a")], top_k=1),
                 e.classify_arrays(blank(), [RecordingHead("a")], top_k=1)):
        with pytest.raises(ShuttingDown) as info:
            await call
        assert str(info.value) == "the service is shutting down and accepts no new requests"
    assert blocking_decode.calls == [] and sample(e, "feature_cache_misses_total") == 0


# -- limits and messages --------------------------------------------------------------------------


async def test_the_image_count_limit_is_inclusive_and_named(make_engine):
    e = make_engine(max_images_per_request=3)
    a = RecordingHead("a")
    assert len(await e.classify(pngs(3), [a], top_k=1)) == 3
    with pytest.raises(PayloadTooLarge) as info:
        await e.classify(pngs(4), [a], top_k=1)
    assert str(info.value) == "more than 3 images in one request"
    with pytest.raises(BadRequest) as info:
        await e.classify([], [a], top_k=1)
    assert str(info.value) == "no image in the request"


async def test_the_pixel_limit_reaches_the_decoder(make_engine):
    e = make_engine(max_image_pixels=40 * 30)
    a = RecordingHead("a")
    assert len(await e.classify([encode(pattern(1, size=(40, 30)))], [a], top_k=1)) == 1
    with pytest.raises(ImageTooLarge):
        await e.classify([encode(pattern(2, size=(41, 30)))], [a], top_k=1)


def _with(value: float, *more: float) -> np.ndarray:
    arrays = blank()
    for i, v in enumerate((value, *more)):
        arrays[0, 0, i, 0] = v
    return arrays


@pytest.mark.parametrize("arrays, message", [
    (np.zeros((1, 10, 10, 3), np.float32),
     "preprocessed images must have shape [N, 299, 299, 3], got [1, 10, 10, 3]"),
    (np.zeros(INPUT.shape, np.float32),
     "preprocessed images must have shape [N, 299, 299, 3], got [299, 299, 3]"),
    (np.full((1, *INPUT.shape), 1.5, np.float32),
     f"a preprocessed image must be {INPUT.describe()}; got values in [1.5, 1.5]"),
    (_with(2.0, np.nan), f"a preprocessed image must be {INPUT.describe()}; got values in "
                         "[0, 2] and NaN/Inf"),
    (np.full((1, *INPUT.shape), np.inf, np.float32),
     f"a preprocessed image must be {INPUT.describe()}; got no finite value and NaN/Inf"),
], ids=["shape", "rank", "range", "range-and-nan", "inf"])
async def test_refused_arrays_name_the_expected_form_and_what_was_seen(make_engine, arrays,
                                                                       message):
    e = make_engine()
    with pytest.raises(BadRequest) as info:
        await e.classify_arrays(arrays, [RecordingHead("a")], top_k=1)
    assert str(info.value) == message
    assert e.trunk.batches == []


# The rounding slack is 1e-3 either side of [-1, 1]: its edge is in, the next float32 is out.
EDGE = np.float32(1.001)


@pytest.mark.parametrize("value, accepted", [
    (1.0, True), (-1.0, True), (EDGE, True), (-EDGE, True),
    (np.nextafter(EDGE, np.float32(2)), False), (-np.nextafter(EDGE, np.float32(2)), False),
])
async def test_the_value_range_slack_is_inclusive(make_engine, value, accepted):
    e = make_engine()
    call = e.classify_arrays(_with(value), [RecordingHead("a")], top_k=1)
    if accepted:
        assert len(await call) == 1
    else:
        with pytest.raises(BadRequest):
            await call


async def test_arrays_reach_the_trunk_and_the_cache_as_float32(make_engine):
    e = make_engine()
    a = RecordingHead("a")
    arrays = _with(0.25).astype(np.float64)
    first = await e.classify_arrays(arrays, [a], top_k=1)
    assert e.trunk.dtypes == [np.float32]
    for _ in range(2):
        again = await e.classify_arrays(arrays.astype(np.float32), [a], top_k=1)
        assert again == first
    assert e.trunk.batches == [1]  # the same image: its features were cached
    assert (sample(e, "feature_cache_misses_total"), sample(e, "feature_cache_hits_total")) == (
        1, 2)
    await e.classify_arrays(_with(0.5), [a], top_k=1)  # another image: another cache entry
    assert e.trunk.batches == [1, 1] and sample(e, "feature_cache_misses_total") == 2


async def test_an_array_and_encoded_bytes_never_share_a_cache_entry(make_engine):
    # The same bytes as an array and as an upload: the upload must be decoded (and refused),
    # never answered from the array's cached features.
    e = make_engine()
    arrays = blank()
    await e.classify_arrays(arrays, [RecordingHead("a")], top_k=1)
    with pytest.raises(InvalidImage):
        await e.classify([arrays[0].tobytes()], [RecordingHead("a")], top_k=1)


async def test_a_request_whose_deadline_passed_is_refused(make_engine):
    e = make_engine()
    a = RecordingHead("a")
    with pytest.raises(DeadlineExceeded):
        await e.classify(pngs(1), [a], top_k=1, deadline=time.monotonic() - 1)
    with pytest.raises(DeadlineExceeded):
        await e.classify_arrays(blank(), [a], top_k=1, deadline=time.monotonic() - 1)
    assert e.trunk.batches == []


async def test_a_deadline_its_rows_cannot_meet_is_refused_before_any_decode(make_engine):
    """With a batch profile: a request whose rows would be answered after its deadline (in
    batches of the batcher's size at the profile's times, plus the answer's margin) is refused
    at once, 504 deadline_unmeetable, nothing decoded, queued or charged; one with the time is
    served; without a profile nothing is refused early."""
    from service.core.errors import DeadlineUnmeetable
    from service.core.quota import Quotas
    from service.core.schedule import ANSWER_S

    e = make_engine(max_batch_size=2, batch_seconds=lambda n: 0.2 * n)  # 200 ms an image
    e.quotas = Quotas(lambda tenant: (1.0, 10))
    due = e.batcher.expected_at("t", 3)
    assert due.due - time.monotonic() == pytest.approx(0.4 + 0.2 + ANSWER_S, abs=0.05)
    assert due.alone == due.due  # nothing ahead
    assert due.slack == 1.0  # nothing learnt yet
    decoded = []
    decode = e._decode  # noqa: SLF001 - counted
    e._decode = lambda data, *check: decoded.append(data) or decode(data, *check)  # noqa: SLF001
    a = RecordingHead("a")
    with pytest.raises(DeadlineUnmeetable) as refused:
        await e.classify(pngs(3), [a], top_k=1, tenant="t", deadline=time.monotonic() + 0.55)
    assert error_status(refused.value)[:2] == (504, "deadline_unmeetable")
    assert decoded == [] and e.trunk.batches == [] and e.quotas.tokens("t") == 10
    await e.classify(pngs(3), [a], top_k=1, tenant="t", deadline=time.monotonic() + 5)
    assert len(decoded) == 3 and e.quotas.tokens("t") < 10
    plain = make_engine(max_batch_size=2)  # without a profile: no estimate
    assert plain.batcher.expected_at("t", 3) is None
    await plain.classify(pngs(3, start=9), [a], top_k=1, tenant="t",
                         deadline=time.monotonic() + 0.05)


async def test_a_tenant_refused_for_its_slack_is_still_admitted_with_nothing_ahead(make_engine):
    """A tenant whose rows waited 7 x longer than expected (a burst's rows put before them,
    say) has its requests with rows queued ahead refused; one with nothing ahead of it is
    admitted when its time alone meets its deadline, and is learnt from (before, the whole estimate times
    the slack refused every request of the tenant for good: nothing admitted, nothing
    learnt, the slack never lower)."""
    from service.core.errors import DeadlineUnmeetable
    from service.core.rows import Row
    from service.core.schedule import ANSWER_S, SLACK_MIN

    e = make_engine(max_batch_size=2, batch_seconds=lambda n: 0.05 * n)  # 50 ms an image
    now = time.monotonic()
    plan = e.batcher.deadlines
    plan.seconds = lambda n: 0.05 * n  # at the profile's times, whatever the fake trunk's
    plan.ran([Row(None, "g", now + 0.2, now, "t", 1.0, (now, now + 0.05))] * SLACK_MIN,
             now + 0.35)
    assert plan.slack("t", now) == pytest.approx((0.35 + ANSWER_S) / 0.05)
    a = RecordingHead("a")
    for i in range(SLACK_MIN):  # 3 x its time alone (55 ms): admitted, and learnt from
        await e.classify(pngs(1, start=40 + i), [a], top_k=1, tenant="t",
                         deadline=time.monotonic() + 0.165)
    learnt = [r for _, r in plan._learnt["t"].ratios]  # noqa: SLF001 - what was learnt
    assert len(learnt) == 2 * SLACK_MIN and max(learnt[SLACK_MIN:]) < 1
    plan.ran([Row(None, "g", now + 0.2, now, "t", 1.0, (now, now + 0.05))] * SLACK_MIN,
             now + 0.35)  # late again: more than 5 % of what was learnt
    e.trunk.gate.clear()  # the trunk holds a batch, and 2 rows wait behind it
    e.trunk.entered.clear()
    held = spawn(e.classify(pngs(1, start=60), [a], top_k=1, tenant="t"))
    await until(lambda: e.trunk.entered.is_set())
    queued = spawn(e.classify(pngs(2, start=62), [a], top_k=1, tenant="t"))
    await until(lambda: e.batcher.tenant_state().get("t", (0,))[0] == 2)
    # 205 ms expected (the batch running, the 2 queued, its own) would meet 250 ms; the 100
    # ms of the 2 queued, times the slack, do not.
    with pytest.raises(DeadlineUnmeetable):
        await e.classify(pngs(1, start=70), [a], top_k=1, tenant="t",
                         deadline=time.monotonic() + 0.25)
    e.trunk.gate.set()
    await asyncio.gather(held, queued)


async def test_the_running_batch_and_the_rows_taken_first_count_toward_a_deadline(make_engine):
    """The trunk holds a batch of 2 of tenant t (400 ms at the profile) with 4 more of t's
    rows queued: a new row of t waits for the rest of the running batch, then t's 4 rows and
    itself (batches of 2, 2, 1); a row of tenant u is taken first by the fair order (u is
    lifted to t's counter and was served least recently): only the running batch, then its
    own."""
    from service.core.schedule import ANSWER_S

    e = make_engine(max_batch_size=2, batch_seconds=lambda n: 0.2 * n)
    e.trunk.gate.clear()  # the trunk holds its first batch: the rows behind it wait
    first = spawn(e.classify(pngs(2, start=20), [RecordingHead("a")], top_k=1, tenant="t"))
    queued = spawn(e.classify(pngs(4, start=30), [RecordingHead("a")], top_k=1, tenant="t"))
    await until(lambda: e.batcher.tenant_state().get("t", (0,))[0] == 4)

    def expected_s(tenant: str) -> float:
        return e.batcher.expected_at(tenant, 1).due - time.monotonic()

    assert expected_s("t") == pytest.approx(0.4 + 2 * 0.4 + 0.2 + ANSWER_S, abs=0.05)
    assert expected_s("u") == pytest.approx(0.4 + 0.2 + ANSWER_S, abs=0.05)
    e.trunk.gate.set()
    await asyncio.gather(first, queued)


# -- heads ------------------------------------------------------------------------------------------


async def test_a_failing_head_fails_the_request_whether_or_not_features_were_cached(make_engine):
    e = make_engine()
    good, bad = RecordingHead("good"), RecordingHead("bad", 2, fail=True)
    images = pngs(2)
    with pytest.raises(RuntimeError) as info:  # through the batcher
        await e.classify(images, [good, bad], top_k=1)
    assert str(info.value) == "head bad is broken"
    assert e.trunk.batches == [2]
    with pytest.raises(RuntimeError) as info:  # every feature cached: heads only
        await e.classify(images, [bad], top_k=1)
    assert str(info.value) == "head bad is broken"
    assert e.trunk.batches == [2]


async def test_heads_get_float32_features_on_the_batch_thread_or_else_the_light_thread(
        make_engine):
    e = make_engine(preprocess_threads=2)
    a = RecordingHead("a")
    images = pngs(2)
    await e.classify(images, [a], top_k=1)
    await e.classify(images, [a], top_k=1)  # all cached: no trunk, still off the event loop
    assert a.dtypes == [np.float32, np.float32]
    assert not a.threads[0].startswith("multihead-decode")
    assert a.threads[1] == "multihead-light_0"  # never behind decodes waiting for the trunk


async def test_per_group_policy_batches_each_set_of_bots_on_its_own(make_engine):
    trunk = GatedTrunk(FakeTrunk(), wait_s=WAIT_S)
    e = make_engine(trunk, batch_policy="per_group", max_batch_size=8)
    a, b = RecordingHead("a", 1), RecordingHead("b", 2)
    images = pngs(5)
    blocker = spawn(e.classify(images[:1], [a], top_k=1))
    await until(trunk.entered.is_set)
    tasks = []
    for image, heads in zip(images[1:], ([a], [b], [b, a], [a, b])):  # [a, b]: the same set
        tasks.append(spawn(e.classify([image], heads, top_k=1)))
        await until(lambda: e.batcher.queue_depth == len(tasks))  # queued in this order
    trunk.gate.set()
    await asyncio.wait_for(asyncio.gather(blocker, *tasks), WAIT_S)
    assert trunk.batches == [1, 1, 1, 2]


# -- metrics ----------------------------------------------------------------------------------------


async def test_metrics_count_the_cache_bots_batches_and_time_each_stage(make_engine, ticks):
    trunk = GatedTrunk(FakeTrunk(), open=True, clock=ticks, run_s=0.25, wait_s=WAIT_S)
    e = make_engine(trunk)
    a, b = RecordingHead("a", 1, clock=ticks, run_s=0.125), RecordingHead("b", 2)
    images = pngs(2)
    await e.classify(images, [a, b], top_k=1)
    assert (sample(e, "feature_cache_misses_total"), sample(e, "feature_cache_hits_total")) == (
        2, 0)
    assert (sample(e, "bot_requests_total", bot="a"), sample(e, "bot_requests_total", bot="b")) \
        == (2, 2)
    assert (sample(e, "batch_size_count"), sample(e, "batch_size_sum")) == (1, 2)
    assert sample(e, "batch_bots_sum") == 1  # one request: one set of bots
    assert sample(e, "trunk_seconds_sum") == 0.25
    assert (sample(e, "trunk_batches_total", batch_size="2"),
            sample(e, "trunk_batch_seconds_total", batch_size="2")) == (1, 0.25)
    assert e.metrics.trunk_in_server() == {2: (1, 0.25)}
    assert sample(e, "heads_seconds_sum") == 0.125
    assert (sample(e, "decode_seconds_count"), sample(e, "decode_seconds_sum")) == (2, 0.0)
    await e.classify(images[:1], [a], top_k=1)  # cached: no decode, no trunk, no batch
    assert (sample(e, "feature_cache_misses_total"), sample(e, "feature_cache_hits_total")) == (
        2, 1)
    assert sample(e, "bot_requests_total", bot="a") == 3
    assert (sample(e, "decode_seconds_count"), sample(e, "batch_size_count")) == (2, 1)


# -- shutdown ---------------------------------------------------------------------------------------


async def test_close_gives_up_on_requests_after_request_timeout_s_but_waits_for_the_trunk(
        make_engine):
    trunk = GatedTrunk(FakeTrunk(), wait_s=WAIT_S)
    e = make_engine(trunk, request_timeout_s=0.05)
    a = RecordingHead("a")
    images = pngs(2)
    running = spawn(e.classify(images[:1], [a], top_k=1))
    await until(trunk.entered.is_set)
    queued = spawn(e.classify(images[1:], [a], top_k=1))
    await until(lambda: e.batcher.queue_depth == 1)
    closing = spawn(e.close())
    with pytest.raises(ShuttingDown) as info:
        await asyncio.wait_for(queued, WAIT_S)
    assert str(info.value) == "the service shut down before this request ran"
    with pytest.raises(ShuttingDown) as info:  # its answer will not be waited for either
        await asyncio.wait_for(running, WAIT_S)
    assert str(info.value) == "the service shut down before this request finished"
    assert not closing.done()  # but the trunk call itself is: the session closes after it
    trunk.gate.set()
    await asyncio.wait_for(closing, WAIT_S)
    assert trunk.batches == [1]


async def test_close_waits_for_images_still_being_decoded(make_engine, blocking_decode):
    e = make_engine()
    pending = spawn(e.classify([b"slow-1"], [RecordingHead("a")], top_k=1))
    await until(lambda: blocking_decode.calls)
    closing = spawn(e.close())
    await asyncio.sleep(0.05)  # a real wait: close must still be waiting for the decode thread
    assert not closing.done()
    blocking_decode.release.set()
    await asyncio.wait_for(closing, WAIT_S)
    with pytest.raises(ShuttingDown):  # decoded after close began: never queued
        await pending


# -- owning the cores: no decode while a CPU trunk runs (service.core.cores) -------------------


@pytest.mark.parametrize("owns_cores,own_cores,exclusive", [
    (True, True, True), (True, False, False), (False, True, False)])
async def test_a_decode_waits_for_the_running_batch_only_when_the_trunk_owns_the_cores(
        make_engine, owns_cores, own_cores, exclusive):
    """A CPU trunk (`owns_cores`) with `own_cores` on runs alone: an image that arrives while
    a batch runs is decoded after it (its wait counted); off, or on a GPU, it is decoded at
    once, beside the batch."""
    trunk = GatedTrunk(FakeTrunk(), wait_s=WAIT_S, owns_cores=owns_cores)
    e = make_engine(trunk, own_cores=own_cores)
    assert e.cores.exclusive is exclusive
    a = RecordingHead("a")
    images = pngs(2)
    running = spawn(e.classify(images[:1], [a], top_k=1))
    await until(trunk.entered.is_set)
    second = spawn(e.classify(images[1:], [a], top_k=1))
    if exclusive:
        await until(lambda: e.cores.decodes_waiting == 1)
        assert sample(e, "decode_seconds_count") == 1  # only the first image was decoded
    else:
        await until(lambda: sample(e, "decode_seconds_count") == 2)  # decoded beside the batch
        assert e.cores.decodes_waiting == 0
    trunk.gate.set()
    await asyncio.wait_for(asyncio.gather(running, second), WAIT_S)
    assert (sample(e, "decode_wait_seconds_total") > 0) is exclusive
    assert trunk.batches == [1, 1]


async def test_a_cached_request_is_answered_while_decodes_wait_for_the_trunk(make_engine):
    """Digests, lookups and a fully cached request's heads run in the light pool: never
    behind the decode threads held up by the running batch."""
    trunk = GatedTrunk(FakeTrunk(), wait_s=WAIT_S, owns_cores=True)
    e = make_engine(trunk, preprocess_threads=1)
    a = RecordingHead("a")
    images = pngs(3)
    trunk.gate.set()
    await e.classify(images[:1], [a], top_k=1)  # now cached
    trunk.gate.clear()
    trunk.entered.clear()
    running = spawn(e.classify(images[1:2], [a], top_k=1))
    await until(trunk.entered.is_set)
    waiting = spawn(e.classify(images[2:], [a], top_k=1))
    await until(lambda: e.cores.decodes_waiting == 1)  # the only decode thread is held up
    (cached,) = await asyncio.wait_for(e.classify(images[:1], [a], top_k=1), WAIT_S)
    assert cached[0].bot_id == "a" and not waiting.done()
    trunk.gate.set()
    await asyncio.wait_for(asyncio.gather(running, waiting), WAIT_S)


# -- quota charges: decoded images stay charged ---------------------------------------------------


def limited(e: Engine, burst: int = 100) -> Quotas:
    """Gives `e` a quota of `burst` tokens for every tenant, on a clock that never refills it."""
    e.quotas = Quotas(lambda tenant: (1.0, burst), clock=FakeClock())
    return e.quotas


def idle(e: Engine) -> None:
    """Returns once every decode submitted so far has run (the pool has one thread)."""
    e.decode_pool.submit(lambda: None).result(WAIT_S)


async def test_images_decoded_before_a_bad_one_stay_charged(make_engine, blocking_decode):
    e = make_engine(preprocess_threads=1)
    quotas = limited(e)
    with pytest.raises(InvalidImage):
        await asyncio.wait_for(e.classify([b"fast-1", b"fast-2", b"bad"], [RecordingHead("a")],
                                          top_k=1), WAIT_S)
    assert blocking_decode.calls == [b"fast-1", b"fast-2", b"bad"]
    assert quotas.tokens("default") == 100 - 3  # three decodes ran: three tokens spent


async def test_after_a_bad_image_the_rest_are_never_decoded_nor_charged(make_engine,
                                                                          blocking_decode):
    e = make_engine(preprocess_threads=1)
    quotas = limited(e)
    images = [b"bad", b"slow-2", b"slow-3", b"slow-4", b"slow-5"]
    with pytest.raises(InvalidImage):
        await asyncio.wait_for(e.classify(images, [RecordingHead("a")], top_k=1), WAIT_S)
    blocking_decode.release.set()
    await asyncio.get_running_loop().run_in_executor(None, idle, e)
    # The one thread may have started one more before the rest were cancelled; never more.
    assert blocking_decode.calls[0] == b"bad" and len(blocking_decode.calls) <= 2
    assert quotas.tokens("default") == 100 - len(blocking_decode.calls)
    assert e.trunk.batches == []


async def test_a_request_refused_before_decoding_is_not_charged(make_engine, blocking_decode):
    e = make_engine(max_queue_rows=2, max_images_per_request=2, preprocess_threads=2)
    quotas = limited(e)
    a = RecordingHead("a")
    held = spawn(e.classify([b"slow-1", b"slow-2"], [a], top_k=1))
    await until(lambda: len(blocking_decode.calls) == 2)
    with pytest.raises(Overloaded):  # the queue is full: refused before any decoding
        await asyncio.wait_for(e.classify([b"fast-3"], [a], top_k=1), WAIT_S)
    assert quotas.tokens("default") == 100 - 2
    blocking_decode.release.set()
    assert len(await asyncio.wait_for(held, WAIT_S)) == 2
    assert quotas.tokens("default") == 100 - 2


# -- quota charges: an image costs its decode, read from its header -------------------------------


async def test_an_image_is_charged_its_decode_cost_read_from_its_header(make_engine):
    e = make_engine()
    quotas = limited(e)
    a = RecordingHead("a")
    large = encode(pattern(1, size=(1280, 960)))
    await asyncio.wait_for(e.classify([large], [a], top_k=1), WAIT_S)
    assert quotas.tokens("default") == pytest.approx(100 - 4)  # 4 x 640 x 480
    deep = encode(Image.new("I;16", (640, 480)))
    await asyncio.wait_for(e.classify([deep, *pngs(2)], [a], top_k=1), WAIT_S)
    assert quotas.tokens("default") == pytest.approx(100 - 4 - 2 - 2)  # 16 bits: twice
    await asyncio.wait_for(e.classify([large, deep], [a], top_k=1), WAIT_S)  # cache hits
    assert quotas.tokens("default") == pytest.approx(100 - 8)


async def test_a_huge_deep_png_stays_charged_its_cost_when_it_fails(make_engine):
    e = make_engine()
    quotas = limited(e)
    a = RecordingHead("a")
    huge = png_header(6000, 6000, 16, 0)  # 36 Mpx of 16-bit gray declared, no pixel data
    with pytest.raises(InvalidImage):  # a full bucket lets it pass, leaving a debt
        await asyncio.wait_for(e.classify([huge], [a], top_k=1), WAIT_S)
    assert quotas.tokens("default") == pytest.approx(100 - 6000 * 6000 * 6 / (640 * 480 * 3))
    with pytest.raises(RateLimited):
        await asyncio.wait_for(e.classify(pngs(1), [a], top_k=1), WAIT_S)


async def test_an_image_over_the_pixel_limit_costs_one_and_is_refused_as_too_large(make_engine):
    e = make_engine(max_image_pixels=1000)
    quotas = limited(e, burst=2)
    with pytest.raises(ImageTooLarge):
        await asyncio.wait_for(e.classify([png_header(6000, 6000, 16, 0)], [RecordingHead("a")],
                                          top_k=1), WAIT_S)
    assert quotas.tokens("default") == 2 - 1


async def test_decodes_are_taken_in_the_tenants_fair_order_not_first_come(make_engine,
                                                                         blocking_decode):
    e = make_engine(preprocess_threads=1)
    a = RecordingHead("a")
    acme = spawn(e.classify([b"slow-a0", b"fast-a1", b"fast-a2", b"fast-a3"], [a], top_k=1,
                            tenant="acme"))
    await until(lambda: blocking_decode.calls == [b"slow-a0"] and e.decode_pool.queued == 3)
    globex = spawn(e.classify([b"fast-g0"], [a], top_k=1, tenant="globex"))
    await until(lambda: e.decode_pool.queued == 4)
    blocking_decode.release.set()
    await asyncio.wait_for(asyncio.gather(acme, globex), WAIT_S)
    # globex's one decode waited for the one running, not for acme's three queued before it.
    assert blocking_decode.calls == [b"slow-a0", b"fast-g0", b"fast-a1", b"fast-a2", b"fast-a3"]


async def test_an_image_whose_row_is_doomed_when_its_decode_starts_is_refused_undecoded(
        make_engine):
    """Admitted (55 ms alone against 200), the request's decode waits 200 ms behind another
    (one decode thread, held): as it starts, its row could no longer be answered in time even
    in a batch of its own, which the next batch would drop. It is refused then, before its
    image is decoded (DeadlineUnmeetable, counted as such, its token given back), and learnt
    as a drop is; a request whose decode starts in time is answered."""
    from service.core.errors import DeadlineUnmeetable
    from service.core.quota import Quotas

    e = make_engine(max_batch_size=2, batch_seconds=lambda n: 0.05 * n, preprocess_threads=1)
    e.quotas = Quotas(lambda tenant: (0.001, 10))  # 10 tokens, next to no refill
    plan = e.batcher.deadlines
    plan.seconds = lambda n: 0.05 * n  # at the profile's times, whatever the fake trunk's
    a = RecordingHead("a")
    await e.classify(pngs(1, start=80), [a], top_k=1, tenant="t",
                     deadline=time.monotonic() + 0.5)  # nothing in the way: answered
    held, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        held.wait(WAIT_S)

    blocker = e.decode_pool.schedule("other", 1.0, hold)
    await until(started.is_set)
    decoded = sample(e, "decode_seconds_count")
    learnt = len(plan._learnt["t"].ratios)  # noqa: SLF001 - what was learnt
    tokens = e.quotas.tokens("t")
    assert tokens == pytest.approx(9, abs=0.01)  # the first request's image
    late = spawn(e.classify(pngs(1, start=81), [a], top_k=1, tenant="t",
                            deadline=time.monotonic() + 0.2))
    await asyncio.sleep(0.2)
    held.set()
    with pytest.raises(DeadlineUnmeetable, match="refused before any decoding"):
        await late
    await asyncio.wrap_future(blocker)
    assert sample(e, "decode_seconds_count") == decoded  # its image was never decoded
    assert e.quotas.tokens("t") == pytest.approx(tokens, abs=0.01)  # nor charged
    assert sample(e, "tenant_refusals_total", tenant="t", code="deadline_unmeetable") == 1
    ratios = plan._learnt["t"].ratios  # noqa: SLF001 - learnt as a drop: later than expected
    assert len(ratios) == learnt + 1 and ratios[-1][1] > 1
