#!/usr/bin/env bash
# Validate the compose files without a Docker daemon, with Debian's Compose v1 (`docker-compose`).
#
#   scripts/check-compose.sh            install docker-compose if missing (needs root), then validate
#   scripts/check-compose.sh --no-install   fail (rc 3) instead of installing when it is missing
#
# Checked: docker-compose.yml (GPU), docker-compose.yml + docker-compose.rdma.yml,
# docker-compose.sim.yml (the simulated cluster, standalone; both with the `observability` profile's
# Prometheus and Grafana), docker-compose.multihost.yml
# (containers as hosts) and docker-compose.replicas.yml (two routers behind HAProxy). `config -q` parses, interpolates and checks each file against the
# compose schema (reservations, ports, depends_on, healthchecks); `config --services` must list
# exactly the services we expect. Nothing is built or started, and no daemon is needed or
# contacted (see docs/reference/workloads.md section 7).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf '[check-compose] %s\n' "$*"; }

install=1
for arg in "$@"; do
  case "$arg" in
    --no-install) install=0 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

if ! command -v docker-compose >/dev/null 2>&1; then
  if [[ $install -eq 0 ]]; then
    say "docker-compose is not installed (apt-get install -y --no-install-recommends docker-compose)"
    exit 3
  fi
  if [[ $(id -u) -ne 0 ]]; then
    say "docker-compose is missing and installing it needs root"
    exit 3
  fi
  say "installing Debian's docker-compose (Compose v1; no Docker daemon needed)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi
say "$(docker-compose version --short 2>/dev/null || docker-compose --version)"

# Validate against the defaults, not whatever KAIROS_* the caller's shell happens to export.
unset $(compgen -e | grep -E '^(KAIROS_|UCX_)' || true)
# An operator's .env beside the files would change the defaults: validate with an empty one.
empty_env="$(mktemp)"
trap 'rm -f "$empty_env"' EXIT
envfile=(--env-file "$empty_env")

fail=0
check() {  # check "<label>" "<expected services>" -f FILE [-f FILE...]
  local label="$1" want="$2"; shift 2
  if ! docker-compose "${envfile[@]}" "$@" config -q; then
    say "FAIL $label: docker-compose config rejected it (above)"
    fail=1
    return
  fi
  local got
  got="$(docker-compose "${envfile[@]}" "$@" config --services | sort | xargs)"
  if [[ "$got" != "$want" ]]; then
    say "FAIL $label: services are [$got], expected [$want]"
    fail=1
    return
  fi
  say "ok   $label ($got)"
}

services="decode-0 decode-1 keys monitor prefill-0 prefill-1 router"
# docker-compose.yml and docker-compose.sim.yml also hold the `observability` profile (Prometheus,
# Grafana): `config` lists every service, whatever the profiles
observed="decode-0 decode-1 grafana keys monitor prefill-0 prefill-1 prometheus router router-1"  # two routers on the HTTP port
check "docker-compose.yml" "$observed" -f docker-compose.yml
check "docker-compose.yml + docker-compose.rdma.yml" "$observed" -f docker-compose.yml -f docker-compose.rdma.yml
check "docker-compose.sim.yml" "$observed" -f docker-compose.sim.yml
check "docker-compose.sim.yml --profile observability" "$observed" -f docker-compose.sim.yml --profile observability
check "docker-compose.multihost.yml" "$services" -f docker-compose.multihost.yml
check "docker-compose.replicas.yml" "decode-0 decode-1 keys lb monitor prefill-0 prefill-1 router-a router-b" \
  -f docker-compose.replicas.yml

if [[ $fail -ne 0 ]]; then
  say "compose validation failed"
  exit 1
fi
say "all compose files valid"
