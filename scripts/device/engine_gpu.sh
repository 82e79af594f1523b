#!/usr/bin/env bash
# The engine on a CUDA machine: every model family's exactness against transformers in float32 and bf16, and the
# engine benchmark, with every model on the GPU (speculation/bench/gpu_check.py says what is compared and why).
# Under 5 minutes; prints JSON and writes it to $1 (default engine_gpu.json). Exit 2: no CUDA device here.
# Python: $ACE_PYTHON, else ACE's venv, else python3 (torch, transformers, safetensors, tokenizers installed).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${ACE_PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x "$HOME/.cache/ace/venv/bin/python" ]; then PYTHON="$HOME/.cache/ace/venv/bin/python"; else PYTHON=python3; fi
fi
exec timeout 300 "$PYTHON" -m speculation.bench.gpu_check --device cuda --dtype bfloat16 \
  --json "${1:-engine_gpu.json}"
