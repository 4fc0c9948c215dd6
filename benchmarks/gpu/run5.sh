#!/usr/bin/env bash
# Fifth GPU pass: the qwen2.5-7b shape: batch-1 decode (bf16, w8a16, w4a16) against transformers and
# the roofline, then the TTFT of one 2048-token prompt.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s); python3 -c "from flashllm.bench.shapes import shape_model_dir as s; print(s('qwen2.5-7b', 'bfloat16'))"; echo "shape built in $(( $(date +%s) - t0 )) s"
timeout 300 python3 -m flashllm bench latency --shape qwen2.5-7b --device cuda --dtype bfloat16 --quant_type none,w8a16,w4a16 --weightonly_group_size 128 --baseline transformers --baseline-batch-sizes 1 --roofline --json "$OUT/latency-7b.json" > "$OUT/latency-7b.log" 2>&1; echo "latency rc $?"; tail -2 "$OUT/latency-7b.log"
python3 -c "
import json; r = json.load(open('$OUT/latency-7b.json'))
print({k: r.get(k) for k in ('decode_ceiling_batch1_tokens_per_s', 'fractions_of_bandwidth_ceiling', 'decode_speedup_vs_transformers', 'roofline')})
for q in r.get('quant_runs', []): print(q['quant_type'], round(q['decode_tokens_per_s'], 1), 'tok/s', round(q.get('fraction_of_bandwidth_ceiling', 0), 3), round(q['speedup_vs_first'], 2), 'x')
print('hf', r.get('transformers_latency'))"
timeout 150 python3 -m flashllm bench latency --shape qwen2.5-7b --device cuda --dtype bfloat16 --input-len 2048 --output-len 2 --num-prompts 1 --roofline --json "$OUT/prefill-7b.json" > "$OUT/prefill-7b.log" 2>&1; echo "prefill rc $?"
python3 -c "
import json
from flashllm.bench.shapes import flops_per_token
r = json.load(open('$OUT/prefill-7b.json'))
ttft = r['flashllm']['mean_ttft_s']; flops = flops_per_token(r['model'], 1024) * 2048
print('TTFT', round(ttft * 1e3, 1), 'ms', round(flops / ttft / 1e12, 1), 'TFLOP/s =', round(flops / ttft / (r['roofline']['matmul_gflop_s'] * 1e9), 3), 'of the bf16 matmul peak')"
