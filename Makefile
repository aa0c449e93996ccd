# The two commands: `make run` (quickstart) and `make test` (the whole suite, as CI runs it).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint format clean stop chromium

# The dashboard's charting library (uPlot), pinned by its package-lock.json and copied into the
# package's git-ignored static folder.
DASH_VENDOR := packages/dashboard/src/nanotron_dashboard/static/vendor/uPlot.iife.min.js

# A fresh virtual environment with the four packages editable and the dev tools.
$(STAMP): constraints.txt pyproject.toml packages/*/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=25.1"
	$(PY) -m pip install -q -c constraints.txt \
		-e packages/parallel -e "packages/models[hf]" -e "packages/train[hf]" -e packages/dashboard \
		--group dev
	touch $(STAMP)

$(DASH_VENDOR): packages/dashboard/frontend/package-lock.json
	packages/dashboard/build_assets.sh

# Debian's Chromium drives the browser tests through Playwright (never `playwright install`:
# the machines are offline). Needs root, as on the development and CI machines.
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

setup: $(STAMP) $(DASH_VENDOR)

test: setup chromium
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

run: setup
	@echo "make run: the quickstart (train the tiny Llama on the CPU and stream it to the dashboard)"
	@echo "is filled in by the trainer, data and dashboard issues; nothing to run yet."

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
