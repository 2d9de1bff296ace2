"""Whether the server keeps up with its trunk (issue 31, item 2): the arithmetic of the
service section's targets (`bench.sections.service_cpu`), a process's CPU time
(`bench.stats.cpu_seconds`), the raw trunk's CPU per image (`trunk.time_batches`), and the
targets of one serving choice on fake load points. Fake numbers in, exact numbers out."""
from __future__ import annotations

import math
import os
import types

import pytest

from bench.markdown import fmt
from bench.report import render_markdown
from bench.sections import trunk as trunk_section
from bench.sections.base import FAIL, PASS, SKIP
from bench.sections.service import choice_targets
from bench.sections.service_cpu import (
    against_raw,
    alone_at,
    interpolate,
    load_figures,
    machine_bound,
    needed_sizes,
    per_image_ms,
    request_path_cpu_ms,
)
from bench.stats import cpu_seconds, stat_cpu_seconds, usable_cores
from tests.bench.helpers import passing_results

# -- the arithmetic ------------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch, sizes", [
    (16, (1, 2, 4, 8, 16)), (6, (1, 2, 4, 6)), (8, (1, 2, 4, 8)), (1, (1,)), (2, (1, 2)),
    (20, (1, 2, 4, 8, 16, 20))])
def test_the_raw_trunk_is_measured_at_powers_of_two_and_the_max_batch(max_batch, sizes):
    assert needed_sizes(max_batch) == sizes


def test_a_max_batch_below_one_is_refused():
    with pytest.raises(ValueError):
        needed_sizes(0)


@pytest.mark.parametrize("x, y", [
    (1.0, 10.0), (2.0, 20.0), (3.0, 25.0), (3.5, 27.5), (6.0, 35.0), (8.0, 40.0),
    (0.5, 10.0), (16.0, 40.0)])  # beyond either end: the end value
def test_interpolation_is_linear_between_the_points_around(x, y):
    points = [(8, 40.0), (1, 10.0), (4, 30.0), (2, 20.0)]  # any order
    assert interpolate(points, x) == pytest.approx(y)


def test_interpolation_without_points_or_x_is_nan():
    assert math.isnan(interpolate([], 2.0))
    assert math.isnan(interpolate([(1, 1.0)], math.nan))
    assert math.isnan(interpolate([(1, 1.0)], None))
    assert interpolate([(4, 7.0)], 2.0) == 7.0


SIZES = [{"batch_size": 1, "ms_per_batch": 40.0, "cpu_ms_per_image": 70.0},
         {"batch_size": 2, "ms_per_batch": 60.0, "cpu_ms_per_image": 50.0},
         {"batch_size": 4, "ms_per_batch": 100.0, "cpu_ms_per_image": 40.0},
         {"batch_size": 8, "ms_per_batch": 180.0, "cpu_ms_per_image": 35.0}]


def test_the_raw_trunk_at_a_fractional_batch_is_interpolated_per_batch():
    """At 3 rows: (60 + 100) / 2 = 80 ms per batch; CPU per batch (100 + 160) / 2 = 130 ms,
    so 43.33 ms per image (interpolating per image would say 45)."""
    ms, cpu = alone_at(SIZES, 3.0)
    assert ms == pytest.approx(80.0)
    assert cpu == pytest.approx(130.0 / 3)
    assert alone_at(SIZES, 6.0) == pytest.approx((140.0, (160.0 + 280.0) / 2 / 6))
    assert alone_at(SIZES, 8.0) == pytest.approx((180.0, 35.0))
    assert alone_at(SIZES, 1.0) == pytest.approx((40.0, 70.0))


def test_the_raw_trunk_without_numbers_is_nan():
    assert all(math.isnan(v) for v in alone_at([], 4.0))
    assert all(math.isnan(v) for v in alone_at(SIZES, math.nan))
    no_cpu = [{"batch_size": 1, "ms_per_batch": 40.0, "cpu_ms_per_image": None}]
    ms, cpu = alone_at(no_cpu, 1.0)
    assert ms == 40.0 and math.isnan(cpu)


def test_the_machine_bound_is_cores_over_cpu_per_image():
    """The issue's INT8 server on 2 cores: 32.6 ms of server CPU and 3.6 of the client's per
    image: 2 s of CPU a second / 36.2 ms = 55.25 images/s."""
    assert machine_bound(2, 32.6, 3.6) == pytest.approx(2000.0 / 36.2)
    assert machine_bound(4, 10.0, 10.0) == pytest.approx(200.0)
    assert math.isnan(machine_bound(2, math.nan, 3.6))
    assert math.isnan(machine_bound(2, 0.0, 0.0))
    assert math.isnan(machine_bound(None, 1.0, 1.0))


def test_the_request_path_is_the_servers_cpu_less_the_trunks():
    assert request_path_cpu_ms(32.6, 18.2) == pytest.approx(14.4)
    assert request_path_cpu_ms(20.0, 24.0) == pytest.approx(-4.0)  # kept as measured
    assert math.isnan(request_path_cpu_ms(32.6, None))


def test_cpu_per_image():
    assert per_image_ms(1.5, 60) == pytest.approx(25.0)
    assert math.isnan(per_image_ms(1.5, 0)) and math.isnan(per_image_ms(1.5, None))


def test_a_load_points_cpu_figures():
    """3.3 s of server CPU and 0.24 s of the client's over 120 images on 2 cores."""
    assert load_figures(3.3, 0.24, 120.0, 2) == {
        "images_served": 120.0, "cores": 2, "server_cpu_ms_per_image": pytest.approx(27.5),
        "client_cpu_ms_per_image": pytest.approx(2.0),
        "machine_bound_images_per_s": pytest.approx(2000.0 / 29.5)}
    unmeasured = load_figures(math.nan, 0.24, 120.0, 2)  # no server pid
    assert math.isnan(unmeasured["server_cpu_ms_per_image"])
    assert math.isnan(unmeasured["machine_bound_images_per_s"])


def _point(served=60.0, batch=6.0, trunk_ms=150.0, server_cpu=40.0, client_cpu=2.0,
           cores=2, concurrency=16) -> dict:
    return {"mode": "closed", "concurrency": concurrency, "throughput_images_per_s": served,
            "p50_ms": 52.0, "mean_batch": batch, "trunk_ms_per_batch_in_server": trunk_ms,
            **load_figures(server_cpu * 0.1, client_cpu * 0.1, 100.0, cores)}


RAW = {"name": "openvino-int8", "batch_size": 8, "images_per_s": 44.4,
       "batch1_forward_ms": 40.0, "sizes": SIZES}


def test_a_point_against_its_raw_trunk():
    """Mean batch 6: 140 ms per batch alone, 36.67 ms of CPU per image; the server's 150 ms
    and 40 ms; bound 2 cores / 42 ms = 47.62 images/s, 45 served."""
    fig = against_raw(_point(served=45.0), RAW)
    cpu = (160.0 + 280.0) / 2 / 6
    assert fig == {"trunk_ms_alone_at_mean_batch": pytest.approx(140.0),
                   "trunk_in_server_ratio": pytest.approx(150.0 / 140.0),
                   "raw_trunk_cpu_ms_per_image": pytest.approx(cpu),
                   "request_path_cpu_ms_per_image": pytest.approx(40.0 - cpu),
                   "bound_ratio": pytest.approx(45.0 / (2000.0 / 42.0))}
    # A point from before these figures (mean_batch_size only, no CPU): NaN, not a crash.
    old = against_raw({"mean_batch_size": 6.0, "throughput_images_per_s": 45.0}, RAW)
    assert old["trunk_ms_alone_at_mean_batch"] == pytest.approx(140.0)
    assert all(math.isnan(old[k]) for k in ("trunk_in_server_ratio",
                                           "request_path_cpu_ms_per_image", "bound_ratio"))


# -- the targets of one serving choice on fake points --------------------------------------------


def _targets(c16: dict, skip: str = "") -> dict:
    points = [_point(concurrency=1, batch=1.0, trunk_ms=42.0), c16]
    return {t.key.removeprefix("k_"): t.evaluate({"service"})
            for t in choice_targets("k", "service", points, RAW, skip)}


def test_a_server_that_keeps_up_with_its_trunk_passes():
    """150 / 140 = 1.071 x alone; 40 - 36.67 = 3.33 ms of request path; 45 of 47.62 images/s
    (0.945); p50 52 ms at 1 client against 40 + 10."""
    t = _targets(_point(served=45.0))
    assert list(t) == ["trunk_in_server_c16", "request_path_cpu_c16", "p50_c1", "bound_c16"]
    assert t["trunk_in_server_c16"].status == PASS
    assert t["trunk_in_server_c16"].measured == pytest.approx(150.0 / 140.0)
    assert t["trunk_in_server_c16"].limit == 1.15
    assert t["request_path_cpu_c16"].status == PASS
    assert t["request_path_cpu_c16"].measured == pytest.approx(40.0 - 220.0 / 6)
    assert t["request_path_cpu_c16"].limit == 6.0
    assert t["bound_c16"].status == PASS
    assert t["bound_c16"].measured == pytest.approx(45.0 * 42.0 / 2000.0)
    assert t["bound_c16"].limit == 0.9
    assert t["bound_c16"].note == \
        "45.00 of 47.62 images/s (2 cores / 40.0 + 2.0 ms of CPU per image)"
    assert t["p50_c1"].measured == 52.0 and t["p50_c1"].limit == pytest.approx(50.0)
    assert t["p50_c1"].status == FAIL


@pytest.mark.parametrize("change, failing", [
    (dict(trunk_ms=162.0), "trunk_in_server_c16"),  # 1.157 x
    (dict(server_cpu=42.8, client_cpu=0.0), "request_path_cpu_c16"),  # 6.13 ms; 0.963 bound
    (dict(served=42.8), "bound_c16"),  # 0.899
    (dict(cores=3), "bound_c16"),  # a bound of 71.4 images/s
])
def test_each_target_fails_alone(change, failing):
    t = _targets(_point(**{"served": 45.0, **change}))
    assert [k for k, x in t.items() if x.status == FAIL and k != "p50_c1"] == [failing]


def test_without_a_16_client_point_the_targets_fail_and_a_skip_says_why():
    t = _targets({})
    assert all(t[k].status == FAIL and t[k].measured is None
               for k in ("trunk_in_server_c16", "request_path_cpu_c16", "bound_c16"))
    skipped = _targets(_point(), "the serving choice is TF fp32")
    assert {x.status for x in skipped.values()} == {SKIP}
    assert {x.note for x in skipped.values()} == {"the serving choice is TF fp32"}


def test_the_report_sets_each_choice_against_its_bound_and_trunk():
    md = render_markdown(passing_results())
    assert "serve's defaults (openvino-int8), 2 cores:" in md
    row = ("| 16 clients | 9.75 | " + " | ".join(fmt(v) for v in (
        2000 / 195.5, 9.75 / (2000 / 195.5), 7.5, 800.0, 732.5, 800 / 732.5, 194.0, 190.0,
        4.0, 1.5)) + " |")
    assert row in md
    assert "--runtime tf --precision fp32 (tf-fp32), 2 cores:" in md


# -- measuring CPU -------------------------------------------------------------------------------


@pytest.mark.parametrize("line", [
    "4242 (multihead) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9 0 1 2 3",
    "4242 (a) b (c)) R 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 7 9 20 0 9 0 1 2 3"])
def test_a_stat_lines_cpu_is_utime_plus_stime(line):
    assert stat_cpu_seconds(line, 100) == pytest.approx(3.25)


def test_a_processes_cpu_seconds_grow_with_its_work():
    before = cpu_seconds(os.getpid())
    total, t = 0, os.times()
    while os.times().user + os.times().system - t.user - t.system < 0.05:
        total += sum(range(1000))
    assert cpu_seconds("self") >= before + 0.04
    assert math.isnan(cpu_seconds(2**22 + 12345))  # no such process
    assert usable_cores() >= 1


class _Clock:
    """perf_counter and process_time of a fake `time` module the fake trunk advances."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.module = types.SimpleNamespace(perf_counter=lambda: self.wall,
                                            process_time=lambda: self.cpu)


class _FakeTrunk:
    """30 ms + 10 ms per row of wall time, 45 ms of CPU per row (its threads on 2 cores)."""

    def __init__(self, clock):
        self.clock = clock

    def features(self, images):
        self.clock.wall += 0.030 + 0.010 * len(images)
        self.clock.cpu += 0.045 * len(images)


def test_the_raw_trunk_records_its_cpu_per_image(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(trunk_section, "time", clock.module)
    batches = trunk_section.time_batches(_FakeTrunk(clock), list(range(8)), (1, 4, 8), runs=3)
    assert [b["batch_size"] for b in batches] == [1, 4, 8]
    assert [b["median_s"] for b in batches] == pytest.approx([0.04, 0.07, 0.11])
    assert [b["cpu_ms_per_image"] for b in batches] == pytest.approx([45.0, 45.0, 45.0])
