#!/usr/bin/env bash
# The torch model's checks on a GPU machine, in one bounded run, into one OUTDIR/gpu.md.
#   sudo scripts/gpu_check.sh [OUTDIR]       (default $OUT, else /tmp/gpu_check)
# It bootstraps itself on a bare machine that reaches no registry: the first python with a CUDA
# torch (PY, .venv/bin/python, python3); wheels in .whl/ installed into a temporary site
# (pyroute2, zlib-ng, grpcio, protobuf); Mininet and the network tools it lacks from
# .gpu-tools/ (appended to PATH, so the machine's own come first); the gRPC stubs generated if
# missing. `scripts/gpu_pack.sh DIR` prepares all of that here (docs/gpu.md says how to call it).
# Each step has its own timeout, all of them bounded by GPU_CHECK_BUDGET_S (default 330) in
# total, so one hang cannot eat the machine's time; a failing step is reported and the next
# one still runs. Steps that need root, namespaces or Mininet say so and are skipped without.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
MD=$OUT/gpu.md
END=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-330} ))
export PYTHONUNBUFFERED=1
: > "$MD"

step() {  # step NAME TIMEOUT_S CMD...   (bounded by what is left of the budget)
  local name=$1 t=$2 left; shift 2
  left=$(( END - $(date +%s) ))
  (( left < t )) && t=$left
  echo "## $name" | tee -a "$MD"
  echo '```' >> "$MD"
  echo "\$ $*" >> "$MD"
  if (( t < 5 )); then
    echo "skipped: the time budget is spent" | tee -a "$MD"
  else
    local t0=$SECONDS
    timeout -k 5 "$t" "$@" 2>&1 | tee -a "$MD"
    echo "exit ${PIPESTATUS[0]} after $(( SECONDS - t0 )) s" | tee -a "$MD"
  fi
  echo '```' >> "$MD"
}
note() { echo "$*" | tee -a "$MD"; }

# ---- bootstrap ----
PY=
for c in ${PY_CANDIDATE:-} .venv/bin/python python3; do
  if "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
  then PY=$(command -v "$c"); break; fi
done
if [ -z "$PY" ]; then
  for c in ${PY_CANDIDATE:-} .venv/bin/python python3; do
    "$c" -c "import torch" 2>/dev/null && { PY=$(command -v "$c"); break; }
  done
  note "no python with a CUDA torch found: CUDA steps will fail (python: ${PY:-none})"
fi
SITE=${TMPDIR:-/tmp}/gpu_check_site
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl 2>&1 | tail -3 >> "$MD"
fi
export PYTHONPATH=$ROOT${SITE:+:$SITE}
if [ -d .gpu-tools ]; then
  export PATH=$PATH:$ROOT/.gpu-tools/bin
  PYTHONPATH=$PYTHONPATH:$ROOT/.gpu-tools/python
  for f in .gpu-tools/delayline/tb-delayline-*; do   # where delayline_binary() looks first
    [ -f "$f" ] || continue
    dst=${XDG_CACHE_HOME:-$HOME/.cache}/prfaas-testbed/$(basename "$f")
    [ -e "$dst" ] && continue
    mkdir -p "$(dirname "$dst")"
    printf '#!/bin/sh\nexec /lib64/ld-linux-x86-64.so.2 --library-path %s %s "$@"\n' \
      "$ROOT/.gpu-tools/lib" "$ROOT/$f" > "$dst"
    chmod +x "$dst"
  done
fi
if [ ! -f testbed/proto/testbed_pb2.py ] && "$PY" -c "import grpc_tools" 2>/dev/null; then
  make -s proto PY="$PY" >/dev/null 2>&1 || note "generating the gRPC stubs failed"
fi
IS_ROOT=0; [ "$(id -u)" = 0 ] && IS_ROOT=1
HAVE_NS=0
if (( IS_ROOT )) && command -v ip >/dev/null && "$PY" -c "import pyroute2" 2>/dev/null; then
  ip netns add tbgpuprobe 2>/dev/null && ip netns del tbgpuprobe && HAVE_NS=1
fi
HAVE_MN=0
"$PY" -c "import mininet.net" 2>/dev/null && command -v mnexec >/dev/null && (( HAVE_NS )) && HAVE_MN=1

# ---- the machine ----
step "machine" 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
  uname -sr; nproc; echo python: $PY; echo root=$IS_ROOT namespaces=$HAVE_NS mininet=$HAVE_MN"
step "torch" 60 "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, \
  'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"

# ---- correctness ----
step "unit tests: the model on CUDA and on CPU" 120 \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_model_cuda.py tests/test_model.py
step "selfcheck cuda fp32 (loopback)" 60 "$PY" -m testbed.cli selfcheck --device cuda --loopback
step "selfcheck cuda fp32, 4K prompt (loopback)" 60 \
  "$PY" -m testbed.cli selfcheck --device cuda --loopback --prompt-len 4096
step "selfcheck cuda bf16, tolerance 5e-2 (loopback)" 60 \
  "$PY" -m testbed.cli selfcheck --device cuda --dtype bfloat16 --tol 5e-2 --loopback
if (( HAVE_NS )); then
  step "selfcheck cuda fp32 across two namespaces" 60 "$PY" -m testbed.cli selfcheck --device cuda
else
  note "selfcheck across namespaces: skipped (needs root, ip and pyroute2)"
fi

# ---- speed ----
step "model_step cuda fp32" 150 "$PY" benchmarks/model_step.py --device cuda \
  --lengths 1024 4096 16384 65536
step "model_step cuda bf16" 75 "$PY" benchmarks/model_step.py --device cuda --dtype bfloat16 \
  --lengths 1024 4096 16384 65536

# ---- real workers ----
if (( HAVE_MN )) && [ -f experiments/torch_small.yaml ]; then
  step "doctor" 30 "$PY" -m testbed.cli doctor
  RUNS=${TMPDIR:-/tmp}/gpu_check_runs
  step "torch_small on cuda" 180 "$PY" -m testbed.cli run experiments/torch_small.yaml \
    --set model.device=cuda --out "$RUNS"
  step "clean" 30 "$PY" -m testbed.cli clean
  tar czf "$OUT/torch_small.tgz" -C "$RUNS" . 2>/dev/null   # summaries and worker logs
else
  note "torch_small: skipped (needs root, namespaces, Mininet and mnexec; see .gpu-tools)"
fi
step "model_step cpu fp32, same machine" 60 "$PY" benchmarks/model_step.py --device cpu \
  --lengths 1024 4096 --repeat 1 --steps 10
if (( HAVE_NS )); then
  step "kv_transfer" 60 "$PY" benchmarks/kv_transfer.py --repeat 3 --timeout 50
fi
echo "wrote $MD"
