#!/usr/bin/env bash
# The GPU check, the one script to run when a GPU host is at hand: everything under OUT_DIR, a
# summary at the end, bounded to about 8 minutes (--budget-s 450 plus start-up; killed at 9.5;
# the CPU smoke run gets 15).
#
#   scripts/gpu-check.sh [OUT_DIR]           on a host with an NVIDIA GPU, PyTorch with CUDA, no network
#   scripts/gpu-check.sh --tiny [OUT_DIR]    CPU smoke run with tiny shapes (what the tests run)
#
# OUT_DIR defaults to $OUT when set (the device machines' output folder), else gpu-check-results/.
# In order, each stage bounded by what is left of the budget (bench/gpu_check.py):
# 1. step times of a Llama-3-8B-shaped model (random weights, plain PyTorch): prefill chunks
#    128-8192 at contexts up to 32k, decode batches 1-256, mixed steps (a chunk beside decodes),
#    fitted to Kairos's step-time model: gpu-check.json, gpu-check-profile.json;
# 2. `kairos kv-bench` when NIXL is importable: host memory (kv-bench-dram.json) and, on CUDA,
#    GPU memory registered as VRAM (kv-bench-vram.json);
# 3. when vLLM 0.32.0 is installed (the kairos:gpu image): bench/gpu_vllm.py, vLLM on this
#    platform with Kairos's scheduler (async scheduling off, step records checked against vLLM's),
#    KV handed off over NIXL from GPU memory, `disagg-least-loaded` against `kairos` on a short
#    burst, identical greedy tokens: gpu-vllm.json, bench-*.json, gpu-vllm-logs/.
# gpu-check.log holds everything printed. Exit 0 when every stage that ran passed.
# PYTHON picks the interpreter (default: .venv/bin/python when it has torch, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
tiny=()
if [[ "${1:-}" == "--tiny" ]]; then tiny=(--tiny); shift; fi
out=${1:-${OUT:-gpu-check-results}}
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch' 2>/dev/null && PYTHON=.venv/bin/python
fi
"$PYTHON" -c 'import torch, numpy, msgspec' 2>/dev/null \
  || { echo "gpu-check: $PYTHON lacks torch, numpy or msgspec (pip install torch numpy msgspec)" >&2; exit 2; }
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c 'import torch; print("gpu-check:", torch.__version__, "CUDA", torch.version.cuda,
  [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] or "no CUDA device")' | tee "$out/gpu-check.log"
budget=450 limit=570                  # a GPU host: well under the 10 minutes a lent machine allows
[[ ${#tiny[@]} -gt 0 ]] && budget=900 limit=990  # CPU: two vLLM clusters start in minutes on a loaded VM
timeout -k 10 "$limit" "$PYTHON" -W ignore -m bench.gpu_check "${tiny[@]}" --budget-s "$budget" --out "$out" 2>&1 \
  | tee -a "$out/gpu-check.log"
