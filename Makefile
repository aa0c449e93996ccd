# The two commands: `make run` (quickstart) and `make test` (the whole suite, as CI runs it).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint format clean stop chromium npm postgres dist

# A fresh virtual environment with the four packages editable and the dev tools.
$(STAMP): constraints.txt pyproject.toml packages/*/pyproject.toml VERSION
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=25.1"
	$(PY) -m pip install -q -c constraints.txt \
		-e packages/parallel -e "packages/models[hf]" -e "packages/train[hf,tensorboard,wandb,eval]" -e "packages/dashboard[postgresql]" \
		--group dev
	touch $(STAMP)

# Debian's Chromium drives the browser tests through Playwright (never `playwright install`:
# the machines are offline). Needs root, as on the development and CI machines.
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# Debian's PostgreSQL server: the dashboard's tests run their API, ingest, websocket and browser
# subset on it too (they initdb and start their own server in a temporary directory, as the
# `postgres` user; under CI=true a missing server fails them). Needs root, like chromium.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq postgresql >/dev/null; }

# npm fetches the uPlot tarball that tests/packaging checks the committed copy against.
npm:
	@command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq npm >/dev/null; }

setup: $(STAMP)

# The suite includes tests/packaging: it builds the four sdists and wheels and installs them
# into fresh virtual environments (the dashboard alone; parallel + models + train alone).
# --durations: the slowest tests in the log, where the suite's time budget is watched.
test: setup chromium npm postgres
	$(PY) -m pytest --durations=30

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

# An sdist and a wheel of each package, in dist/ (one version for all four: the VERSION file).
dist: setup
	for p in parallel models train dashboard; do $(PY) -m build --outdir dist packages/$$p || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache dist
