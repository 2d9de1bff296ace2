"""The benchmark's statistics helpers: percentiles, Zipf popularity, Poisson arrivals (Prometheus
text: test_prometheus.py). Pure logic, no TensorFlow."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.stats import (
    ZipfSampler,
    get_path,
    percentile,
    poisson_arrivals,
    ratio,
    rss_bytes,
    summarize,
    zipf_weights,
)


@pytest.mark.parametrize("q, expected", [(0, 1.0), (50, 3.0), (100, 5.0), (25, 2.0), (90, 4.6)])
def test_percentile_interpolates_linearly(q, expected):
    assert percentile([5, 1, 4, 2, 3], q) == pytest.approx(expected)


def test_percentile_matches_numpy_on_random_data():
    values = np.random.default_rng(3).exponential(size=501)
    for q in (50, 95, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_of_nothing_is_nan_and_q_is_checked():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_summarize_reports_milliseconds():
    s = summarize([0.010, 0.020, 0.030, 0.040])
    assert s["n"] == 4
    assert s["p50_ms"] == pytest.approx(25.0)
    assert s["mean_ms"] == pytest.approx(25.0)
    assert s["min_ms"] == pytest.approx(10.0) and s["max_ms"] == pytest.approx(40.0)
    assert s["p99_ms"] == pytest.approx(39.7)


def test_summarize_of_nothing_is_all_nan():
    s = summarize([])
    assert s["n"] == 0
    assert all(math.isnan(s[k]) for k in ("mean_ms", "p50_ms", "p95_ms", "p99_ms"))


def test_zipf_weights_follow_the_law():
    p = zipf_weights(100, s=1.0)
    assert p.sum() == pytest.approx(1.0)
    assert np.all(np.diff(p) < 0)
    assert p[0] / p[1] == pytest.approx(2.0)
    assert p[0] / p[9] == pytest.approx(10.0)
    assert np.allclose(zipf_weights(5, s=0.0), 0.2)


@pytest.mark.parametrize("n, s", [(0, 1.0), (10, -1.0)])
def test_zipf_weights_refuse_bad_arguments(n, s):
    with pytest.raises(ValueError):
        zipf_weights(n, s)


def test_zipf_sampler_is_seeded_and_matches_its_weights():
    a = ZipfSampler(100, 1.0, seed=7).sample(50_000)
    b = ZipfSampler(100, 1.0, seed=7).sample(50_000)
    assert np.array_equal(a, b)
    assert a.min() >= 0 and a.max() <= 99
    freq = np.bincount(a, minlength=100) / len(a)
    p = zipf_weights(100, 1.0)
    assert freq[0] == pytest.approx(p[0], abs=0.01)  # ~19 % for the most popular bot
    assert freq[:10].sum() == pytest.approx(p[:10].sum(), abs=0.01)
    assert isinstance(ZipfSampler(3).sample(), int)


def test_zipf_sampler_with_one_item_always_picks_it():
    assert set(ZipfSampler(1).sample(100).tolist()) == {0}


def test_poisson_arrivals_have_exponential_gaps():
    t = poisson_arrivals(20.0, 20_000, seed=1)
    assert len(t) == 20_000
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.05)  # exponential: std == mean
    assert np.array_equal(t, poisson_arrivals(20.0, 20_000, seed=1))
    assert len(poisson_arrivals(5.0, 0)) == 0


@pytest.mark.parametrize("rate, count", [(0.0, 5), (-1.0, 5), (1.0, -1)])
def test_poisson_arrivals_refuse_bad_arguments(rate, count):
    with pytest.raises(ValueError):
        poisson_arrivals(rate, count)


def test_ratio_and_get_path():
    assert ratio(6.0, 3.0) == 2.0
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(None, 1.0))
    assert math.isnan(ratio(math.nan, 1.0))
    data = {"a": {"b": {"c": 3}}}
    assert get_path(data, "a.b.c") == 3
    assert get_path(data, "a.x.c", "missing") == "missing"


def test_rss_of_this_process_is_read_from_proc():
    assert rss_bytes() > 10 * 2**20
    assert rss_bytes(2**31 - 1) == 0  # no such process
