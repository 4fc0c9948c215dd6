#!/usr/bin/env bash
# Third GPU pass: quant conformance after the GEMV rewrite, the graph-timed tile sweep, and the
# decode-step profile of the 0.5b shape (bf16 and w8a16).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest tests/conformance/test_kernels.py -k "cuda and quant_matmul" -q -p no:cacheprovider --tb=line 2>&1 | tail -3
timeout 200 python3 benchmarks/gpu/gemv_sweep.py --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log"
timeout 120 python3 benchmarks/gpu/decode_profile.py 2>&1 | grep -v "Loading\|Writing" | tee "$OUT/profile.log"
timeout 90 python3 benchmarks/gpu/decode_profile.py --quant_type w8a16 --batch 1 2>&1 | grep -v "Loading\|Writing" | head -5
