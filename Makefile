# One command sets up and runs each main job:
#   make serve   - create .venv, install, start the HTTP service on 127.0.0.1:8000 (shipped models; ARGS="--port N ...")
#   make test    - create .venv, install, run the whole test suite (what .ci/run calls)
#   make test-quick - the quick loop: every test but those marked slow (no Ray, browser or other server)
#   make bench   - the engine benchmark on the shipped model (figures, not a test; docs/performance.md)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-quick bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip >/dev/null || true
	# A pinned CPU build of torch is tried first (it lies on disk on the project's machines, so the
	# install stays small there); anywhere else the normal torch install follows.
	$(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q torch
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/python -m service $(ARGS)

bench: setup
	$(BIN)/python -m service.bench_engine --parts a,b,c,d --rounds 3

test: setup
	bash deploy/install_browser.sh   # chromium + chromedriver for tests/test_explorer.py
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-quick: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

clean:
	rm -rf $(VENV)
