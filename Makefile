# The two commands of the README: `make run` (the notebooks, headless, writing data/)
# and `make test`. Both create .venv on first use.
PY := .venv/bin/python

.PHONY: run test env
env:
	@bash scripts/setup-env

run: env
	$(PY) -m kvlab notebooks

test: env
	$(PY) -m pytest
