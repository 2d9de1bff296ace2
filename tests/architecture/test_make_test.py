"""`make test`'s own recipe, run by make with a stand-in for the venv's python (so that no
test runs twice): it fails when either of its two pytest runs fails, and a failed first run's
failures come again at the very end of the output, after the Ray run's, where a CI log's tail
shows them (a CI run once failed with a log that named no test)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Stands in for `.venv/bin/python -m pytest ...`: the first run (the one that ignores
# tests/scaleout) prints a failure and exits FIRST_RC; the Ray run exits RAY_RC.
FAKE_PYTHON = """#!/bin/sh
case "$*" in
  *--ignore=tests/scaleout*)
    echo "tests/a.py .F"
    echo "E       AssertionError: boom"
    echo "FAILED tests/a.py::test_b - AssertionError: boom"
    echo "========= 1 failed, 1 passed in 2.00s ========="
    echo "(the first run's last line)"
    exit "$FIRST_RC";;
  *tests/scaleout*)
    echo "========= 26 passed in 1.00s ========="
    exit "$RAY_RC";;
esac
exit 99
"""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def run_make_test(tmp_path, first_rc: int, ray_rc: int = 0) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    env.update(FIRST_RC=str(first_rc), RAY_RC=str(ray_rc))
    # -o: lint and the Debian packages are not this test's subject (nor run by it).
    return subprocess.run(["make", "-s", "-o", "lint", "-o", "system-deps", "test",
                           f"BIN={bin_dir}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def test_a_failed_first_run_is_named_again_at_the_end(tmp_path):
    out = run_make_test(tmp_path, first_rc=1)
    assert out.returncode != 0, out.stdout
    lines = out.stdout.splitlines()
    ray = lines.index("== tests/scaleout (run beside the above)")
    tail = lines[ray:]
    assert "FAILED tests/a.py::test_b - AssertionError: boom" in tail
    assert "E       AssertionError: boom" in tail
    # The failure's lines are the last ones, the first run's summary line closing them.
    assert tail[-1] == "========= 1 failed, 1 passed in 2.00s =========", tail
    assert "(the first run's last line)" not in tail  # only the failure's lines come again


def test_passing_runs_pass_and_print_nothing_again(tmp_path):
    out = run_make_test(tmp_path, first_rc=0)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "========= 26 passed in 1.00s =========", lines
    assert lines.count("FAILED tests/a.py::test_b - AssertionError: boom") == 1  # as printed


def test_a_failed_ray_run_fails_make_test(tmp_path):
    out = run_make_test(tmp_path, first_rc=0, ray_rc=1)
    assert out.returncode != 0, out.stdout


def test_the_files_make_test_starts_first_exist():
    """`tests/conftest.py` orders the slowest files first by path: a moved or renamed file would
    silently lose its place (and a worker would start it last)."""
    from tests.conftest import SLOW_FIRST

    assert [path for path in SLOW_FIRST if not (REPO / path).is_file()] == []
