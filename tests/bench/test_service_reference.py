"""The service section against its raw trunk: the SAME runtime x precision the servers run, at
the servers' max batch size and at batch 1; from the trunk section's table when it has that
runtime, else measured by the service section itself.

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


def _table(rates: dict[int, float]) -> list[dict]:
    return [{"batch_size": b, "runs": 5, "median_s": b / r, "images_per_s": r,
             "times_s": [b / r] * 5} for b, r in rates.items()]


TRUNK = TrunkResult(runtimes={
    "tf-fp32": {"batches": _table({1: 8.0, 8: 10.8, 16: 10.5})},
    "openvino-bf16": {"batches": _table({1: 40.0, 8: 62.0, 16: 63.0})},
    "openvino-int8": {"batches": _table({1: 70.0, 8: 115.0, 16: 120.0})},
})


def _no_measure(name, sizes):
    raise AssertionError(f"{name} was in the trunk section's table: nothing to measure")


def test_the_reference_is_the_servers_runtime_at_its_batch_size():
    raw = raw_trunk("openvino-bf16", 16, TRUNK, _no_measure)
    assert raw == {"name": "openvino-bf16", "batch_size": 16, "images_per_s": 63.0,
                   "batch1_forward_ms": pytest.approx(25.0), "source": "trunk section"}
    assert raw_trunk("tf-fp32", 8, TRUNK, _no_measure)["images_per_s"] == 10.8
    int8 = raw_trunk("openvino-int8", 16, TRUNK, _no_measure)  # an int8 server: the int8 row
    assert int8["images_per_s"] == 120.0 and int8["batch1_forward_ms"] == pytest.approx(1000 / 70)


@pytest.mark.parametrize("trunk", [None, TRUNK], ids=["no trunk section", "runtime not in it"])
def test_a_runtime_the_trunk_section_did_not_measure_is_measured(trunk):
    calls = []

    def measure(name, sizes):
        calls.append((name, sizes))
        return _table({1: 11.0, 16: 39.6})

    raw = raw_trunk("tf-bf16", 16, trunk, measure)
    assert calls == [("tf-bf16", (1, 16))]
    assert raw["images_per_s"] == 39.6 and raw["source"] == "measured in the service section"
    assert raw["batch1_forward_ms"] == pytest.approx(1000 / 11.0)


def test_every_load_point_is_a_share_of_that_raw_trunk():
    result = ServiceResult(policies={"mixed": {"points": [
        {"mode": "closed", "concurrency": 16, "throughput_images_per_s": 31.5}]}})
    compare_with_raw_trunk(result, raw_trunk("openvino-bf16", 16, TRUNK, _no_measure))
    assert result.policies["mixed"]["points"][0]["ratio_to_trunk"] == pytest.approx(0.5)


def test_a_bf16_server_is_held_to_its_own_raw_trunk_not_to_tf_fp32():
    """Raw TF fp32 at best 10.25 images/s; the server ran OpenVINO bf16 (63 images/s at batch
    16) and served 9.75: the old target (>= 0.9 x TF fp32's best = 9.2) passed; it must fail."""
    results = passing_results()
    raw = raw_trunk("openvino-bf16", 16, TRUNK, _no_measure)
    service = ServiceResult.from_json(results["service"])
    compare_with_raw_trunk(service, raw)
    results["service"] = service.to_json()
    targets = {t.key: t for t in evaluate_targets(results)}
    throughput = targets["service_throughput_c16"]
    assert throughput.measured == pytest.approx(9.75)
    assert throughput.limit == pytest.approx(0.85 * 63.0)
    assert throughput.status == FAIL and "raw openvino-bf16 trunk 63.00" in throughput.note
    p50 = targets["service_p50_c1"]
    assert p50.limit == pytest.approx(25.0 + 10.0) and p50.status == FAIL  # 118.5 ms
    assert results["service"]["policies"]["mixed"]["points"][1]["ratio_to_trunk"] == \
        pytest.approx(9.75 / 63.0)


def test_a_service_within_its_raw_trunk_passes():
    results = passing_results()  # TF fp32 servers, 9.75 images/s vs raw 10.25 at batch 16
    targets = {t.key: t for t in evaluate_targets(results)}
    assert targets["service_throughput_c16"].status == PASS
    assert targets["service_throughput_c16"].section == "service"


def test_without_a_raw_trunk_the_service_targets_are_not_measured():
    results = passing_results()
    del results["service"]["raw_trunk"]
    targets = {t.key: t for t in evaluate_targets(results)}
    assert targets["service_throughput_c16"].status == FAIL
    assert targets["service_throughput_c16"].limit is None


def test_the_tf_fp32_server_is_held_to_tf_fp32_and_the_default_to_its_own_int8():
    """The two serving choices of one run: an int8 default and TF fp32, each against its own
    raw trunk; the TF fp32 server's 9.0 images/s pass against TF fp32 (10.5 at batch 16) and
    would be nowhere near int8's 120."""
    results = passing_results()
    service = ServiceResult.from_json(results["service"])
    compare_with_raw_trunk(service, raw_trunk("openvino-int8", 16, TRUNK, _no_measure))
    service.tf_fp32["points"][1]["throughput_images_per_s"] = 9.0
    compare_tf_fp32_with_raw_trunk(service, raw_trunk("tf-fp32", 16, TRUNK, _no_measure))
    assert service.tf_fp32["points"][1]["ratio_to_trunk"] == pytest.approx(9.0 / 10.5)
    assert service.policies["mixed"]["points"][1]["ratio_to_trunk"] == pytest.approx(9.75 / 120)
    results["service"] = service.to_json()
    targets = {t.key: t for t in evaluate_targets(results)}
    assert targets["service_throughput_c16"].limit == pytest.approx(0.85 * 120.0)
    assert targets["service_throughput_c16"].status == FAIL
    assert targets["service_tf_fp32_throughput_c16"].limit == pytest.approx(0.85 * 10.5)
    assert targets["service_tf_fp32_throughput_c16"].status == PASS
    assert targets["service_tf_fp32_p50_c1"].limit == pytest.approx(1000 / 8.0 + 10)
