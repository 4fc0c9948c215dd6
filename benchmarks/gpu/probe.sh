#!/usr/bin/env bash
# First look on a lent GPU: versions, the generated cuda conformance cases, the engine parity test,
# each kernel micro-benchmark at its default shape, and eager batch-1 decode on the 0.5b shape.
# Logs go to $OUT (the device tool brings them back).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__, torch.cuda.get_device_name())"
timeout 300 python3 -m pytest tests/conformance/test_kernels.py -k cuda -q -p no:cacheprovider --tb=short --maxfail=40 2>&1 | tee "$OUT/conformance.log" | tail -25
timeout 150 python3 -m pytest tests/conformance/test_backend_greedy_parity.py tests/unit/test_cuda_scaled_mm.py -q -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/parity.log" | tail -15
{
for k in rms_norm silu_and_mul rotary_embedding write_kv_cache; do timeout 60 python3 -m flashllm.backends.cuda.bench --kernel $k --tokens 16384; done
timeout 60 python3 -m flashllm.backends.cuda.bench --kernel paged_attention --mode decode --seqs 64 --context 4096
timeout 60 python3 -m flashllm.backends.cuda.bench --kernel paged_attention --mode prefill --tokens 2048 --context 2048
for s in w8a16 w4a16; do timeout 60 python3 -m flashllm.backends.cuda.bench --kernel quant_matmul --scheme $s --tokens 1 --hidden 4096 --out-features 4096; done
timeout 60 python3 -m flashllm.backends.cuda.bench --kernel fused_moe --tokens 64
} 2>&1 | tee "$OUT/kernels.log" | grep -v "^  (GB/s"
timeout 240 python3 -m flashllm bench latency --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --json "$OUT/latency.json" 2>&1 | tail -30 | tee "$OUT/latency.log"
