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
		-e packages/parallel -e "packages/models[hf]" -e "packages/train[hf,tensorboard,wandb]" -e packages/dashboard \
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

# The quickstart: prepare the default corpus (once), start the dashboard in the background on
# 127.0.0.1:$(PORT) (pid and log in .cache/), train configs/quickstart-cpu.yaml streaming to it.
PORT ?= 8008
run: setup
	$(PY) -m nanotron_train.quickstart run --port $(PORT)

# Stops the dashboard that `make run` started.
stop:
	@if test -x $(PY); then $(PY) -m nanotron_train.quickstart stop; fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
