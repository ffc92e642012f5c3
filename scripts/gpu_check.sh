#!/usr/bin/env bash
# The torch model's checks on a GPU machine, in one bounded run; output goes to docs/gpu.md form.
#   sudo scripts/gpu_check.sh [OUTDIR]       (root: selfcheck and kv_transfer build namespaces)
# Each step has its own timeout so one hang cannot eat the machine's time; a failing step is
# reported and the next one still runs. Needs a CUDA build of torch in .venv.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
PY=.venv/bin/python
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 t=$2; shift 2
  echo "## $name" | tee -a "$OUT/gpu.md"
  echo '```' >> "$OUT/gpu.md"
  echo "\$ $*" >> "$OUT/gpu.md"
  timeout "$t" "$@" 2>&1 | tee -a "$OUT/gpu.md"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu.md"
  echo '```' >> "$OUT/gpu.md"
}
: > "$OUT/gpu.md"
step "GPU" 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
step "torch" 60 $PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"
step "selfcheck cuda fp32" 180 $PY -m testbed.cli selfcheck --device cuda
step "selfcheck cuda fp32, 4K prompt" 180 $PY -m testbed.cli selfcheck --device cuda --prompt-len 4096
step "selfcheck cuda bf16 (tolerance 5e-2)" 180 $PY -m testbed.cli selfcheck --device cuda --dtype bfloat16 --tol 5e-2
step "unit tests" 180 $PY -m pytest -q tests/test_model.py tests/test_selfcheck.py
step "model_step cuda" 300 $PY benchmarks/model_step.py --device cuda --lengths 1024 4096 16384
step "kv_transfer" 300 $PY benchmarks/kv_transfer.py --timeout 280
if [ -f experiments/torch_small.yaml ]; then
  step "torch_small on cuda" 300 $PY -m testbed.cli run experiments/torch_small.yaml --set model.device=cuda
fi
echo "wrote $OUT/gpu.md"
