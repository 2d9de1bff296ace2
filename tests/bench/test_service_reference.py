"""The service section against its raw trunk: the SAME runtime x precision the servers run, at
batch 1, 2, 4, ... up to the servers' max batch size, with its CPU time per image; from the
trunk section's table when it has that runtime at those sizes, else measured by the service
section itself.

The regression: the target once divided by TF fp32's best rate whatever the server ran, so a
bf16 or OpenVINO server passed it without trying.
"""
from __future__ import annotations

import pytest

from bench.report import evaluate_targets
from bench.sections.base import FAIL, PASS
from bench.sections.service import (
    ServiceResult,
    compare_tf_fp32_with_raw_trunk,
    compare_with_raw_trunk,
    raw_trunk,
)
from bench.sections.trunk import TrunkResult
from tests.bench.helpers import passing_results


def _table(rates: dict[int, float], cpu: float | None = 30.0) -> list[dict]:
    """A trunk section's batch table: images/s by batch size, `cpu` ms of CPU per image."""
    return [{"batch_size": b, "runs": 5, "median_s": b / r, "images_per_s": r,
             "times_s": [b / r] * 5,
             **({} if cpu is None else {"cpu_ms_per_image": cpu})} for b, r in rates.items()]


TRUNK = TrunkResult(runtimes={
    "tf-fp32": {"batches": _table({1: 8.0, 2: 9.0, 4: 10.0, 8: 10.8, 16: 10.5}, 240.0)},
    "openvino-bf16": {"batches": _table({1: 40.0, 2: 50.0, 4: 60.0, 8: 62.0, 16: 63.0})},
    "openvino-int8": {"batches": _table({1: 70.0, 2: 90.0, 4: 100.0, 8: 115.0, 16: 120.0},
                                        17.0)},
    "tf-bf16": {"batches": _table({1: 12.0, 2: 14.0, 4: 15.0, 8: 16.0, 16: 16.5}, None)},
})


def _no_measure(name, sizes):
    raise AssertionError(f"{name} was in the trunk section's table: nothing to measure")


def test_the_reference_is_the_servers_runtime_at_its_batch_sizes():
    raw = raw_trunk("openvino-bf16", 16, TRUNK, _no_measure)
    assert {k: v for k, v in raw.items() if k != "sizes"} == {
        "name": "openvino-bf16", "batch_size": 16, "images_per_s": 63.0,
        "batch1_forward_ms": pytest.approx(25.0), "source": "trunk section"}
    assert [s["batch_size"] for s in raw["sizes"]] == [1, 2, 4, 8, 16]
    assert raw["sizes"][3] == {"batch_size": 8, "ms_per_batch": pytest.approx(8000 / 62.0),
                               "images_per_s": 62.0, "cpu_ms_per_image": 30.0}
    tf8 = raw_trunk("tf-fp32", 8, TRUNK, _no_measure)
    assert tf8["images_per_s"] == 10.8 and [s["batch_size"] for s in tf8["sizes"]] == [1, 2, 4, 8]
    int8 = raw_trunk("openvino-int8", 16, TRUNK, _no_measure)  # an int8 server: the int8 row
    assert int8["images_per_s"] == 120.0 and int8["batch1_forward_ms"] == pytest.approx(1000 / 70)
    assert {s["cpu_ms_per_image"] for s in int8["sizes"]} == {17.0}


@pytest.mark.parametrize("trunk", [None, TRUNK],
                         ids=["no trunk section", "its table has no CPU time"])
def test_a_runtime_the_trunk_section_did_not_measure_is_measured(trunk):
    calls = []

    def measure(name, sizes):
        calls.append((name, sizes))
        return _table({1: 11.0, 2: 13.0, 4: 15.0, 8: 16.0, 16: 39.6}, 55.0)

    raw = raw_trunk("tf-bf16", 16, trunk, measure)
    assert calls == [("tf-bf16", (1, 2, 4, 8, 16))]
    assert raw["images_per_s"] == 39.6 and raw["source"] == "measured in the service section"
    assert raw["batch1_forward_ms"] == pytest.approx(1000 / 11.0)
    assert raw["sizes"][0]["cpu_ms_per_image"] == 55.0


def test_a_table_without_a_needed_size_is_measured_again():
    calls = []
    trunk = TrunkResult(runtimes={"tf-fp32": {"batches": _table({1: 8.0, 8: 10.8, 16: 10.5})}})

    def measure(name, sizes):
        calls.append(sizes)
        return _table(dict.fromkeys(sizes, 10.0))

    raw_trunk("tf-fp32", 12, trunk, measure)
    assert calls == [(1, 2, 4, 8, 12)]


def test_every_load_point_is_set_against_that_raw_trunk():
    """openvino-bf16 at a mean batch of 6: 4000/60 + (8000/62 - 4000/60) / 2 ms alone."""
    point = {"mode": "closed", "concurrency": 16, "throughput_images_per_s": 31.5,
             "mean_batch": 6.0, "trunk_ms_per_batch_in_server": 120.0,
             "server_cpu_ms_per_image": 35.0, "machine_bound_images_per_s": 35.0}
    result = ServiceResult(policies={"mixed": {"points": [point]}})
    compare_with_raw_trunk(result, raw_trunk("openvino-bf16", 16, TRUNK, _no_measure))
    alone = (4000 / 60 + 8000 / 62) / 2
    assert point["ratio_to_trunk"] == pytest.approx(0.5)
    assert point["trunk_ms_alone_at_mean_batch"] == pytest.approx(alone)
    assert point["trunk_in_server_ratio"] == pytest.approx(120.0 / alone)
    assert point["raw_trunk_cpu_ms_per_image"] == pytest.approx(30.0)
    assert point["request_path_cpu_ms_per_image"] == pytest.approx(5.0)
    assert point["bound_ratio"] == pytest.approx(0.9)


def test_a_bf16_server_is_held_to_its_own_raw_trunk_not_to_tf_fp32():
    """The same server numbers (800 ms per batch of 7.5 in the server) pass against TF fp32's
    raw trunk (1.11 x) and fail against openvino-bf16's, which runs a batch of 7.5 in 121 ms."""
    results = passing_results()
    service = ServiceResult.from_json(results["service"])
    compare_with_raw_trunk(service, raw_trunk("openvino-bf16", 16, TRUNK, _no_measure))
    results["service"] = service.to_json()
    targets = {t.key: t for t in evaluate_targets(results)}
    trunk = targets["service_trunk_in_server_c16"]
    alone = 4000 / 60 + (8000 / 62 - 4000 / 60) * 3.5 / 4
    assert trunk.measured == pytest.approx(800.0 / alone)
    assert trunk.status == FAIL and "raw openvino-bf16 trunk" in trunk.text
    cpu = targets["service_request_path_cpu_c16"]  # 194 - 30 ms
    assert cpu.measured == pytest.approx(164.0) and cpu.status == FAIL
    p50 = targets["service_p50_c1"]
    assert p50.limit == pytest.approx(25.0 + 10.0) and p50.status == FAIL  # 118.5 ms
    assert results["service"]["policies"]["mixed"]["points"][1]["ratio_to_trunk"] == \
        pytest.approx(9.75 / 63.0)


def test_a_service_within_its_raw_trunk_passes():
    results = passing_results()
    targets = {t.key: t for t in evaluate_targets(results)}
    for key in ("trunk_in_server", "request_path_cpu", "bound"):
        assert targets[f"service_{key}_c16"].status == PASS
        assert targets[f"service_{key}_c16"].section == "service"


def test_without_a_raw_trunk_the_service_targets_are_not_measured():
    results = passing_results()
    del results["service"]["raw_trunk"]
    targets = {t.key: t for t in evaluate_targets(results)}
    for key in ("service_trunk_in_server_c16", "service_request_path_cpu_c16"):
        assert targets[key].status == FAIL and targets[key].measured is None
    assert targets["service_p50_c1"].status == FAIL and targets["service_p50_c1"].limit is None
    # The bound needs no raw trunk: the server's and the client's CPU only.
    assert targets["service_bound_c16"].status == PASS


def test_the_tf_fp32_server_is_held_to_tf_fp32_and_the_default_to_its_own_int8():
    """The two serving choices of one run: an int8 default and TF fp32, each against its own
    raw trunk: TF fp32's 240 ms of CPU per image would make the TF server's 196 a negative
    request path; int8's 17 leave the default's 194 ms a request path of 177 ms."""
    results = passing_results()
    service = ServiceResult.from_json(results["service"])
    compare_with_raw_trunk(service, raw_trunk("openvino-int8", 16, TRUNK, _no_measure))
    compare_tf_fp32_with_raw_trunk(service, raw_trunk("tf-fp32", 16, TRUNK, _no_measure))
    assert service.tf_fp32["points"][1]["ratio_to_trunk"] == pytest.approx(8.85 / 10.5)
    assert service.policies["mixed"]["points"][1]["ratio_to_trunk"] == pytest.approx(9.75 / 120)
    results["service"] = service.to_json()
    targets = {t.key: t for t in evaluate_targets(results)}
    assert targets["service_request_path_cpu_c16"].measured == pytest.approx(194.0 - 17.0)
    assert targets["service_request_path_cpu_c16"].status == FAIL
    assert targets["service_tf_fp32_request_path_cpu_c16"].measured == \
        pytest.approx(196.0 - 240.0)
    assert targets["service_tf_fp32_request_path_cpu_c16"].status == PASS
    assert targets["service_tf_fp32_p50_c1"].limit == pytest.approx(1000 / 8.0 + 10)
