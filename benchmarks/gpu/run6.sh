#!/usr/bin/env bash
# Sixth GPU pass: fp8 and quant conformance after the fixes and new tile defaults, prefill
# attention against SDPA flash, and the 0.5b decode profile.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest tests/conformance/test_kernels.py tests/unit/test_cuda_scaled_mm.py -k "(cuda and (quant_matmul or paged)) or scaled_mm" -q -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/conformance.log" | tail -4
timeout 60 python3 benchmarks/gpu/prefill_vs_sdpa.py 2>&1 | tail -5
timeout 120 python3 benchmarks/gpu/decode_profile.py --batch 1,64,256 2>&1 | grep -v "Loading\|Writing" | head -5
