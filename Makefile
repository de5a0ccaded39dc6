# Two commands on a fresh machine: `make demo` and `make test`. Everything else is installed here.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint install clean routers

$(STAMP): pyproject.toml dispatcher/_cacheindex.c dispatcher/_scoring.c dispatcher/_orders.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## routers: the SGLang gateway from PyPI for `sluice bench-routers`, in its two current forms,
## each in its own venv (both packages install a `smg` command)
ROUTERS := .venv-routers
ROUTERS_STAMP := $(ROUTERS)/.installed-sglang-router-0.3.2-smg-1.13.0
$(ROUTERS_STAMP):
	rm -rf $(ROUTERS)
	$(PYTHON) -m venv $(ROUTERS)/sglang-router
	$(ROUTERS)/sglang-router/bin/python -m pip install --quiet 'sglang-router==0.3.2'
	$(PYTHON) -m venv $(ROUTERS)/smg
	$(ROUTERS)/smg/bin/python -m pip install --quiet 'smg==1.13.0'
	touch $(ROUTERS_STAMP)

routers: $(ROUTERS_STAMP)

## demo: embedded NATS, a dispatcher, 4 simulated GPU workers and a mixed workload for ~30 s
demo: $(STAMP)
	$(BIN)/sluice demo

## test: the whole suite, fault tests and tiny benchmark runs included, against a real nats-server
## (TEST_WORKERS pytest processes at once: most tests wait on timers, leases and redeliveries,
## so 4 finish in about a third of the time of one on 2 cores; TEST_WORKERS=0 runs one)
TEST_WORKERS ?= 4
test: $(STAMP) $(ROUTERS_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

## test-fast: the inner loop, without the slow fault/soak tests and the tiny benchmark runs
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) -m "not fault and not bench"

## lint: ruff (with the complexity rule), the formatter, mypy and the import contracts (mypy
## and lint-imports see the sluice.* package through the symlinks in sluice/)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy -p sluice
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) $(ROUTERS) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
	rm -f dispatcher/_cacheindex*.so dispatcher/_scoring*.so dispatcher/_orders*.so
