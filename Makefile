# Two entry points for a fresh machine: `make serve` and `make test`. Both create .venv and
# install the package (with its test, bench, openvino, postgres, ray, grpc and otel extras) into it;
# `make test` also installs the Debian packages its tests need (chromium, postgresql). Nothing
# else needs to be installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
STORE  ?= checkpoints
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: venv lint test serve demo bench clean browser-deps postgres-deps system-deps mutation \
        fuzz

venv: $(STAMP)

# The packages are installed by uv (pinned below; itself installed with the venv's pip): the
# same versions pip resolves, in about 20 s instead of about 2 min on 2 cores.
UV_VERSION := 0.13.9
UV := $(BIN)/uv pip install --python $(BIN)/python -q

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/python -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(UV) -e '.[test,bench,openvino,postgres,ray,grpc,otel]'
	touch $@

# Debian's chromium and the chromedriver of the same build, for tests/service/transports/test_browser.py
# (needs root or sudo for apt-get; CI runs as root).
browser-deps:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; \
	fi

# ruff, with the rules chosen in pyproject.toml; a finding fails `make test` (and CI).
lint: $(STAMP)
	$(BIN)/ruff check .

# PostgreSQL 15's server binaries (Debian's postgresql package), for the tests that start a
# throw-away server (bench/pgserver.py, one per test session: tests/support/postgres.py) as an
# unprivileged user. Only the binaries are used:
# the cluster Debian creates is never started by the tests.
PG_BIN := /usr/lib/postgresql/15/bin
postgres-deps:
	@if [ ! -x $(PG_BIN)/initdb ] || [ ! -x $(PG_BIN)/pg_ctl ]; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql; \
	fi

system-deps: browser-deps postgres-deps

# Two worker processes (pytest-xdist), each test file in one of them (its module fixtures are
# built once; the files using the session's INT8 calibration share a worker: tests/conftest.py):
# the tests wait on subprocesses, servers and sockets about half of the time, so
# two workers use the 2 cores of a CI machine where one leaves one idle (three: measured no
# faster, 425-500 s against 454-461 s, the CPU-bound tests slowing each other). The Ray tests
# (tests/scaleout) run at the same time in a pytest of their own (their output follows the
# first run's; `make` fails if either failed): their local Ray cluster waits for its replicas
# up to 300 s, and their timing checks allow a busy machine. A failed first run's failures are
# printed again at the very end, which is the part of the output a CI log shows (the first
# run's output goes through tee for that, unbuffered, and in colour on a terminal).
# TEST_WORKERS=0 runs the first phase in one process, one test after another. Both runs share
# one temporary directory for the session's checkpoint and the graphs built from it
# (MULTIHEAD_TEST_SHARED_DIR: made once, under a lock, imported by the other worker and the Ray
# run), removed at the end.
# Bytecode is written while the tests run, even where the environment says
# PYTHONDONTWRITEBYTECODE (uv installs no .pyc): else every one of the suite's Python
# processes (workers, servers, CLI calls, Ray replicas) compiles TensorFlow's, Ray's, ... sources
# again (measured: `import tensorflow` 13 s of CPU in a fresh venv, 9.5 s once compiled), and
# pytest rewrites every test module's asserts again in each worker.
TEST_WORKERS ?= 2
test: lint system-deps
	unset PYTHONDONTWRITEBYTECODE && \
	shared=$$(mktemp -d -t multihead-tests.XXXXXX) && trap 'rm -rf "$$shared"' EXIT && \
	export MULTIHEAD_TEST_SHARED_DIR="$$shared" && \
	{ $(BIN)/python -m pytest --durations=5 tests/scaleout >"$$shared/scaleout.log" 2>&1 & \
	  ray=$$!; } && \
	color=no && if [ -t 1 ]; then color=yes; fi && \
	{ PYTHONUNBUFFERED=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile \
	    --durations=10 --color=$$color --ignore=tests/scaleout; echo $$? >"$$shared/first.rc"; \
	} 2>&1 | tee "$$shared/first.log"; \
	first=$$(cat "$$shared/first.rc"); \
	second=0 && wait $$ray || second=$$?; \
	echo "== tests/scaleout (run beside the above)" && cat "$$shared/scaleout.log"; \
	if [ "$$first" -ne 0 ]; then \
	  echo "== the first run failed (exit $$first): its failures again, from above"; \
	  sed 's/\x1b\[[0-9;]*m//g' "$$shared/first.log" \
	    | grep -E '^(FAILED|ERROR) |^=+ .*(failed|error|passed).* in [0-9.]+s|^(INTERNALERROR|E +)' \
	    | tail -60; \
	fi; \
	test "$$first" -eq 0 && test $$second -eq 0

# First run: demo trunk, generated images, demo bots, then the INT8 trunk whose gate judges
# them (about 3-7 min); later runs reuse them.
demo: $(STAMP)
	$(BIN)/multihead demo --store $(STORE)

# The demo serves without API keys on loopback only, so that the page works as it is; any other
# HOST serves with keys (docs/user-guide.md#tenants-and-keys).
SERVE_AUTH := $(if $(filter 127.0.0.1 localhost ::1,$(HOST)),none,keys)
serve: demo
	$(BIN)/multihead serve --store $(STORE) --host $(HOST) --port $(PORT) --auth $(SERVE_AUTH)

# Mutation testing of the core modules with mutmut (its own target: about half an hour on 2
# cores, not part of `make test` or CI). Fresh run each time, then a score per module (>= 85%).
MUTATION_CHILDREN ?= 2
mutation: $(STAMP)
	test -x $(BIN)/mutmut || $(UV) -e '.[test,mutation]'
	rm -rf mutants
	@start=$$(date +%s); \
	$(BIN)/mutmut run --max-children $(MUTATION_CHILDREN) > mutmut-run.log 2>&1 \
	  || { tail -40 mutmut-run.log; exit 1; }; \
	echo "mutmut run: $$(( $$(date +%s) - start )) s (log: mutmut-run.log)"
	$(BIN)/python tests/mutation_report.py --survivors

# The fuzz tests with 20,000 hostile HTTP requests instead of `make test`'s 2,000, and the fair
# scheduler's properties on 3,000 random traces each instead of 100.
fuzz: $(STAMP)
	MULTIHEAD_FUZZ_CASES=20000 $(BIN)/python -m pytest -q tests/fuzz
	MULTIHEAD_FAIR_EXAMPLES=3000 $(BIN)/python -m pytest -q tests/service/core/test_fair.py

bench: $(STAMP)
	$(BIN)/multihead bench --quick --output bench-out

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
