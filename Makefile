# Every target creates .venv itself: on a fresh machine `make run` or `make test` is all it takes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP_RUN := $(VENV)/.installed-run
STAMP_DEV := $(VENV)/.installed-dev
LISTEN ?= tcp://127.0.0.1:4170
HTTP_LISTEN ?= http://127.0.0.1:4171
PYTEST_ARGS ?=
# make test runs the suite on PYTEST_WORKERS pytest-xdist workers (exit status 5: PYTEST_ARGS selected no test).
PYTEST_WORKERS ?= 2
PARALLEL = $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) $(PYTEST_ARGS) || [ $$? -eq 5 ]

.PHONY: run test test-full lint schemas bench bench-instr bench-instr-record clean

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
	@echo "acp-server: ACP over HTTP and WebSocket at $(HTTP_LISTEN)/acp (GET $(HTTP_LISTEN)/health)" >&2
	$(VENV)/bin/acp-server serve --listen $(LISTEN) --http-listen $(HTTP_LISTEN)

lint: $(STAMP_DEV)
	$(VENV)/bin/ruff check acp_server tests
	$(VENV)/bin/mypy

# The coordinator's tests run against Debian's redis-server, installed here when missing.
.PHONY: redis-server
redis-server:
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

# qwen's SDK for tests/test_http_qwen_sdk.py (test-only; it declares node >= 22, what the tests use runs on 20)
NODE_STAMP := tests/node/node_modules/.installed
$(NODE_STAMP): tests/node/package.json tests/node/package-lock.json
	cd tests/node && npm ci --no-audit --no-fund --engine-strict=false
	touch $@

test: $(STAMP_DEV) lint redis-server chromium $(NODE_STAMP)
	$(PARALLEL)

test-full: $(STAMP_DEV) redis-server chromium $(NODE_STAMP)
	export ACP_SERVER_FULL=1; $(PARALLEL)
	$(PY) bench/instr.py

schemas: $(STAMP_DEV)
	$(PY) -m acp_server.schemagen schemas

# Benchmarks (a few minutes; not part of make test): Markdown to stdout, JSON to bench/results/latest.json.
bench: $(STAMP_DEV) $(NODE_STAMP)
	$(PY) bench/run.py

.PHONY: bench-smoke
bench-smoke: $(STAMP_DEV) $(NODE_STAMP)
	$(PY) bench/run.py --tiny --out bench/results/tiny.json

# The console's browser tests drive Debian's chromium (Playwright's own browser download is never used).
.PHONY: chromium screenshots
chromium:
	@command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# docs/console-*.png: both views of the web console at 1280x800, a real server under a little load,
# and the cluster view of two replicas on a real redis-server.
screenshots: $(STAMP_DEV) chromium redis-server
	$(PY) docs/screenshots.py docs

# Instructions per echo prompt under callgrind (about a minute), against bench/instr_baseline.json:
# fails above +10%, skips when CPython or valgrind differ from the baseline's. -record re-records it.
bench-instr: $(STAMP_DEV)
	$(PY) bench/instr.py

bench-instr-record: $(STAMP_DEV)
	$(PY) bench/instr.py --record

clean:
	rm -rf $(VENV) build *.egg-info
