# Two entry points for a fresh machine: `make serve` and `make test`. Both create .venv and
# install the package (with its test extras) into it; nothing else needs to be installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
STORE  ?= checkpoints
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: venv test serve bench clean

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest

serve: $(STAMP)
	$(BIN)/multihead serve --store $(STORE) --host $(HOST) --port $(PORT)

bench: $(STAMP)
	$(BIN)/multihead bench --quick --output bench-out

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
