# Everything runs from the virtual environment in .venv (created on first use).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS ?= torch,tensorflow,html,dev,test

.PHONY: install demo test lint typecheck unit e2e bench goldens gpu-check clean screenshot

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'

# Runs nondet on a bundled fixture with real CPU nondeterminism (exit code 1 = found, as expected).
demo:
	$(MAKE) install EXTRAS=torch
	$(BIN)/nondet run fixtures/torch/index_put_backward.py; code=$$?; \
	  if [ $$code -ne 1 ]; then echo "demo: expected exit code 1 (nondeterminism found), got $$code"; exit 1; fi

# Two pytest workers by default (pytest-xdist), each given whole files (module fixtures made
# once, a file's tests in order); XDIST= for one process. Never hangs: a test over 600 s is
# stopped (pytest-timeout, pyproject.toml); a worker that dies (a timeout, an abort, a kill)
# fails its test and ends the run (--max-worker-restart 0: xdist's restart re-runs the crashed
# test's file and could wait for good); pytest itself is stopped after SUITE_LIMIT seconds
# (80 min, inside CI's 90: a hang no test sees, e.g. in xdist itself).
XDIST ?= -n 2 --dist loadfile --max-worker-restart 0
SUITE_LIMIT ?= 4800

# Keras 2 (tf_keras) for its capture tests, without its dependencies: its wheel asks for the
# `tensorflow` package, which would install a second, GPU build of TensorFlow beside
# tensorflow-cpu (the same module, pinned to 2.21 in pyproject.toml).
TF_KERAS ?= tf_keras==2.21.*

test: install lint typecheck
	./tools/ensure-chromium
	$(BIN)/pip install --quiet --no-deps '$(TF_KERAS)'
	timeout --signal=INT --kill-after=60 $(SUITE_LIMIT) \
	  $(BIN)/python -m pytest -q $(XDIST) --durations=50; code=$$?; \
	  if [ $$code -eq 124 ]; then echo "make test: pytest ran over $(SUITE_LIMIT) s and was stopped"; fi; \
	  exit $$code

lint:
	$(BIN)/ruff check nondet tests fixtures bench

typecheck:
	$(BIN)/mypy nondet

unit: install
	$(BIN)/python -m pytest -q $(XDIST) -m "not e2e"

e2e: install
	$(BIN)/python -m pytest -q $(XDIST) -m e2e

# Rewrites tests/data/report_expected.txt after an intended change to the text report.
goldens: install
	NONDET_UPDATE_GOLDENS=1 $(BIN)/python -m pytest -q tests/test_report.py

# The README's picture: the HTML report of a bundled fixture, opened in Chromium.
screenshot: install
	rm -rf /tmp/nondet-screenshot
	$(BIN)/nondet run --out /tmp/nondet-screenshot --html /tmp/nondet-screenshot/report.html \
	  fixtures/torch/index_put_backward.py > /dev/null; test $$? -eq 1
	$(BIN)/python -m tests.e2e.browser /tmp/nondet-screenshot/report.html docs/html-report.png

bench: install
	$(BIN)/python bench/bench.py --write docs/benchmarks.md

# The CUDA paths (docs/architecture.md, "GPU: written, not yet run") on a real GPU: the GPU
# test file, then the benchmark. Without a CUDA device it says so and succeeds. Run after
# `make install` (it does not install anything itself).
gpu-check:
	@if $(BIN)/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; \
	then $(BIN)/python -m pytest -q tests/gpu && $(BIN)/python bench/bench.py --framework torch; \
	else echo "gpu-check: no CUDA device on this machine; nothing was run (run it on a GPU machine)"; fi

clean:
	rm -rf .nondet build *.egg-info .pytest_cache .ruff_cache .mypy_cache
