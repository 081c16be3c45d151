# Every target creates .venv itself: on a fresh machine `make run` or `make test` is all it takes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP_RUN := $(VENV)/.installed-run
STAMP_DEV := $(VENV)/.installed-dev
LISTEN ?= tcp://127.0.0.1:4170
PYTEST_ARGS ?=
# make test runs the suite on PYTEST_WORKERS pytest-xdist workers, then the tests marked serial (those
# that time a child process and must not compete with a second worker for the CPU) alone.
PYTEST_WORKERS ?= 2
# exit status 5: the selection (PYTEST_ARGS) has no test in that pass
PYTEST = $(PY) -m pytest -q -p no:cacheprovider
PARALLEL = $(PYTEST) -n $(PYTEST_WORKERS) -m "not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]
SERIAL = $(PYTEST) -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

.PHONY: run test test-full lint schemas bench clean

$(PY):
	@echo "acp-server: creating $(VENV) with $(PYTHON) (needs Python >= 3.11 with its venv module)" >&2
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP_RUN): pyproject.toml | $(PY)
	@echo "acp-server: installing acp-server and its dependencies into $(VENV) (about a minute the first time)" >&2
	$(PY) -m pip install -e .
	touch $@

$(STAMP_DEV): pyproject.toml | $(PY)
	@echo "acp-server: installing acp-server with the dev extras into $(VENV) (a few minutes the first time)" >&2
	$(PY) -m pip install -e '.[dev]'
	touch $@ $(STAMP_RUN)

run: $(STAMP_RUN)
	@echo "acp-server: serving the echo agent on $(LISTEN); in another terminal of this checkout: $(VENV)/bin/acp-server prompt --connect $(LISTEN) \"hello\" (editors: $(CURDIR)/$(VENV)/bin/acp-server connect $(LISTEN))" >&2
	$(VENV)/bin/acp-server serve --listen $(LISTEN)

lint: $(STAMP_DEV)
	$(VENV)/bin/ruff check acp_server tests
	$(VENV)/bin/mypy

test: $(STAMP_DEV) lint
	$(PARALLEL)
	$(SERIAL)

test-full: $(STAMP_DEV)
	export ACP_SERVER_FULL=1; $(PARALLEL)
	export ACP_SERVER_FULL=1; $(SERIAL)

schemas: $(STAMP_DEV)
	$(PY) -m acp_server.schemagen schemas

# Benchmarks (a few minutes; not part of make test): Markdown to stdout, JSON to bench/results/latest.json.
bench: $(STAMP_DEV)
	$(PY) bench/run.py

.PHONY: bench-smoke
bench-smoke: $(STAMP_DEV)
	$(PY) bench/run.py --tiny --out bench/results/tiny.json

clean:
	rm -rf $(VENV) build *.egg-info
