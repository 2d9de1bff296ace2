"""The trunk's batch profile (`backbone.profile`): sizes, interpolation, the measurement (first
run discarded, median of the rest, on a fake clock) and its file next to the graph cache (kept,
loaded, measured again when it is another trunk's, corrupt or short of sizes). The trunk is the
pure-numpy fake runner (tests.backbone.helpers): no TensorFlow."""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from backbone import Device, Trunk
from backbone import profile as bp
from backbone.profile import BatchProfile, ProfileCache, measure, profile_sizes, profile_trunk
from backbone.runners.base import LoadRequest
from backbone.spec import IMAGE_SIZE
from tests.backbone.helpers import FakeRunner


class CountingTrunk:
    """A fake-runner `Trunk` that counts the batches it runs (and their sizes)."""

    def __init__(self, prefix: str):
        runner = FakeRunner(LoadRequest(prefix, Device("cpu", "/CPU:0")))
        self.trunk = Trunk(runner, checkpoint_prefix=prefix)
        self.batches: list[int] = []

    def features(self, images):
        self.batches.append(len(images))
        return self.trunk.features(images)

    def __getattr__(self, name):
        return getattr(self.trunk, name)


@pytest.fixture
def prefix(tmp_path) -> str:
    """A V1-style checkpoint file (only its path, size and time matter here)."""
    path = tmp_path / "trunk" / "demo_inception_v4.ckpt"
    path.parent.mkdir()
    path.write_bytes(b"weights")
    return str(path)


@pytest.fixture
def trunk(prefix):
    return CountingTrunk(prefix)


def test_sizes_are_powers_of_two_up_to_the_max_and_the_max():
    assert profile_sizes(1) == (1,)
    assert profile_sizes(2) == (1, 2)
    assert profile_sizes(16) == (1, 2, 4, 8, 16)
    assert profile_sizes(12) == (1, 2, 4, 8, 12)
    with pytest.raises(ValueError):
        profile_sizes(0)


def test_seconds_at_interpolates_between_measured_sizes():
    p = BatchProfile({1: 0.030, 2: 0.050, 4: 0.090, 8: 0.170})
    assert p.seconds_at(4) == pytest.approx(0.090)
    assert p.seconds_at(3) == pytest.approx(0.070)  # halfway between 2 and 4
    assert p.seconds_at(6) == pytest.approx(0.130)
    assert p.seconds_at(7) == pytest.approx(0.150)
    assert p.seconds_at(16) == pytest.approx(0.330)  # beyond: along the last segment
    assert p.images_per_s(8) == pytest.approx(8 / 0.170)
    with pytest.raises(ValueError):
        p.seconds_at(0)


def test_seconds_at_below_the_smallest_and_with_one_size():
    assert BatchProfile({2: 0.04, 4: 0.06}).seconds_at(1) == pytest.approx(0.03)
    assert BatchProfile({4: 0.08}).seconds_at(2) == pytest.approx(0.04)  # proportional
    assert BatchProfile({1: 0.05, 2: 0.01}).seconds_at(100) > 0  # never zero or negative


@pytest.mark.parametrize("seconds", [{}, {0: 0.1}, {1: 0.0}, {1: -1.0}, {1: float("nan")}])
def test_a_profile_needs_sizes_and_positive_times(seconds):
    with pytest.raises(ValueError):
        BatchProfile(seconds)


def test_measure_discards_each_sizes_first_run_and_keeps_the_median():
    """On a fake clock: each run of size n takes the next of its scripted durations; the
    first (untimed: the warm-up) is not in the median."""
    durations = {1: [9.0, 0.3, 0.1, 0.2], 2: [9.0, 0.5, 0.4, 0.9]}
    now = [0.0]
    runs: list[tuple[int, tuple]] = []

    def features(images):
        n = len(images)
        runs.append((n, images.shape[1:]))
        now[0] += durations[n].pop(0)
        return np.zeros((n, 1536), np.float32)

    p = measure(features, [2, 1, 2], repeats=3, clock=lambda: now[0])
    assert [n for n, _ in runs] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert all(shape == (IMAGE_SIZE, IMAGE_SIZE, 3) for _, shape in runs)
    assert p.seconds == {1: pytest.approx(0.2), 2: pytest.approx(0.5)}
    assert p.source == bp.MEASURED and p.repeats == 3 and p.measured_at.endswith("Z")
    assert p.took_s == pytest.approx(9.6 + 10.8)


def test_measure_runs_the_same_batch_each_time():
    seen = []
    measure(lambda images: seen.append(images.copy()), [2], repeats=2)
    assert all(np.array_equal(seen[0], s) for s in seen)
    assert seen[0].min() >= -1 and seen[0].max() <= 1 and seen[0].std() > 0.1


def test_report_is_milliseconds_by_size_with_its_source():
    p = BatchProfile({1: 0.0312345, 16: 0.5}, repeats=3, measured_at="2026-12-02T10:00:00Z",
                     took_s=2.5)
    assert p.report() == {"batch_ms": {"1": 31.234, "16": 500.0},
                          "images_per_s": {"1": 32.02, "16": 32.0}, "working_batch_size": 1,
                          "source": "measured", "measured_at": "2026-12-02T10:00:00Z",
                          "repeats": 3, "measure_s": 2.5}


@pytest.mark.parametrize(("seconds", "working"), [
    ({1: 0.0197, 2: 0.0333, 4: 0.0601, 8: 0.1108, 16: 0.2275}, 8),  # OpenVINO bf16, AMX
    ({1: 0.0290, 2: 0.0458, 4: 0.1034, 8: 0.2176, 16: 0.9439}, 2),  # TF fp32 under load
    ({1: 0.01, 2: 0.02, 4: 0.04}, 1),  # nothing gained: the shortest
    ({4: 0.04, 8: 0.0762}, 4),  # 100 vs 105.0 images/s: within 5 %
    ({4: 0.04, 8: 0.0757}, 8),  # 100 vs 105.7: not
    ({4: 0.04, 8: 0.0843}, 4),  # the longer is slower
])
def test_the_working_size_is_the_smallest_within_5_percent_of_the_best(seconds, working):
    assert BatchProfile(seconds).working_size() == working


# -- kept next to the graph cache ----------------------------------------------------------------

def test_measured_then_saved_then_loaded(trunk, tmp_path):
    cache = tmp_path / "graph_cache"
    first = profile_trunk(trunk, max_batch_size=4, cache_dir=cache, repeats=2)
    assert first.source == "measured" and first.sizes == (1, 2, 4)
    assert trunk.batches == [1] * 3 + [2] * 3 + [4] * 3
    files = list(cache.glob("batch-profile-*.json"))
    assert len(files) == 1 and first.key in files[0].name
    trunk.batches.clear()
    second = profile_trunk(trunk, max_batch_size=4, cache_dir=cache, repeats=2)
    assert trunk.batches == []  # loaded, not measured
    assert second.source == "cached" and second.seconds == first.seconds
    assert (second.measured_at, second.key) == (first.measured_at, first.key)
    assert second.identity == bp.identity(trunk)


def test_the_key_names_what_the_time_depends_on(trunk, prefix, monkeypatch):
    ident = bp.identity(trunk)
    assert ident["runtime"] == "fake" and ident["precision"] == "fp32"
    assert ident["cores"] == str(bp.cores()) and ident["cpu"]
    assert prefix in ident["checkpoint"]
    key = bp.key_of(ident)
    monkeypatch.setattr(bp, "cores", lambda: 64)
    assert bp.key_of(bp.identity(trunk)) != key
    monkeypatch.undo()
    monkeypatch.setattr(bp, "cpu_model", lambda: "Another CPU")
    assert bp.key_of(bp.identity(trunk)) != key
    monkeypatch.undo()
    os.utime(prefix, ns=(1, 1))  # the checkpoint changed
    assert bp.key_of(bp.identity(trunk)) != key


def test_another_machine_or_trunk_is_measured_again(trunk, tmp_path, monkeypatch):
    cache = tmp_path / "graph_cache"
    first = profile_trunk(trunk, max_batch_size=2, cache_dir=cache, repeats=1)
    monkeypatch.setattr(bp, "cpu_model", lambda: "Another CPU")
    trunk.batches.clear()
    other = profile_trunk(trunk, max_batch_size=2, cache_dir=cache, repeats=1)
    assert other.source == "measured" and other.key != first.key and trunk.batches
    assert len(list(cache.glob("batch-profile-*.json"))) == 2


def test_a_file_of_another_identity_under_this_name_is_measured_over(trunk, tmp_path, caplog):
    cache = tmp_path / "graph_cache"
    first = profile_trunk(trunk, max_batch_size=2, cache_dir=cache, repeats=1)
    path = ProfileCache(cache, bp.identity(trunk)).path
    data = json.loads(path.read_text())
    data["identity"]["cpu"] = "copied from elsewhere"
    path.write_text(json.dumps(data))
    trunk.batches.clear()
    with caplog.at_level(logging.WARNING, logger="backbone.profile"):
        again = profile_trunk(trunk, max_batch_size=2, cache_dir=cache, repeats=1)
    assert again.source == "measured" and trunk.batches
    assert "another trunk or machine" in caplog.text
    assert json.loads(path.read_text())["identity"] == first.identity  # rewritten


@pytest.mark.parametrize("garbage", [b"", b"{not json", b"[]", b'{"format": 1}',
                                     b'{"format": 1, "key": "k", "identity": {}, '
                                     b'"measured_at": "", "repeats": 3, "seconds": {"1": -2}}',
                                     b"\xff\xfe"])
def test_a_corrupt_file_is_measured_over_not_a_crash(trunk, tmp_path, caplog, garbage):
    cache = tmp_path / "graph_cache"
    path = ProfileCache(cache, bp.identity(trunk)).path
    cache.mkdir()
    path.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="backbone.profile"):
        p = profile_trunk(trunk, max_batch_size=2, cache_dir=cache, repeats=1)
    assert p.source == "measured" and trunk.batches
    assert "ignoring unusable batch profile" in caplog.text
    assert BatchProfile.from_json(json.loads(path.read_text())).seconds == p.seconds


def test_a_larger_max_batch_size_is_measured_a_smaller_one_loaded(trunk, tmp_path):
    cache = tmp_path / "graph_cache"
    profile_trunk(trunk, max_batch_size=2, cache_dir=cache, repeats=1)
    trunk.batches.clear()
    bigger = profile_trunk(trunk, max_batch_size=8, cache_dir=cache, repeats=1)
    assert bigger.source == "measured" and bigger.sizes == (1, 2, 4, 8)
    trunk.batches.clear()
    smaller = profile_trunk(trunk, max_batch_size=4, cache_dir=cache, repeats=1)
    assert trunk.batches == [] and smaller.source == "cached"
    assert smaller.sizes == (1, 2, 4)  # only the sizes run now
    assert smaller.seconds == {n: bigger.seconds[n] for n in (1, 2, 4)}


def test_without_measuring_only_a_saved_profile_is_given(trunk, tmp_path):
    cache = tmp_path / "graph_cache"
    assert profile_trunk(trunk, max_batch_size=2, cache_dir=cache,
                         measure_if_missing=False) is None
    assert trunk.batches == [] and not cache.exists()
    profile_trunk(trunk, max_batch_size=2, cache_dir=cache, repeats=1)
    trunk.batches.clear()
    p = profile_trunk(trunk, max_batch_size=2, cache_dir=cache, measure_if_missing=False)
    assert p.source == "cached" and trunk.batches == []


def test_without_a_cache_dir_it_is_measured_and_not_kept(trunk, tmp_path):
    p = profile_trunk(trunk, max_batch_size=2, cache_dir=None, repeats=1)
    assert p.source == "measured" and p.key == ""
    assert not list(tmp_path.rglob("batch-profile-*"))


def test_a_cache_dir_that_cannot_be_written_costs_only_the_file(trunk, tmp_path, caplog):
    (tmp_path / "a_file").write_text("not a directory")
    cache = tmp_path / "a_file" / "graph_cache"  # mkdir fails, as on a read-only store
    with caplog.at_level(logging.WARNING, logger="backbone.profile"):
        p = profile_trunk(trunk, max_batch_size=2, cache_dir=cache, repeats=1)
    assert p.source == "measured" and "cannot write batch profile" in caplog.text
