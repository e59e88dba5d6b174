#!/usr/bin/env bash
# Everything that needs a GPU, in one go, with its output in one log:
#   1. torch with CUDA and kvrelay._C built with the CUDA kernel
#      (an existing CUDA torch via PYTHON=..., or `make setup` with TORCH_SPEC);
#   2. make cuda-check (nvcc alone), then make test-gpu (the gpu-marked tests);
#   3. kvrelay bench layout --device cuda and bench transfer --device cuda.
# Usage: scripts/gpu-check.sh [OUT_DIR]   (default gpu-check-out/)
#   PYTHON=/path/python   a Python whose torch has CUDA (no network needed:
#                         the extension is built in place with it)
#   TORCH_SPEC=...        else pip arguments for `make setup` (network needed)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
status=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "machine"
nvidia-smi -L || { echo "gpu-check: no nvidia-smi / GPU"; exit 1; }
uptime

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  step "build kvrelay in place with $PY"
  "$PY" -m pip install -q -r requirements-dev.txt || echo "gpu-check: pip failed (offline?), going on"
  "$PY" setup.py build_ext --inplace || exit 1
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  run_tests() { timeout 900 "$PY" -m pytest -m gpu -q; }
else
  TORCH_SPEC=${TORCH_SPEC:-"torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"}
  step "make setup TORCH_SPEC=$TORCH_SPEC"
  make setup TORCH_SPEC="$TORCH_SPEC" || exit 1
  PY=.venv/bin/python
  run_tests() { timeout 900 make test-gpu; }
fi

step "torch and the extension"
"$PY" - <<'PYEOF' || exit 1
import torch
from kvrelay.cuda_ext.backend import compiled_module
C = compiled_module()
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
assert torch.cuda.is_available(), "torch sees no GPU"
assert C is not None and C.with_cuda, "kvrelay._C was built without CUDA (nvcc, CUDA_HOME?)"
PYEOF

step "make cuda-check"
make cuda-check || status=1

step "gpu-marked tests"
run_tests || status=1

step "kvrelay bench layout --device cuda"
"$PY" -m kvrelay.cli bench layout --device cuda --json "$OUT/bench-layout-cuda.json" || status=1
step "kvrelay bench transfer --device cuda"
"$PY" -m kvrelay.cli bench transfer --device cuda --json "$OUT/bench-transfer-cuda.json" \
  || status=1
uptime
echo; echo "gpu-check: exit $status; log and JSON in $OUT/"
exit $status
