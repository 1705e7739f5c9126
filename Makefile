# The two commands of the README. Both create .venv on first use (CPU torch first, then the project).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The exact versions `make test` last passed with: a release made after that cannot break the demo or CI of a
# fresh clone (pyproject.toml keeps the ranges a `pip install` of the package accepts). `make constraints`
# moves them to today's releases.
CONSTRAINTS := infra/constraints.txt
TORCH := torch==2.13.0
WHEELS := $(wildcard /opt/wheels)
PIP_LINKS := $(if $(WHEELS),--find-links $(WHEELS),)

.PHONY: demo test test-fast lint example-assets bench constraints

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA build. Installed compiled
	# (no --no-compile): with PYTHONDONTWRITEBYTECODE set, as on CI machines, every process would compile torch anew.
	$(PY) -m pip install -q $(PIP_LINKS) $(TORCH)
	$(PY) -m pip install -q $(PIP_LINKS) -c $(CONSTRAINTS) -e '.[dev,serving]'
	touch $(STAMP)

# Resolve pyproject.toml's ranges afresh in a scratch venv and pin what they give today; then run `make test`
# (it reinstalls .venv from the new pins) and commit infra/constraints.txt only when it passes.
constraints:
	rm -rf .venv-resolve && $(PYTHON) -m venv .venv-resolve
	.venv-resolve/bin/python -m pip install -q --upgrade pip
	.venv-resolve/bin/python -m pip install -q $(PIP_LINKS) $(TORCH)
	.venv-resolve/bin/python -m pip install -q $(PIP_LINKS) -e '.[dev,serving]'
	{ echo "# Exact versions for make (see the Makefile): written by 'make constraints' on $$(date -u +%F)."; \
	  .venv-resolve/bin/python -m pip freeze --exclude-editable | sed 's/+cpu$$//'; } > $(CONSTRAINTS)
	rm -rf .venv-resolve

demo: $(STAMP)
	PREFECT_SERVER_ANALYTICS_ENABLED=false WANDB_MODE=offline $(VENV)/bin/dflash demo

TEST_ENV := DFLASH_HOME=$${DFLASH_HOME:-$(CURDIR)/.dflash-cache} PREFECT_SERVER_ANALYTICS_ENABLED=false WANDB_MODE=offline

# Two pytest workers, a test file each at a time: run one after another, the tests kept 1.2 of the 2 cores busy
# (they wait on servers and subprocesses), and the demo test alone runs ~10 minutes: conftest puts it first, and
# --no-loadscope-reorder keeps that order (xdist would otherwise start the files with the most tests first).
PYTEST_WORKERS ?= 2

# Lint and the example assets side by side: mypy keeps one core busy, the example build the other (~1.5 minutes
# saved on 2 cores); a lint failure still fails `make test`.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint example-assets
	$(TEST_ENV) $(PY) -m pytest -m "not gpu" -q --durations=15 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The example assets the tests use: built once, then reused from $$DFLASH_HOME.
example-assets: $(STAMP)
	$(TEST_ENV) $(VENV)/bin/dflash example > /dev/null

# The fast lane: unit tests only (no torchrun, no Prefect server runs), under two minutes on 2 cores.
test-fast: example-assets
	$(TEST_ENV) $(PY) -m pytest -m "not slow and not gpu" -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Style, the layers (dflash_app > flows > dflash_core; no Prefect in dflash_core), types of the library and flows.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench.tokenize_bench
	$(PY) -m bench.plan --markdown
	$(PY) -m bench.pipeline
