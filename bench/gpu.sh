#!/usr/bin/env bash
# One-GPU benchmark (no arguments, under 8 minutes on one H200, no network, synthetic tokens):
# a ~1B Llama in bf16 with fp32 accumulation, seq 2048, SDPA (and flash-attn if importable),
# with and without recompute_layer; then tp all-reduce bytes per step vs the formula.
# Writes $OUT/gpu_bench.json when OUT is set. See bench/gpu_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
# Works without installing the packages: only PyTorch, PyYAML and safetensors are needed.
export PYTHONPATH="packages/parallel/src:packages/models/src:packages/train/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, yaml, safetensors" 2>/dev/null || {
  echo "bench/gpu.sh needs torch, pyyaml and safetensors importable by $PY" >&2; exit 2; }
exec timeout 470 "$PY" bench/gpu_bench.py
