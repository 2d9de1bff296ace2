"""`--check` evaluation on synthetic results, and the report files (bench.json, bench.md,
bench.png)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import (
    FAIL,
    PASS,
    SKIP,
    evaluate_targets,
    format_target_line,
    render_markdown,
    targets_failed,
    write_reports,
)
from bench.sections.trunk import FLOPS_PER_IMAGE
from tests.bench.helpers import isolation_targets, passing_results

REPO = Path(__file__).resolve().parents[2]


def _by_key(targets):
    return {t.key: t for t in targets}


def test_every_target_passes_on_good_results():
    targets = evaluate_targets(passing_results())
    assert len(targets) == 44 + isolation_targets()
    assert [t.key for t in targets if t.status != PASS] == []
    assert not targets_failed(targets)


def test_targets_carry_the_measured_values_and_limits():
    t = _by_key(evaluate_targets(passing_results()))
    # The serving choice (openvino-int8) against its raw trunk at the mean batch of 7.5.
    assert t["service_trunk_in_server_c16"].measured == pytest.approx(800.0 / 732.5)
    assert t["service_trunk_in_server_c16"].limit == pytest.approx(1.15)
    assert t["service_trunk_in_server_c16"].note == "800 vs 732 ms per batch of 7.50"
    assert t["service_request_path_cpu_c16"].measured == pytest.approx(194.0 - 190.0)
    assert t["service_request_path_cpu_c16"].limit == pytest.approx(6.0)
    assert t["service_request_path_cpu_c16"].note == \
        "server 194.0 - trunk 190.0 ms of CPU per image"
    assert t["service_bound_c16"].measured == pytest.approx(9.75 / (2000.0 / 195.5))
    assert t["service_bound_c16"].limit == pytest.approx(0.9)
    assert t["service_bound_c16"].note == \
        "9.75 of 10.23 images/s (2 cores / 194.0 + 1.5 ms of CPU per image)"
    assert t["service_p50_c1"].measured == pytest.approx(118.5)
    assert t["service_p50_c1"].limit == pytest.approx(110.0 + 10)
    # The TF fp32 server against TF fp32's raw trunk, not the serving choice's.
    assert t["service_tf_fp32_trunk_in_server_c16"].measured == \
        pytest.approx(780.0 / 706.875)
    assert "raw tf-fp32 trunk" in t["service_tf_fp32_trunk_in_server_c16"].text
    assert t["service_tf_fp32_request_path_cpu_c16"].measured == pytest.approx(196.0 - 191.0)
    assert t["service_tf_fp32_bound_c16"].measured == pytest.approx(8.85 / (2000.0 / 208.0))
    assert t["service_tf_fp32_p50_c1"].limit == pytest.approx(97.5 + 10)
    assert t["int8_vs_fp32_b8"].measured == pytest.approx(40.25 / 11.5)
    assert t["int8_vs_bf16_b8"].measured == pytest.approx(40.25 / 19.0)
    assert t["int8_mean_cosine"].measured == pytest.approx(0.999712)
    assert t["int8_mean_cosine"].limit == pytest.approx(0.999)
    assert t["int8_mean_cosine"].note == \
        "0.999712 on 100 held-out images (min 0.999312, not gated)"  # fmt would say 1
    assert t["int8_top1_agreement"].measured == pytest.approx(0.99)
    assert t["int8_top1_agreement"].note == "light, 3 bots"
    assert t["int8_all_answers"].measured == pytest.approx(2.99 / 3)
    assert t["int8_all_answers"].limit == pytest.approx(0.995)
    assert t["rebuild_vs_service"].measured == pytest.approx(6543.0 / 118.5)
    assert t["rss_per_bot"].measured == pytest.approx(655_000 / 614_800)
    assert t["registration_p50"].measured == pytest.approx(8.4)
    assert t["cold_bot"].limit == pytest.approx(1.5 + 20)
    assert t["fanout"].measured == pytest.approx(135 / 130)
    assert t["batch_mixing"].measured == pytest.approx(7.5 / 1.5)
    assert t["restart_saved_graph"].measured == pytest.approx(2.25)
    assert t["restart_saved_graph"].limit == pytest.approx(3.0)  # issue 31, item 5 (was 5)


def _set(results, path, value):
    node = results
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[keys[-1]] = value


@pytest.mark.parametrize("key, path, value", [
    # 850 / 732.5 ms = 1.160
    ("service_trunk_in_server_c16",
     "service.policies.mixed.points.1.trunk_ms_per_batch_in_server", 850.0),
    # 196.5 - 190 = 6.5 ms (its bound, 2 / 198 ms = 10.10 images/s, still passes: 0.965)
    ("service_request_path_cpu_c16", "service.policies.mixed.points.1.server_cpu_ms_per_image",
     196.5),
    ("service_p50_c1", "service.policies.mixed.points.0.p50_ms", 120.5),
    # 4 cores: a bound of 20.5 images/s, 9.75 served
    ("service_bound_c16", "service.policies.mixed.points.1.machine_bound_images_per_s", 20.5),
    ("service_tf_fp32_trunk_in_server_c16",
     "service.tf_fp32.points.1.trunk_ms_per_batch_in_server", 815.0),  # 1.153
    ("service_tf_fp32_request_path_cpu_c16",
     "service.tf_fp32.points.1.server_cpu_ms_per_image", 197.1),  # 6.1 ms; bound 0.923
    ("service_tf_fp32_p50_c1", "service.tf_fp32.points.0.p50_ms", 107.6),
    ("service_tf_fp32_bound_c16", "service.tf_fp32.points.1.machine_bound_images_per_s",
     9.84),  # 8.85 / 9.84 = 0.899
    ("rebuild_vs_service", "baselines.rebuild.latency.p50_ms", 2000.0),
    ("rss_per_bot", "scale.rss_growth_per_bot_bytes", 1_000_000),
    ("registration_p50", "scale.registration_p50_ms", 20.5),
    ("cold_bot", "scale.cold.p50_ms", 21.6),
    ("fanout", "fanout.fanout.p50_ms", 157.0),
    ("batch_mixing", "service.policies.per_group.points.1.mean_batch_size", 2.6),
    ("restart_saved_graph", "coldstart.restart_with_saved_graph_s", 3.01),
    ("best_trunk_b1", "trunk.runtimes.openvino-bf16.images_per_s_b1", 17.0),
    ("best_trunk_b8", "trunk.runtimes.openvino-bf16.images_per_s_b8", 17.9),
    ("tf_bf16_b8", "trunk.runtimes.tf-bf16.images_per_s_b8", 14.9),
    # 2.1 ms per key check at 9.75 images/s: 2.05 % of the time
    ("auth_cost", "service.auth.key_check_s", 0.0021),
    ("int8_vs_fp32_b8", "trunk.runtimes.openvino-fp32.images_per_s_b8", 26.9),
    ("int8_vs_bf16_b8", "trunk.runtimes.openvino-bf16.images_per_s_b8", 28.8),
    ("int8_mean_cosine", "trunk.int8.fidelity.mean_cosine", 0.99881),
    ("int8_top1_agreement", "trunk.int8.fidelity.agreement.light", 0.98),
    ("int8_all_answers", "trunk.int8.fidelity.overall_agreement", 0.994),
    ("overload_peak", "overload.rss_peak_bytes", 1_010_000_000 + 1.25 * 268_435_456 + 1),
    ("overload_after", "overload.rss_after_bytes", 1.11 * 1_010_000_000),
    ("overload_wrong", "overload.wrong_answers", 1),
    ("soak_flat", "soak.rss_second_half_mean_bytes", 1.11 * 1_020_000_000),
    ("fair_quiet_p50", "fairness.runs.fifo.quiet.p50_ms", 10_300.0),
    ("fair_quiet_vs_batch", "fairness.raw_trunk.batch_s", 2.05),
    ("fair_throughput", "fairness.runs.fifo.total_images_per_s", 6.43),
    ("quota_rate", "fairness.quota.accepted_images_per_s", 1.66),
    ("quota_rate", "fairness.quota.accepted_images_per_s", 1.34),
    ("quota_retry_after", "fairness.quota.retries_refused", 1),
    ("quota_retry_after", "fairness.quota.refusals_improper", 2),
    ("cancel_patient_goodput", "cancellation.runs.no-cancel.patient.goodput", 0.41),
    ("cancel_499", "cancellation.runs.cancel.server_statuses.499", 280),
])
def test_a_missed_target_fails_alone(key, path, value):
    results = passing_results()
    _set(results, path, value)
    targets = evaluate_targets(results)
    assert [t.key for t in targets if t.status == FAIL] == [key]
    assert targets_failed(targets)
    line = format_target_line(_by_key(targets)[key])
    assert line.startswith("[FAIL]")


def test_targets_of_unselected_sections_are_skipped():
    results = passing_results()
    del results["coldstart"], results["baselines"]
    targets = _by_key(evaluate_targets(results, {"trunk", "service", "fanout", "scale"}))
    assert targets["restart_saved_graph"].status == SKIP
    assert targets["rebuild_vs_service"].status == SKIP
    assert targets["service_p50_c1"].status == PASS


def test_a_selected_section_without_numbers_fails():
    """A section that errored (or a hook that does not exist yet) is a miss, not a pass."""
    results = passing_results()
    results["coldstart"]["restart_with_saved_graph_s"] = None
    results["coldstart"]["note"] = "no saved-graph cache"
    t = _by_key(evaluate_targets(results))["restart_saved_graph"]
    assert t.status == FAIL and t.measured is None
    assert "not measured" in format_target_line(t) and "no saved-graph cache" in t.note


def test_reports_hold_the_numbers(tmp_path):
    results = passing_results()
    targets = evaluate_targets(results)
    written = write_reports(tmp_path / "out", results, targets)
    assert set(written) == {"json", "md", "png"}
    data = json.loads(written["json"].read_text())
    assert data["trunk"]["best_images_per_s"] == 10.25
    assert data["service"]["policies"]["per_group"]["points"][1]["mean_batch_size"] == 1.5
    assert [t["status"] for t in data["targets"]] == [PASS] * (44 + isolation_targets())
    md = written["md"].read_text()
    assert "2026-01-02 03:04 UTC" in md and "Test CPU 9000" in md and "TensorFlow 2.21.0" in md
    for number in ("10.2", "302", "9.75", "1,500", "6,543", "8.4", "2.25", "265.0 MB", "83.5"):
        assert number in md, number
    assert md.count("| PASS |") == 44 + isolation_targets()
    png = written["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_reports_without_service_points_skip_the_plot(tmp_path):
    results = passing_results()
    del results["service"]
    written = write_reports(tmp_path, results, None)
    assert "png" not in written and not (tmp_path / "bench.png").exists()
    assert "## Targets" not in written["md"].read_text()


def test_nan_numbers_are_written_as_null_and_shown_as_dashes(tmp_path):
    results = passing_results()
    results["fanout"]["single"]["p95_ms"] = float("nan")
    write_reports(tmp_path, results, None)
    assert json.loads((tmp_path / "bench.json").read_text())["fanout"]["single"]["p95_ms"] is None
    assert "| — |" in render_markdown(results)


def test_errors_are_listed_in_the_markdown():
    results = passing_results()
    results["errors"] = {"scale": "RuntimeError: boom"}
    assert "- scale: RuntimeError: boom" in render_markdown(results)


# -- matplotlib is optional --------------------------------------------------------------

_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # any `import matplotlib` now raises ImportError
import bench, bench.cli, bench.load, bench.report, bench.runner, bench.stats, bench.__main__
import bench.sections
from bench.report import evaluate_targets, write_reports
from tests.bench.helpers import passing_results

results = passing_results()
out = sys.argv[1]
written = write_reports(out, results, evaluate_targets(results))
written = write_reports(out, results, evaluate_targets(results))  # says it once per process
print(sorted(written))
"""


def test_no_bench_module_imports_matplotlib_and_reports_are_written_without_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_MATPLOTLIB, str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['json', 'md']"
    assert json.loads((tmp_path / "bench.json").read_text())["trunk"]["best_images_per_s"] == 10.25
    assert "| PASS |" in (tmp_path / "bench.md").read_text()
    assert not (tmp_path / "bench.png").exists()
    said = [line for line in proc.stderr.splitlines() if "matplotlib" in line]
    assert len(said) == 1 and "pip install 'multihead[bench]'" in said[0], proc.stderr


def test_flops_constant_is_the_contracts():
    contract = json.loads((REPO / "tests" / "data" / "inception_v4_contract.json").read_text())
    # To PreLogitsFlatten (the trunk's output), 1 multiply-add = 2 FLOPs.
    assert FLOPS_PER_IMAGE == contract["flops_per_image"]["to_PreLogitsFlatten"]


def test_bf16_speed_targets_are_skipped_on_a_cpu_without_bf16():
    results = passing_results()
    results["trunk"]["bf16_cpu"] = False
    results["trunk"]["runtimes"] = {k: v for k, v in results["trunk"]["runtimes"].items()
                                    if "bf16" not in k}
    t = _by_key(evaluate_targets(results))
    for key in ("best_trunk_b1", "best_trunk_b8", "tf_bf16_b8"):
        assert t[key].status == SKIP and "no avx512_bf16" in t[key].note


def test_bf16_speed_targets_do_not_claim_a_cpu_without_bf16_when_the_trunk_did_not_run():
    results = passing_results()
    del results["trunk"]
    t = _by_key(evaluate_targets(results, {"service"}))
    for key in ("best_trunk_b1", "best_trunk_b8", "tf_bf16_b8"):
        assert t[key].status == SKIP and t[key].note == ""
    t = _by_key(evaluate_targets(results, {"trunk"}))  # selected, but it failed
    assert t["tf_bf16_b8"].status == FAIL


def test_without_bf16_the_int8_trunk_is_held_to_openvino_fp32_only():
    results = passing_results()
    results["trunk"]["bf16_cpu"] = False
    results["trunk"]["runtimes"] = {k: v for k, v in results["trunk"]["runtimes"].items()
                                    if "bf16" not in k}
    t = _by_key(evaluate_targets(results))
    assert t["int8_vs_bf16_b8"].status == SKIP
    assert "no avx512_bf16/amx_bf16: no OpenVINO bf16 to compare with" in t["int8_vs_bf16_b8"].note
    assert t["int8_vs_fp32_b8"].status == PASS
    results["trunk"]["runtimes"]["openvino-int8"]["images_per_s_b8"] = 17.2  # 1.496 x 11.5
    t = _by_key(evaluate_targets(results))
    assert t["int8_vs_fp32_b8"].status == FAIL and t["int8_vs_bf16_b8"].status == SKIP


def test_int8_targets_skip_saying_why_when_the_run_could_not_make_one():
    results = passing_results()
    results["trunk"]["int8"] = {"skipped": "NNCF is not installed (the openvino extra)"}
    del results["trunk"]["runtimes"]["openvino-int8"]
    t = _by_key(evaluate_targets(results))
    for key in ("int8_vs_fp32_b8", "int8_vs_bf16_b8", "int8_mean_cosine", "int8_top1_agreement",
                "int8_all_answers"):
        assert t[key].status == SKIP and t[key].note == "NNCF is not installed (the openvino extra)"
    assert "No INT8 trunk: NNCF is not installed" in render_markdown(results)


def test_a_failed_int8_calibration_fails_its_targets():
    results = passing_results()
    results["trunk"]["int8"] = {"error": "RuntimeError: multihead quantize exited with 1"}
    del results["trunk"]["runtimes"]["openvino-int8"]
    t = _by_key(evaluate_targets(results))
    for key in ("int8_vs_fp32_b8", "int8_vs_bf16_b8", "int8_mean_cosine", "int8_top1_agreement",
                "int8_all_answers"):
        assert t[key].status == FAIL and t[key].measured is None
    assert "its calibration failed (RuntimeError: multihead quantize exited with 1)" in \
        render_markdown(results)


def test_an_int8_trunk_without_heads_to_compare_fails_the_agreement_target():
    results = passing_results()
    results["trunk"]["int8"]["fidelity"]["agreement"] = {}
    t = _by_key(evaluate_targets(results))
    assert t["int8_top1_agreement"].status == FAIL and t["int8_top1_agreement"].measured is None


def test_the_int8_row_and_its_fidelity_report_are_rendered():
    results = passing_results()
    md = render_markdown(results, evaluate_targets(results))
    row = next(line for line in md.splitlines() if line.startswith("| openvino-int8 |"))
    assert "0.999620" in row  # min cosine vs TF fp32, six decimals
    for text in ("`multihead quantize --force` on 64 generated labelled images (the demo's "
                 "kinds, not the uploads)",
                 "calibrated in 61.5 s", "float layers in bf16", "100 held-out images",
                 "mean cosine vs OpenVINO fp32 0.999712 (bound >= 0.999; min 0.999312, not gated)",
                 "top-1 agreement of the 3 bots trained on generated images: lowest 99 % (light; "
                 "bound >= 99 %), all answers 99.7 % (bound >= 99.5 %)",
                 "`serve` picks it by default",
                 "The run's 100 random bots on the same images (information, not a target: "
                 "random heads on a random trunk sit on near ties): lowest 73 % (bot-00007), "
                 "mean 91.2 %, 61 below the bound."):
        assert text in md, text
    results["trunk"]["int8"].update(passed=False, reused=True)
    results["trunk"]["int8"]["fidelity"]["min_cosine"] = 0.99881
    md = render_markdown(results)
    assert "reused from the output's inception_v4-int8-0123456789abcdef.xml" in md
    assert "below a bound: kept marked failing, so `serve`'s auto does not pick it" in md


def test_both_serving_choices_are_rendered_against_their_own_raw_trunk():
    md = render_markdown(passing_results())
    rows = [line for line in md.splitlines() if line.startswith("| serve's defaults")
            or line.startswith("| --runtime tf --precision fp32")]
    assert len(rows) == 2
    assert rows[0].startswith("| serve's defaults (openvino-int8) | 10.2 | 9.75 |")
    assert rows[1].startswith("| --runtime tf --precision fp32 (tf-fp32) | 10.2 | 8.85 |")
    assert "| tf-fp32 | mixed (cross-bot) | 16 clients |" in md


def test_a_tf_fp32_serving_choice_has_no_second_run_to_check():
    results = passing_results()
    results["service"]["tf_fp32"] = {"same_as_serving_choice": True}
    t = _by_key(evaluate_targets(results))
    for key in ("service_tf_fp32_trunk_in_server_c16", "service_tf_fp32_request_path_cpu_c16",
                "service_tf_fp32_p50_c1", "service_tf_fp32_bound_c16"):
        assert t[key].status == SKIP and "the serving choice is TF fp32" in t[key].note
    assert "The serving choice is TF fp32: no second server." in render_markdown(results)
    del results["service"]["tf_fp32"]  # not measured (the run stopped before it): a miss
    t = _by_key(evaluate_targets(results))
    assert t["service_tf_fp32_bound_c16"].status == FAIL
