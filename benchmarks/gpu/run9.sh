#!/usr/bin/env bash
# Ninth GPU pass (eleventh session): the bench's probes now return a ceiling and a sustained rate
# (roofline.Reading); the accelerator plan keeps its copy probe as both. Check the GPU latency
# bench and the bench's unit tests still run on a GPU after that change.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_bench_gpu_paths.py tests/unit/test_bench_repeats.py > "$OUT/tests.log" 2>&1; echo "tests rc $?"; tail -3 "$OUT/tests.log"
timeout 200 python3 -m flashllm bench latency --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --baseline transformers --baseline-batch-sizes 1 --roofline --repeats 2 --json "$OUT/latency-0.5b.json" > "$OUT/latency.log" 2>&1; echo "latency rc $?"
tail -5 "$OUT/latency.log"
python3 benchmarks/gpu/latency_summary.py "$OUT/latency-0.5b.json"
