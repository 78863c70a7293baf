# Two entry points: `make demo` and `make test`. Both install what they need and are idempotent.
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin
PLAN   ?= qualification/plans/calc-tool-cpu.yaml
DEMO_STACKS ?= trl,openenv
# DEMO_ENGINE=docker or podman runs the demo in stack images (a running engine: DOCKER_HOST, RUNNER_PODMAN_HOST).
DEMO_ENGINE ?= local
STAMP   = $(VENV)/.installed

.PHONY: demo test test-fast bench schema lint clean system-deps

# Host environment: the runner CLI, contracts, tasks/gates, test tools (no torch, no upstream stacks).
$(STAMP): pyproject.toml contracts/pyproject.toml qualification/pyproject.toml kit/pyproject.toml
	$(MAKE) system-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e contracts -e qualification -e kit -e '.[test]'
	touch $(STAMP)

# Debian packages: Python 3.11 with venv (host and stacks), Chromium (the HTML report test), Docker
# Engine, Podman (runc) and debootstrap (the container engines' tests start their own daemons), Slurm
# and munge (the cluster tests start a one-node cluster). Only runs apt when something is missing.
SYSTEM_PACKAGES = python3.11 python3.11-venv chromium docker.io podman runc debootstrap slurm-wlm munge
system-deps:
	@if ! command -v $(PYTHON) >/dev/null || ! $(PYTHON) -c 'import venv, ensurepip' 2>/dev/null \
	    || ! command -v chromium >/dev/null || ! command -v dockerd >/dev/null || ! command -v podman >/dev/null \
	    || ! command -v debootstrap >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES); fi

demo: $(STAMP)
	$(BIN)/runner stacks list
	$(BIN)/runner compare --stacks $(DEMO_STACKS) --plan $(PLAN) --engine $(DEMO_ENGINE)

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m 'not slow'

bench: $(STAMP)
	$(BIN)/python bench/bench_validate.py
	$(BIN)/python bench/bench_overhead.py
	$(BIN)/python bench/bench_environments.py
	$(BIN)/python bench/bench_engines.py

schema: $(STAMP)
	$(BIN)/python -m runner_contracts.schema contracts/schema

clean:
	rm -rf $(VENV) runs .pytest_cache
