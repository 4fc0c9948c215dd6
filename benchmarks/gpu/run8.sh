#!/usr/bin/env bash
# Eighth GPU pass (tenth session): the 0.5b batch-1 latency bench again, after the warm-up prompt
# became as long as the first request's (run7.sh saw the first round's prefill compile its kernels).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m flashllm bench latency --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --baseline transformers --baseline-batch-sizes 1 --roofline --repeats 2 --json "$OUT/latency-0.5b.json" > "$OUT/latency.log" 2>&1; echo "latency rc $?"
python3 benchmarks/gpu/latency_summary.py "$OUT/latency-0.5b.json"
