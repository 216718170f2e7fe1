# The two commands of the README: `make run` (the notebooks, headless, writing data/)
# and `make test`. Both create .venv on first use.
PY := .venv/bin/python

.PHONY: run test test-extended conformance env figures lab
env:
	@bash scripts/setup-env

# PROFILE=standard (default: minutes; the slowest engine sweeps are drawn from the committed
# paper results) or PROFILE=paper (every sweep measured here: over an hour on 2 cores).
PROFILE ?= standard

run: env
	$(PY) -m kvlab notebooks --profile $(PROFILE)

# Two pytest workers: the engines the tests start compute on one thread each (OMP_NUM_THREADS=1),
# so two workers fill a 2-core machine; --dist loadgroup keeps a module's shared engine run on one worker.
# `make test` is everything but the extended engine suite, which `make test-extended` runs (CI runs both).
test: env
	$(PY) -m pytest -n 2 --dist loadgroup --durations=25 -m "not extended"

test-extended: env
	$(PY) -m pytest -n 2 --dist loadgroup --durations=25 -m extended

# KVLabConnector's driver-level tests against the newest vLLM's code (requirements/vllm-next.txt,
# put in front of .venv's packages by scripts/setup-vllm-next), on the CPU; CI runs it too.
CONFORMANCE := tests/conformance tests/connector tests/harness/test_driver.py tests/harness/test_worker_calls.py \
               tests/harness/test_call_recorder.py
conformance: env
	@bash scripts/setup-vllm-next
	PYTHONPATH=.venv-vllm-next $(PY) -m pytest -n 2 --dist loadgroup -m "not extended" $(CONFORMANCE)

# Redraw every figure from the committed results in data/results (measures nothing), and render
# docs/results.md from them. `make run` leaves that page alone: commit the runs it measured, then this.
figures: env
	$(PY) -m kvlab notebooks --from-results

# JupyterLab on working copies of the notebooks (lab/), on 127.0.0.1 (as root too: containers often run as root).
lab: env
	$(PY) -m kvlab lab
