# The two commands of the README: `make run` (the notebooks, headless, writing data/)
# and `make test`. Both create .venv on first use.
PY := .venv/bin/python

.PHONY: run test env figures lab
env:
	@bash scripts/setup-env

run: env
	$(PY) -m kvlab notebooks

test: env
	$(PY) -m pytest

# Redraw every figure from the committed results in data/results (measures nothing).
figures: env
	$(PY) -m kvlab notebooks --from-results

# JupyterLab on the notebooks, on 127.0.0.1 (as root too: containers often run as root).
lab: env
	$(PY) -m jupyterlab notebooks/ --ip=127.0.0.1 $$([ "$$(id -u)" = 0 ] && echo --allow-root)
