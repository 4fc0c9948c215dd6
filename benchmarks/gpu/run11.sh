#!/usr/bin/env bash
# Eleventh GPU pass (twentieth session): a regression check of the cuda path after the engine began
# asking the runner for greedy tokens (ModelRunner.execute(greedy=True): graph replays and eager
# steps take the argmax of their logits on the GPU) and three CPU-side sessions. Cuda conformance,
# the engine's GPU parity tests and the bench's GPU-path unit tests, then the 0.5b batch-1 latency
# bench in 2 rounds with the roofline.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__)"
timeout 220 python3 -m pytest tests/conformance/test_kernels.py tests/conformance/test_backend_greedy_parity.py tests/gpu tests/unit/test_cuda_scaled_mm.py tests/unit/test_bench_gpu_paths.py tests/unit/test_bench_repeats.py -k "cuda or gpu or scaled_mm or bench" -q -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/conformance.log" | tail -8
timeout 170 python3 -m flashllm bench latency --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --baseline transformers --baseline-batch-sizes 1 --roofline --repeats 2 --json "$OUT/latency-0.5b.json" > "$OUT/latency.log" 2>&1; echo "latency rc $?"
tail -12 "$OUT/latency.log"
python3 benchmarks/gpu/latency_summary.py "$OUT/latency-0.5b.json"
