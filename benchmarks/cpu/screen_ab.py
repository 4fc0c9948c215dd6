"""A/B of the greedy screen's copies of the LM head (int8 against bf16) through the engine, on the
qwen2.5-0.5b shape, fp32 on the CPU: batch-1 decode, the offline workload, and the head alone.

    python benchmarks/cpu/screen_ab.py --rounds 12 batch1
    python benchmarks/cpu/screen_ab.py --rounds 4 offline
    python benchmarks/cpu/screen_ab.py --rounds 7 head

One LLM (one build of the native library) with both screens built; each round swaps the one the
model runner calls, rotating which goes first. Both must give the same tokens (each equals the
argmax of the fp32 logits). Ratios: medians of per-round rate ratios (time ratios for `head`,
each call after a 1.6 GB read of another buffer) against the bf16 copy; a second bf16 screen runs
as a control arm.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import CONFIG, SHAPE, greedy_engine  # beside this file, first on sys.path

from flashllm import LLM, SamplingParams
from flashllm.backends.cpu import greedy_screen, native
from flashllm.bench import offline
from flashllm.bench.shapes import shape_model_dir
from flashllm.bench.workload import random_requests, warm_up_prompt


def _screens(llm: LLM) -> dict[str, greedy_screen.GreedyScreen]:
    model = llm.engine.parts.model
    head, fallback = model.lm_head, greedy_screen.kept(model)._fallback
    make = lambda kind: greedy_screen.GreedyScreen(head.weight, head.num_embeddings, fallback, kind)  # noqa: E731
    return {"bf16": make("bf16"), "int8": make("int8"), "bf16-copy": make("bf16")}


def _rounds(screens: dict, rounds: int, run, unit: str, higher_is_better: bool = True) -> None:
    names = list(screens)
    values: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            values[name].append(run(screens[name]))
        print(r, "  ".join(f"{name} {v[-1]:.3f} {unit}" for name, v in values.items()), flush=True)
    for name, v in values.items():
        ratios = [(a / b if higher_is_better else b / a) for a, b in zip(v, values[names[0]], strict=True)]
        print(f"{name}: {statistics.median(ratios):.3f}x {names[0]}, better in {sum(x > 1 for x in ratios)} of {len(ratios)}")


def _engine(llm: LLM, requests, params, key: str, rounds: int) -> None:
    screens = _screens(llm)
    runner = llm.engine.runner
    warm_up = SamplingParams(max_tokens=2, detokenize=False)
    tokens = {}
    for name, screen in screens.items():
        runner._greedy_head = screen
        llm.generate([warm_up_prompt(requests[0])], warm_up)
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate([r.prompt_token_ids for r in requests], params)]
    assert all(t == tokens["bf16"] for t in tokens.values()), "the copies gave different tokens"

    def run(screen) -> float:
        runner._greedy_head = screen
        time.sleep(0.02)
        return offline._timed_generate(llm, requests, params)[key]

    _rounds(screens, rounds, run, "tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["batch1", "offline", "head"])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if native.library().flashllm_i8_screen_set_path(-1) == 0:
        raise SystemExit("this CPU has no int8 screen path (AVX-512 VNNI)")
    if args.what == "batch1":
        llm, request, params = greedy_engine(64)
        _engine(llm, [request], [params], "decode_tokens_per_s", args.rounds)
    elif args.what == "offline":
        llm = LLM(str(shape_model_dir(SHAPE, "float32")), device="cpu", max_model_len=4096, max_num_seqs=16,
                  max_num_batched_tokens=2048)
        requests = random_requests(16, (32, 256), (16, 128), CONFIG["vocab_size"], 0)
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
                  for r in requests]
        _engine(llm, requests, params, "output_tokens_per_s", args.rounds)
    else:
        llm, _, _ = greedy_engine(2)
        screens = _screens(llm)
        lib, evict = native.library(), torch.ones(400 << 20)
        for tokens in (1, 2, 5, 8, 16):
            x = torch.randn(tokens, CONFIG["hidden_size"]) * 3

            def run(screen, x=x) -> float:
                lib.flashllm_read_stream(evict.data_ptr(), evict.numel() // 64, 2, 8, 64)  # the head's rows out of the caches
                start = time.perf_counter()
                screen(x)
                return (time.perf_counter() - start) * 1e3

            print(f"-- {tokens} tokens")
            _rounds(screens, args.rounds, run, "ms", higher_is_better=False)


if __name__ == "__main__":
    main()
