"""Issue 48's serving workload driven in process, closed loop, every engine step timed and classified.

    PYTHONPATH=$PWD python benchmarks/cpu/serve_steps.py --quant-type none   # or weight_only_int8

The qwen2.5-0.5b shape with `flashllm serve`'s CPU settings (512 prompt tokens a step), 32 requests of
96-160 prompt and 48-80 output tokens (--seed 0's, as `bench serve` makes them), 16 in flight: prints
output tokens/s, TTFT p50 / p99, the time of the steps with prompt work and of the decode-only ones,
each prefill step, and decode steps by batch size. Timings are in process (no HTTP, no client)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from flashllm import SamplingParams
from flashllm.bench.shapes import shape_model_dir
from flashllm.bench.workload import parse_range, random_requests
from flashllm.config import CPU_SERVE_MAX_PREFILL_TOKENS
from flashllm.core.engine import Engine
from flashllm.llm import engine_config


def build_engine(quant_type: str, max_prefill: int | None, max_num_seqs: int) -> Engine:
    """An engine with `flashllm serve`'s CPU settings on the qwen2.5-0.5b shape (fp32 weights)."""
    config = engine_config(str(shape_model_dir("qwen2.5-0.5b", "float32")), dtype="float32", device="cpu",
                           max_model_len=2048, max_num_seqs=max_num_seqs, num_scheduler_steps=1,
                           quant_type=quant_type, max_prefill_tokens=max_prefill or CPU_SERVE_MAX_PREFILL_TOKENS)
    return Engine(config)


def run(engine: Engine, concurrency: int, num: int, seed: int) -> dict:
    """Keep `concurrency` requests in flight until `num` finished; per-step and per-request times."""
    vocab = engine.parts.hf_config.vocab_size
    reqs = random_requests(num, parse_range("96:160"), parse_range("48:80"), vocab, seed)
    pending = list(enumerate(reqs))
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    steps = []
    t0 = time.perf_counter()

    def admit() -> None:
        while pending and len(sent) - len(done) < concurrency:
            i, r = pending.pop(0)
            rid = f"r{i}"
            engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                                  ignore_eos=True), request_id=rid)
            sent[rid] = time.perf_counter()

    done: set[str] = set()
    admit()
    while engine.has_unfinished():
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        steps.append({"t": te - ts, "prefill": engine.scheduler.step_prompt_tokens,
                      "decode": engine.scheduler.step_decodes})
        for out in outs:
            if out.request_id not in first:
                first[out.request_id] = te
            if out.finished:
                done.add(out.request_id)
        admit()
    wall = time.perf_counter() - t0
    ttft = sorted(first[r] - sent[r] for r in sent)
    out_tokens = sum(r.output_len for r in reqs)
    return {"wall": wall, "tok_s": out_tokens / wall, "ttft_p50": statistics.median(ttft),
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant-type", default="none")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--max-prefill", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--f32-max", type=int, default=None, help="native.F32_PROMPT_MAX_TOKENS for this run")
    args = ap.parse_args()
    if args.f32_max is not None:
        from flashllm.backends.cpu import native

        native.F32_PROMPT_MAX_TOKENS = args.f32_max
    engine = build_engine(args.quant_type, args.max_prefill, args.max_num_seqs)
    _instrument(engine)
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.run_until_done()
    res = run(engine, args.concurrency, args.num, 0)
    steps = res["steps"]
    kinds: dict[str, list[float]] = {}
    for s in steps:
        key = "prefill" if s["prefill"] else "decode"
        kinds.setdefault(key, []).append(s["t"])
    print(f"{args.quant_type} c{args.concurrency}: {res['tok_s']:.1f} out tok/s wall {res['wall']:.1f} s "
          f"TTFT p50 {res['ttft_p50']:.2f} p99 {res['ttft_p99']:.2f}")
    for k, v in kinds.items():
        print(f"  {k}: {len(v)} steps {sum(v):.1f} s")
    for s in steps:
        if s["prefill"]:
            print(f"    prefill {s['prefill']:4d} tok + {s['decode']:2d} dec: {s['t']:.2f} s")
    dec = [s for s in steps if not s["prefill"]]
    by_n: dict[int, list[float]] = {}
    for s in dec:
        by_n.setdefault(s["decode"], []).append(s["t"])
    for n in sorted(by_n):
        print(f"    decode {n:2d}: {len(by_n[n])} steps, median {statistics.median(by_n[n]) * 1e3:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps(res))


def _instrument(engine: Engine) -> None:
    """Record each scheduled batch's prompt tokens and decode rows on the scheduler (step_prompt_tokens,
    step_decodes) as it schedules them."""
    sched = engine.scheduler
    schedule_batch = sched.schedule

    def schedule():
        out = schedule_batch()
        prompt = [i for i in out.scheduled if i.num_new_tokens > 1 or not i.seq.num_computed_tokens]
        sched.step_prompt_tokens = sum(i.num_new_tokens for i in prompt)
        sched.step_decodes = len(out.scheduled) - len(prompt)
        return out

    sched.schedule = schedule


if __name__ == "__main__":
    main()
