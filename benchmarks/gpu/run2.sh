#!/usr/bin/env bash
# Second GPU pass: the engine GPU tests (graphs, memory sizing), the quant conformance cases,
# the decode GEMV tile sweep, and batch-1 decode of the 0.5b shape with graphs and eagerly.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider --tb=short -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
timeout 100 python3 -m pytest tests/conformance/test_kernels.py -k "cuda and quant_matmul" -q -p no:cacheprovider --tb=line 2>&1 | tail -4
timeout 150 python3 benchmarks/gpu/gemv_sweep.py --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log"
for eager in "" "--enforce-eager"; do
  timeout 90 python3 -c "
import sys, time
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.bench.shapes import shape_model_dir
d = shape_model_dir('qwen2.5-0.5b', 'bfloat16')
t0 = time.perf_counter()
llm = LLM(str(d), device='cuda', dtype='bfloat16', max_model_len=4096, enforce_eager='$eager' != '')
print('engine start', round(time.perf_counter() - t0, 1), 's, graphs', llm.engine.runner.graphs is not None)
p = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, detokenize=False)
for _ in range(2):
    o = llm.generate([list(range(100, 228))], p)[0]
m = o.metrics
print('eager' if '$eager' else 'graphs', 'decode tok/s', round(127 / (m.latency - m.time_to_first_token), 1), 'ttft ms', round(m.time_to_first_token * 1e3, 1))
" 2>&1 | grep -v "Loading\|Writing" | tail -6
done
