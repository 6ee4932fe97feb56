#!/usr/bin/env bash
# One command for a machine with a GPU (Intel xpu, or NVIDIA cuda through Triton's NVIDIA
# backend): builds flashsdpa (no emulated CPU tiers), prints the device, runs the Triton tier's
# tests natively on the GPU (tests/test_triton.py picks the GPU when PyTorch sees one), then
# benchmarks the Triton kernels against PyTorch's own SDPA on that device (forward, forward +
# backward, the sliding window, serving: KV-cache decode and varlen) and sweeps the forward's
# launch configurations. Within 8 minutes (the deadline below). Results:
# bench/results/gpu_*.json.
#
#   bench/gpu_check.sh            # device picked automatically (xpu first, then cuda)
#   DEVICE=cuda bench/gpu_check.sh
# The Python environment must have a PyTorch build for the device (PY=/path/to/python to pick
# one; default .venv/bin/python after `make build`).
set -euo pipefail
cd "$(dirname "$0")/.."
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-450} ))
PY=${PY:-.venv/bin/python}
if [ "$PY" = .venv/bin/python ]; then make deps >/dev/null; fi
DEVICE=${DEVICE:-$($PY -c "import torch; print('xpu' if hasattr(torch, 'xpu') and torch.xpu.is_available() else 'cuda' if torch.cuda.is_available() else '')")}
if [ -z "$DEVICE" ]; then echo "gpu_check: PyTorch sees no xpu or cuda device" >&2; exit 2; fi
export FLASHSDPA_NO_EMULATED=1   # emulated CPU tiers are not needed here
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  if [ "$PY" = .venv/bin/python ]; then make build >/dev/null
  else $PY -m pip install --quiet --no-build-isolation --no-deps --no-index --use-pep517 -e . ; fi
fi
unset TRITON_INTERPRET
$PY -c "import torch, triton; d=getattr(torch, '$DEVICE'); print('device:', d.get_device_name(0), '| torch', torch.__version__, '| triton', triton.__version__)"
lscpu 2>/dev/null | grep -iE "model name" || true

# Every step runs under a share of one deadline (GPU_CHECK_SECONDS, default 450, counted from
# the script's start, the build included: the device tool's call is 8 minutes), so that the
# call always comes back with what finished; a step that fails or runs out of time does not
# stop the later ones. The exit status is the first failing step's.
status=0
step() {  # step CAP_SECONDS command...: at most CAP seconds, and never past the deadline
  local cap=$1; shift
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -le 5 ]; then
    echo "gpu_check: no time left for: $*" >&2; [ "$status" -ne 0 ] || status=124; return
  fi
  [ "$cap" -lt "$left" ] || cap=$left
  local rc=0
  timeout "$cap" "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then echo "gpu_check: rc $rc from: $*" >&2; [ "$status" -ne 0 ] || status=$rc; fi
}

echo; echo "== Triton tier tests on $DEVICE"
# Compiling every kernel variant dominates a cold run (one process did not finish the suite in
# the time below on an H200), so the tests spread over pytest-xdist workers where installed.
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8" || true)
step 240 $PY -m pytest -q --maxfail=5 -p no:cacheprovider $XDIST tests/test_triton.py

echo; echo "== bench on $DEVICE (Triton kernels vs PyTorch's SDPA)"
# (1x16x8192x128: the shape of the issue's TFLOP/s targets, bf16 D = 128, L = 8192)
SHAPES=4x16x1024x64,2x16x2048x128,1x32/8x4096x128,8x16x512x256,1x16x8192x128
step 90 $PY bench/bench_sdpa.py --device "$DEVICE" --mode fwd --dtypes fp16,bf16 \
  --shapes "$SHAPES" --repeats 5 --tag gpu_fwd --out-dir bench/results
step 90 $PY bench/bench_sdpa.py --device "$DEVICE" --mode train --dtypes fp16,bf16 \
  --causal yes --shapes "$SHAPES" --repeats 5 --tag gpu_train --out-dir bench/results
# sliding window (1024, 0) against plain causal at L = 8192 (the tiles outside the band skipped)
step 60 $PY bench/bench_variants.py --device "$DEVICE" --cases window --modes fwd,train \
  --dtypes bf16 --repeats 5 --out bench/results/gpu_variants.json
# serving: decode and chunked prefill over contiguous / paged / fp8 caches (the split-KV kernel,
# % of the GPU's read bandwidth) and packed varlen prefill (one launch over cu_seqlens) against
# PyTorch's SDPA (gathered / padded) and the per-sequence loop
step 60 $PY bench/bench_serving.py --device "$DEVICE" --dtypes bf16 --repeats 5 \
  --out bench/results/gpu_serving.json
# the forward's launch configurations at L = 8192, D = 128 (bf16, causal): which one
# kernels/configs.py should take on this GPU
step 60 $PY bench/tune_triton.py --device "$DEVICE" --causal --shape 1x16x8192x128 \
  --out bench/results/gpu_tune.json
exit $status
