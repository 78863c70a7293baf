# Two entry points: `make demo` and `make test`. Both install what they need and are idempotent.
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin
PLAN   ?= qualification/plans/calc-tool-cpu.yaml
DEMO_STACKS ?= trl,openenv
# DEMO_ENGINE=docker or podman runs the demo in stack images (a running engine: DOCKER_HOST, RUNNER_PODMAN_HOST).
DEMO_ENGINE ?= local
STAMP   = $(VENV)/.installed
TEST_STAMP = $(VENV)/.installed-test
BENCH_STAMP = $(VENV)/.installed-bench

.PHONY: demo test test-fast test-engines test-families test-harnesses test-domains bench schema clean python-deps system-deps

# Host environment: the runner CLI, contracts, tasks/gates (no torch, no upstream stacks); the suite adds
# its test tools.
$(STAMP): pyproject.toml contracts/pyproject.toml qualification/pyproject.toml kit/pyproject.toml
	$(MAKE) python-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e contracts -e qualification -e kit -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(TEST_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[bench]'
	touch $(BENCH_STAMP)

# Debian packages. The demo needs Python 3.11 with venv (host and stacks) and bubblewrap (the local
# engine's sandbox; without it jobs run unsandboxed and the evidence says so); the suite also
# needs Chromium (the HTML report test), Docker Engine, Podman (runc) and debootstrap (the container
# engines' tests start their own daemons), Slurm and munge (the cluster tests start a one-node cluster).
# Each target only runs apt when something it needs is missing.
DEMO_PACKAGES = python3.11 python3.11-venv bubblewrap
TEST_PACKAGES = $(DEMO_PACKAGES) chromium docker.io podman runc debootstrap slurm-wlm munge
python-deps:
	@if ! command -v $(PYTHON) >/dev/null || ! $(PYTHON) -c 'import venv, ensurepip' 2>/dev/null \
	    || ! command -v bwrap >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEMO_PACKAGES); fi
system-deps:
	@if ! command -v $(PYTHON) >/dev/null || ! $(PYTHON) -c 'import venv, ensurepip' 2>/dev/null \
	    || ! command -v bwrap >/dev/null || ! command -v chromium >/dev/null || ! command -v dockerd >/dev/null || ! command -v podman >/dev/null \
	    || ! command -v debootstrap >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(TEST_PACKAGES); fi

demo: $(STAMP)
	$(BIN)/runner stacks list
	$(BIN)/runner compare --stacks $(DEMO_STACKS) --plan $(PLAN) --engine $(DEMO_ENGINE)

test: system-deps $(TEST_STAMP)
	$(BIN)/python -m pytest -q -ra --durations=40

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -ra -m 'not slow'

# Every stack compared under Podman as well as Docker (~15 min more than the suite's budget holds).
test-engines: system-deps $(TEST_STAMP)
	RUNNER_TEST_ALL_ENGINES=1 $(BIN)/python -m pytest -q -ra tests/test_containers.py

# The tiny Llama and Mistral through four arms each (~20 min more than the suite's budget holds).
test-families: system-deps $(TEST_STAMP)
	RUNNER_TEST_ALL_FAMILIES=1 $(BIN)/python -m pytest -q -ra tests/test_tiny_families.py

# lm-evaluation-harness beside Inspect AI as evaluation harnesses (~1.5 min more than the suite's budget holds).
test-harnesses: system-deps $(TEST_STAMP)
	RUNNER_TEST_ALL_HARNESSES=1 $(BIN)/python -m pytest -q -ra tests/test_harnesses.py

# The mace domain stack qualified on its own CPU plan (~4 min more than the suite's budget holds).
test-domains: system-deps $(TEST_STAMP)
	RUNNER_TEST_ALL_DOMAINS=1 $(BIN)/python -m pytest -q -ra tests/test_domain.py

bench: system-deps $(BENCH_STAMP)
	$(BIN)/python bench/bench_validate.py --gigabytes 10  # the scale line needs ~10 GB free under $$TMPDIR or RUNNER_BENCH_TMP
	$(BIN)/python bench/bench_overhead.py
	$(BIN)/python bench/bench_environments.py
	$(BIN)/python bench/bench_arms.py
	$(BIN)/python bench/bench_policy_server.py
	$(BIN)/python bench/bench_engines.py
	$(BIN)/python bench/bench_slurm_render.py
	$(BIN)/python bench/results.py

schema: $(STAMP)
	$(BIN)/python -m runner_contracts.schema contracts/schema

clean:
	rm -rf $(VENV) runs .pytest_cache
