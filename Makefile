# The two commands of the README: `make run` (the notebooks, headless, writing data/)
# and `make test`. Both create .venv on first use.
PY := .venv/bin/python

.PHONY: run test env figures
env:
	@bash scripts/setup-env

run: env
	$(PY) -m kvlab notebooks

test: env
	$(PY) -m pytest

# Redraw every figure from the committed results in data/results (measures nothing).
figures: env
	$(PY) -m kvlab notebooks --from-results
