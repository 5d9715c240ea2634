#!/usr/bin/env bash
# The Python base image the Kairos images build on, on machines where the public one cannot be
# pulled (no registry access): a Debian bookworm root made with debootstrap from the host's APT
# mirror (Python 3.11, venv, pip, CA certificates; the host's CA bundle trusted, so pip works
# behind the same TLS proxy as the host), loaded with `docker import`.
#
#   scripts/docker-base-image.sh            print the image to build on (pulled or made here)
#
# Prints one line on stdout: the image name to pass as --build-arg PYTHON_IMAGE / KAIROS_PYTHON_IMAGE.
# Tries, in order: the image already present; `docker pull` of $KAIROS_PYTHON_IMAGE
# (python:3.11-slim-bookworm); the cached tarball $KAIROS_DOCKER_CACHE/kairos-base-bookworm.tar
# (default ~/.cache/kairos-docker); debootstrap (root, ~2 min, ~150 MB; Debian's debootstrap package
# is installed when missing), saved to that tarball.
set -euo pipefail
say() { printf '[docker-base-image] %s\n' "$*" >&2; }

PUBLIC=${KAIROS_PYTHON_IMAGE:-python:3.11-slim-bookworm}
LOCAL=kairos-base:bookworm
CACHE=${KAIROS_DOCKER_CACHE:-$HOME/.cache/kairos-docker}
TARBALL=$CACHE/kairos-base-bookworm.tar

if docker image inspect "$PUBLIC" >/dev/null 2>&1; then echo "$PUBLIC"; exit 0; fi
if timeout 60 docker pull -q "$PUBLIC" >/dev/null 2>&1; then say "pulled $PUBLIC"; echo "$PUBLIC"; exit 0; fi
say "cannot pull $PUBLIC: using a local Debian base ($LOCAL)"
if docker image inspect "$LOCAL" >/dev/null 2>&1; then echo "$LOCAL"; exit 0; fi
if [[ -s "$TARBALL" ]]; then
  say "importing the cached root $TARBALL"
else
  [[ $(id -u) -eq 0 ]] || { say "making the base image needs root (debootstrap)"; exit 3; }
  if ! command -v debootstrap >/dev/null; then  # as test-all installs Chromium: Debian's package, as root
    say "installing debootstrap (Debian's package)"
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap; } >/dev/null 2>&1 \
      || { say "debootstrap is missing and apt-get install debootstrap failed"; exit 3; }
  fi
  # The host's own Debian mirror (it is reachable: apt works here).
  mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  mirror=${mirror:-$(awk '$1=="deb" && $3=="bookworm" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
  [[ -n "$mirror" ]] || { say "no Debian bookworm mirror in the host's APT sources (/etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list): set one there, or pull $PUBLIC"; exit 3; }
  root=$(mktemp -d /tmp/kairos-base-root.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  say "debootstrap bookworm from $mirror (about 2 minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
      bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; say "debootstrap failed (log above)"; exit 1; }
  rm -f "$root.log"
  # Trust what the host trusts (a TLS-inspecting proxy's CA, a private index's CA).
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  mkdir -p "$CACHE"
  tar -C "$root" --numeric-owner -cf "$TARBALL.part" .
  mv "$TARBALL.part" "$TARBALL"
fi
docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$TARBALL" "$LOCAL" >/dev/null
say "made $LOCAL ($(du -h "$TARBALL" | cut -f1) root)"
echo "$LOCAL"
