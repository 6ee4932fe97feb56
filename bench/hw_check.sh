#!/usr/bin/env bash
# One command for a machine with AVX-512 / AVX512-BF16 / AMX (or any x86 CPU): builds flashsdpa
# without the emulated test tiers, prints what the CPU offers, runs the correctness suite on
# every tier the CPU runs natively, then benchmarks each of those tiers against PyTorch's own
# kernel in one process (forward, forward+backward, decode) and prints compact tables.
# Then prints where each tier's forward, backward and decode time go (bench/phase_profile.py:
# packing, the GEMMs against the peak, the softmax, scheduling) and each tier's micro-kernels on
# their own (bench/tile_probe.py), the first diagnosis on a new tier (AMX).
# About 7-9 minutes on a few cores. Results: bench/results/hw_*.json / .csv.
set -euo pipefail
cd "$(dirname "$0")/.."
export FLASHSDPA_NO_EMULATED=1   # the emulated tiers are for CPUs that lack the instructions
make build >/dev/null
PY=.venv/bin/python
$PY -m flashsdpa
lscpu 2>/dev/null | grep -iE "model name|^flags" | sed 's/^Flags:/flags:/' | cut -c1-200 || true

echo; echo "== correctness, every native tier (tests parametrised by tier)"
$PY -m pytest -q -x -p no:cacheprovider -k "not emu-" \
  tests/test_correctness.py tests/test_masks.py tests/test_dropout.py tests/test_backward.py \
  tests/test_decode.py

TIERS=$($PY -c "from flashsdpa import _C; print(','.join('flashsdpa@' + t['name'] for t in _C.tiers() if t['built'] and t['cpu_ok'] and t['name'] != 'portable'))")
echo; echo "== bench, tiers: ${TIERS}"
$PY bench/bench_sdpa.py --mode fwd --providers "${TIERS},torch_flash" --dtypes fp32,bf16 \
  --causal no --shapes 1x16x1024x64,1x8x2048x128 --repeats 3 --tag hw_fwd --out-dir bench/results
$PY bench/bench_sdpa.py --mode train --providers "${TIERS},torch_flash" --dtypes fp32,bf16 \
  --causal yes --shapes 1x16x1024x64 --repeats 3 --tag hw_train --out-dir bench/results
$PY bench/bench_sdpa.py --mode decode --providers "${TIERS},torch_flash" --dtypes fp32,bf16 \
  --shapes 1x32x4096x128,1x32/8x8192x128 --repeats 5 --tag hw_decode --out-dir bench/results

echo; echo "== where the forward's time goes, per tier (bench/phase_profile.py: step shares, GEMM % of peak)"
$PY bench/phase_profile.py --calls 3 --json bench/results/hw_phases.json
echo; echo "== the micro-kernels on their own, per tier (bench/tile_probe.py: GEMM and fused-exp S GEMM, % of peak)"
$PY bench/tile_probe.py --json bench/results/hw_tiles.json
echo; echo "== where the backward's time goes, per tier (bench/phase_profile.py --train: step shares, each GEMM's % of peak)"
$PY bench/phase_profile.py --train --shapes 1x16x1024x64 --calls 3 --json bench/results/hw_bwd_phases.json
echo; echo "== where decode's time goes, per tier (bench/phase_profile.py --decode: step shares, K+V GB/s)"
$PY bench/phase_profile.py --decode 1x32x8x16384x128,1x8x8x16384x128 --dtypes fp32,bf16,fp8 \
  --calls 3 --json bench/results/hw_decode_phases.json
