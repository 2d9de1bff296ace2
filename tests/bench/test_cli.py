"""The command line of the benchmark: `multihead bench` and `python -m bench`, their flags, the
plan they make, `--check`'s exit code. The run itself is replaced by synthetic results."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli, runner
from bench.__main__ import main as bench_main
from bench.plan import Plan
from bench.sections import NAMES
from tests.bench.helpers import isolation_targets, passing_results

REPO = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multihead bench")
    cli.add_arguments(parser)
    return parser


def _run_with(monkeypatch, tmp_path, results, *argv):
    monkeypatch.setattr(runner, "run", lambda plan, out_dir, **options: results)
    return bench_main(["--output", str(tmp_path / "out"), "--no-progress", *argv])


def test_check_exits_nonzero_when_a_target_is_missed(monkeypatch, tmp_path, capsys):
    results = passing_results()
    results["scale"]["registration_p50_ms"] = 35.0
    assert _run_with(monkeypatch, tmp_path, results, "--check") == 1
    out = capsys.readouterr().out
    assert "[FAIL] registration p50 <= 20 ms: 35 ms (target <= 20 ms)" in out
    assert "[PASS] 10-bot fan-out" in out
    assert (tmp_path / "out" / "bench.md").exists()


def test_check_exits_zero_when_every_target_is_met(monkeypatch, tmp_path, capsys):
    assert _run_with(monkeypatch, tmp_path, passing_results(), "--check") == 0
    assert capsys.readouterr().out.count("[PASS]") == 44 + isolation_targets()  # 7: deadlines


def test_without_check_a_miss_does_not_change_the_exit_code(monkeypatch, tmp_path, capsys):
    results = passing_results()
    results["scale"]["registration_p50_ms"] = 35.0
    assert _run_with(monkeypatch, tmp_path, results) == 0
    assert "[FAIL]" not in capsys.readouterr().out


def test_run_takes_the_parsed_flags(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(runner, "run", lambda plan, out_dir, **options: passing_results())
    args = _parser().parse_args(["--output", str(tmp_path), "--sections", "scale", "--check"])
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("[PASS]") == 3 and out.count("[SKIP]") == 41 + isolation_targets()
    assert (tmp_path / "bench.json").exists()


def test_inconsistent_flags_are_one_line_and_exit_2(tmp_path, capsys):
    assert bench_main(["--output", str(tmp_path), "--bots", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "multihead bench: error: --bots must be >= 10 (the fan-out scores 10 bots)")
    with pytest.raises(ValueError, match="--classes"):
        cli.run(_parser().parse_args(["--classes", "1"]))


def test_python_dash_m_bench_answers_help():
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: multihead bench") and "--scale-touch-max" in proc.stdout


def test_an_unknown_section_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("the run must not start"))
    assert bench_main(["--output", str(tmp_path), "--sections", "trunk,gpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        "multihead bench: error: unknown section(s) gpu; choose from " + ",".join(NAMES))
    assert bench_main(["--output", str(tmp_path), "--sections", ","]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "multihead bench: error: unknown section(s) (none); choose from trunk,")


def test_multihead_bench_refuses_an_unknown_section_in_one_line(capsys):
    from cli.main import main

    assert main(["bench", "--sections", "gpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        "multihead bench: error: unknown section(s) gpu; choose from " + ",".join(NAMES))


def _plan_of(monkeypatch, argv) -> Plan:
    seen = []

    def fake_run(plan, out_dir, **options):
        seen.append(plan)
        return passing_results()

    monkeypatch.setattr(runner, "run", fake_run)
    cli.run(_parser().parse_args(argv))
    return seen[0]


def test_quick_plan_shrinks_counts_not_kinds(monkeypatch, tmp_path, capsys):
    out = ["--output", str(tmp_path)]
    plan = _plan_of(monkeypatch, out + ["--quick", "--sections", "service,trunk", "--bots", "20"])
    assert plan.quick and plan.sections == ("service", "trunk") and plan.bots == 20
    assert plan.concurrency == (1, 16) and max(plan.scale_levels) == 1000
    assert plan.trunk_runs >= 5 and plan.closed_requests(16) == 64
    full = _plan_of(monkeypatch, out)
    assert full.concurrency == (1, 4, 16, 32) and max(full.scale_levels) == 10_000
    assert full.sections == NAMES and full.bots == 100 and full.full_models == 4


def test_multihead_cli_mounts_the_same_flags():
    """`multihead bench` (cli) parses exactly the flags of `python -m bench`."""
    from cli.main import build_parser

    parser = build_parser()
    argv = ["--quick", "--sections", "scale", "--bots", "20", "--concurrency", "1,2"]
    assert vars(parser.parse_args(["bench", *argv])).items() >= vars(
        _parser().parse_args(argv)).items()
