# Two entry points for a fresh machine: `make serve` and `make test`. Both create .venv and
# install the package (with its test and bench extras) into it; nothing else needs to be
# installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
STORE  ?= checkpoints
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: venv lint test serve demo bench clean browser-deps

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $@

# Debian's chromium and the chromedriver of the same build, for tests/service/test_browser.py
# (needs root or sudo for apt-get; CI runs as root).
browser-deps:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; \
	fi

# ruff, with the rules chosen in pyproject.toml; a finding fails `make test` (and CI).
lint: $(STAMP)
	$(BIN)/ruff check .

test: lint browser-deps
	$(BIN)/python -m pytest

# First run: demo trunk, generated images and demo bots (about 1-2 min); later runs reuse them.
demo: $(STAMP)
	$(BIN)/multihead demo --store $(STORE)

serve: demo
	$(BIN)/multihead serve --store $(STORE) --host $(HOST) --port $(PORT)

bench: $(STAMP)
	$(BIN)/multihead bench --quick --output bench-out

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
