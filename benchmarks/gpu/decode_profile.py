"""Where a batch-1 decode step's time goes on a GPU: graph replay (device time) against the engine's step.

    python benchmarks/gpu/decode_profile.py --shape qwen2.5-0.5b [--batch 1,64]

Prints the replay time of the captured decode graph per batch size (CUDA events, median of 50),
the engine's batch-1 decode rate with graphs (so the host's share per step is the difference),
and the top kernels of one eager decode step by device time (torch.profiler).
"""

from __future__ import annotations

import argparse
import time

from timing import median_ms

from flashllm.bench.shapes import shape_model_dir
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams


def replay_ms(graph, repeats: int = 50) -> float:
    return median_ms(graph.replay, repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--quant_type", default="none")
    args = parser.parse_args()
    llm = LLM(str(shape_model_dir(args.shape, "bfloat16")), device="cuda", dtype="bfloat16", max_model_len=4096,
              quant_type=args.quant_type)
    runner = llm.engine.runner
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, detokenize=False)
    prompt = list(range(100, 228))
    for _ in range(2):
        out = llm.generate([prompt], params)[0]
    m = out.metrics
    step_ms = (m.latency - m.time_to_first_token) / 127 * 1e3
    print(f"{args.shape} {args.quant_type}: engine batch-1 decode {1e3 / step_ms:.1f} tokens/s ({step_ms:.3f} ms/step), "
          f"TTFT {m.time_to_first_token * 1e3:.1f} ms")
    for b in (int(v) for v in args.batch.split(",")):
        size = next(s for s in runner.graphs.batch_sizes if s >= b)
        ms = replay_ms(runner.graphs.graphs[size])
        print(f"  graph replay, batch {size}: {ms:.3f} ms = {size / ms * 1e3:.0f} tokens/s of device time")
    graphs, runner.graphs = runner.graphs, None  # eager steps for the kernel breakdown
    from torch.profiler import ProfilerActivity, profile

    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, detokenize=False))
        wall = time.perf_counter() - t0
    runner.graphs = graphs
    print(f"eager: 1 prefill + 8 decode steps took {wall * 1e3:.1f} ms of wall time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
