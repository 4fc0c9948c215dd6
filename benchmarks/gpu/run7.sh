#!/usr/bin/env bash
# Seventh GPU pass (tenth session): a regression check of the cuda path after four CPU-side sessions
# (bench rounds and probes, the split C kernels, chat, roofline changes). Cuda conformance and the
# engine's GPU parity tests, then the 0.5b batch-1 latency bench in 2 rounds with the roofline.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__)"
timeout 200 python3 -m pytest tests/conformance/test_kernels.py tests/conformance/test_backend_greedy_parity.py tests/gpu tests/unit/test_cuda_scaled_mm.py -k "cuda or gpu or scaled_mm" -q -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/conformance.log" | tail -6
timeout 170 python3 -m flashllm bench latency --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --baseline transformers --baseline-batch-sizes 1 --roofline --repeats 2 --json "$OUT/latency-0.5b.json" > "$OUT/latency.log" 2>&1; echo "latency rc $?"
tail -25 "$OUT/latency.log"
