#!/usr/bin/env bash
# Fourth GPU pass: cuda conformance + engine GPU tests after the attention/GEMV changes, the GEMV
# sweep, then the BENCHMARKS.md GPU workloads on the 0.5b shape through `flashllm bench`.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest tests/conformance/test_kernels.py tests/gpu -k "cuda or gpu" -q -p no:cacheprovider --tb=line 2>&1 | tee "$OUT/conformance.log" | tail -4
timeout 100 python3 benchmarks/gpu/gemv_sweep.py --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" | cut -c1-60,400-
timeout 150 python3 -m flashllm bench latency --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --quant_type none,w8a16,w4a16 --weightonly_group_size 128 --baseline transformers --baseline-batch-sizes 1 --roofline --json "$OUT/latency-0.5b.json" > "$OUT/latency.log" 2>&1; echo "latency rc $?"
python3 -c "
import json; r = json.load(open('$OUT/latency-0.5b.json'))
print('latency', {k: r.get(k) for k in ('decode_ceiling_batch1_tokens_per_s', 'fractions_of_bandwidth_ceiling', 'decode_speedup_vs_transformers', 'roofline')})
for q in r.get('quant_runs', []): print(q['quant_type'], round(q['decode_tokens_per_s'], 1), 'tok/s', round(q.get('fraction_of_bandwidth_ceiling', 0), 3), round(q['speedup_vs_first'], 2), 'x')
print('hf', r.get('transformers_latency'))"
timeout 200 python3 -m flashllm bench throughput --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --max-num-seqs 256 --max-num-batched-tokens 8192 --baseline transformers --baseline-batch-sizes 256 --roofline --json "$OUT/throughput-0.5b.json" > "$OUT/throughput.log" 2>&1; echo "throughput rc $?"
python3 -c "
import json; r = json.load(open('$OUT/throughput-0.5b.json'))
print('flashllm', {k: round(v, 2) for k, v in r['flashllm'].items() if isinstance(v, float)})
print('hf', r['transformers'], 'speedup', r.get('speedup_vs_best_transformers'), 'compute frac', r.get('fraction_of_compute_ceiling'))"
tail -3 "$OUT/throughput.log"
