#!/usr/bin/env bash
# The GPU numbers of docs/benchmarks.md on one NVIDIA GPU, from the root of a flashllm checkout:
#
#   OUT=/tmp/out benchmarks/gpu/run.sh check    # ~5 min: cuda conformance + GPU tests, 0.5b batch-1 latency
#   OUT=/tmp/out benchmarks/gpu/run.sh full     # ~20 min: check, then the kernel table, 7b decode and
#                                               # prefill, 0.5b offline throughput
#   OUT=/tmp/out benchmarks/gpu/run.sh spec     # ~8 min: speculative decoding on the GPU (engine tests; the
#                                               # verify step's cost and the guard on the 0.5b and 7b shapes)
#
# Needs torch with CUDA, triton and transformers (`pip install -e '.[test,cuda]'`). Logs and JSON
# records go to $OUT; each step has its own timeout so one hang does not eat the rest.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compile the Triton kernels for the GPU, not the CPU interpreter
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
suite=${1:-check}
case "$suite" in check|full|spec) ;; *) echo "usage: $0 check|full|spec (got '$suite')" >&2; exit 2 ;; esac

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__)" \
    | tee -a "$OUT/machine.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/machine.txt"

if [ "$suite" = spec ]; then
    # greedy tokens with each proposer equal plain decoding's through the cuda backend (graphs on and off)
    timeout 300 python3 -m pytest tests/gpu/test_cuda_spec.py -q -p no:cacheprovider --tb=short 2>&1 \
        | tee "$OUT/spec-tests.log" | tail -8
    # random prompts (nothing to copy): verify_step_cost (1 + 4 rows against one decode step) and the speed
    # against the same engine without speculation in the same run (the guard's line: within 5%)
    for shape in qwen2.5-0.5b qwen2.5-7b; do
        timeout 300 python3 -m flashllm bench latency --shape $shape --device cuda --dtype bfloat16 --dataset random \
            --num-prompts 2 --input-len 128 --output-len 128 --repeats 3 --speculate_method ngram \
            --speculate_max_draft_token_num 4 --json "$OUT/spec-$shape.json" > "$OUT/spec-$shape.log" 2>&1
        echo "$shape speculation rc $?"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'verify_step_cost', \
round(d['verify_step_cost'], 3), 'speedup_vs_plain', round(d['speedup_vs_plain'], 3))" "$OUT/spec-$shape.json" $shape
    done
    exit 0
fi

timeout 300 python3 -m pytest tests/conformance/test_kernels.py tests/conformance/test_backend_greedy_parity.py tests/gpu \
    tests/unit/test_cuda_scaled_mm.py tests/unit/test_bench_gpu_paths.py tests/unit/test_bench_repeats.py \
    -k "cuda or gpu or scaled_mm or bench" -q -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/conformance.log" | tail -8
timeout 240 python3 -m flashllm bench latency --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --baseline transformers \
    --baseline-batch-sizes 1 --roofline --repeats 2 --json "$OUT/latency-qwen2.5-0.5b.json" > "$OUT/latency-0.5b.log" 2>&1
echo "0.5b latency rc $?"
python3 benchmarks/gpu/latency_summary.py "$OUT/latency-qwen2.5-0.5b.json"
[ "$suite" = full ] || exit 0

{
for k in rms_norm silu_and_mul rotary_embedding write_kv_cache; do timeout 60 python3 -m flashllm.backends.cuda.bench --kernel $k --tokens 16384; done
timeout 60 python3 -m flashllm.backends.cuda.bench --kernel paged_attention --mode decode --seqs 64 --context 4096
} > "$OUT/kernels.log" 2>&1
timeout 120 python3 benchmarks/gpu/prefill_vs_sdpa.py > "$OUT/prefill-vs-sdpa.log" 2>&1
timeout 120 python3 benchmarks/gpu/gemv_sweep.py --json "$OUT/gemv-sweep.json" > "$OUT/gemv-sweep.log" 2>&1
timeout 420 python3 -m flashllm bench latency --shape qwen2.5-7b --device cuda --dtype bfloat16 --quant_type none,w8a16,w4a16 \
    --weightonly_group_size 128 --baseline transformers --baseline-batch-sizes 1 --roofline \
    --json "$OUT/latency-qwen2.5-7b.json" > "$OUT/latency-7b.log" 2>&1
echo "7b latency rc $?"
timeout 150 python3 -m flashllm bench latency --shape qwen2.5-7b --device cuda --dtype bfloat16 --input-len 2048 \
    --output-len 2 --num-prompts 1 --roofline --json "$OUT/prefill-qwen2.5-7b.json" > "$OUT/prefill-7b.log" 2>&1
echo "7b prefill rc $?"
timeout 300 python3 -m flashllm bench throughput --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --num-prompts 256 \
    --input-len 100:1024 --output-len 100:1024 --max-num-seqs 256 --max-num-batched-tokens 8192 \
    --baseline transformers --baseline-batch-sizes 256 --roofline \
    --json "$OUT/throughput-qwen2.5-0.5b.json" > "$OUT/throughput-0.5b.log" 2>&1
echo "0.5b throughput rc $?"
