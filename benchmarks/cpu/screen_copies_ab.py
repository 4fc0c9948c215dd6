"""The greedy screen's copies of the LM head alone, int8 against bf16, on this CPU's native paths:
milliseconds a call, the head read cold, at a few token counts and two head shapes.

    python benchmarks/cpu/screen_copies_ab.py --rounds 9
    python benchmarks/cpu/screen_copies_ab.py --rounds 9 --pick   # screen calls: scores and the pick

Heads of random N(0, 0.05^2) weights, SmolLM2-135M's 49152 x 576 and qwen2.5-0.5b's 151936 x 896,
tokens N(0, 9). Arms, interleaved in rotating order, each call after a read of a 96 MB buffer (3x
the L3 of the `epyc-avx2-2c` host) so the copy comes from memory, as in a decode step: the bf16 copy
(flashllm_bf16_gemv_mt), the int8 copy (flashllm_i8_screen_mt), a second bf16 arm as the control;
where the bf16 copy's path does not take the token count (more than 9 on an AVX2 CPU), the fp32
head's products (flashllm_f32_gemv_mt, what the engine runs then) take its place. Medians of the
rounds; every arm's scores are checked once to give the float64 argmax where the top two logits
are apart (the int8 and bf16 scores are within their bounds, not equal).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashllm.backends.cpu import greedy_screen, native

SHAPES = {"smollm2-135m": (49152, 576), "qwen2.5-0.5b": (151936, 896)}
TOKENS = (1, 2, 5, 9, 16)
EVICT_FLOATS = 24 << 20  # 96 MB


def _arms(lib, weight: torch.Tensor, copies: dict, tokens: int, pick: bool) -> dict:
    """name -> a call (x, y) that scores tokens rows of x into y, or with `pick` screens them."""
    n, k = weight.shape
    threads = native.threads_for(tokens, n, k)

    def screen(kind: str):
        copy = copies[kind]
        if pick:
            return lambda x, y: copy(x)
        return lambda x, y: copy._scores(lib, x, y)

    def fp32(x, y):
        lib.flashllm_f32_gemv_mt(x.data_ptr(), weight.data_ptr(), y.data_ptr(), tokens, k, n, n, threads)
        return y.argmax(-1) if pick else 1

    bf16 = "bf16" if lib.flashllm_bf16_screen_takes(tokens) else "fp32"
    arms = {bf16: screen("bf16") if bf16 == "bf16" else fp32, "int8": screen("int8")}
    arms[f"{bf16}-again"] = arms[bf16]
    return arms


def _check(arms: dict, x: torch.Tensor, weight: torch.Tensor, pick: bool) -> None:
    """Every arm's tokens are the float64 argmax (its scores' argmax, where the top two logits are
    0.5 apart: ~10 times the int8 scores' typical error at these scales)."""
    exact = x.double() @ weight.double().T
    top2 = exact.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1] > 0.5) | pick
    for name, arm in arms.items():
        y = torch.empty(x.shape[0], weight.shape[0])
        got = arm(x, y) if pick else (arm(x, y), y.argmax(-1))[1]
        assert torch.equal(got[clear], exact.argmax(-1)[clear]), name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--pick", action="store_true", help="time screen calls (scores and the pick)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    lib = native.library()
    if lib is None or lib.flashllm_i8_screen_set_path(-1) == 0:
        raise SystemExit("no native int8 screen path on this CPU")
    print(f"int8 path {lib.flashllm_i8_screen_set_path(-1)}, bf16 path {lib.flashllm_screen_set_path(-1)}, "
          f"{native.parallel.workers()} threads")
    evict = torch.ones(EVICT_FLOATS)
    for shape in args.shapes:
        n, k = SHAPES[shape]
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(n, k, generator=gen) * 0.05
        copies = {kind: greedy_screen.GreedyScreen(weight, n, lambda rows, w=weight: (rows @ w.T).argmax(-1), kind)
                  for kind in ("bf16", "int8")}
        for tokens in TOKENS:
            x = torch.randn(tokens, k, generator=gen) * 3
            y = torch.empty(tokens, n)
            arms = _arms(lib, weight, copies, tokens, args.pick)
            _check(arms, x, weight, args.pick)
            ms: dict[str, list[float]] = {name: [] for name in arms}
            names = list(arms)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    lib.flashllm_read_stream(evict.data_ptr(), evict.numel() // 64, 2, 8, 64)
                    start = time.perf_counter()
                    arms[name](x, y)
                    ms[name].append((time.perf_counter() - start) * 1e3)
            first = names[0]
            print(f"{shape} {tokens:2d} tokens: " + "  ".join(
                f"{name} {statistics.median(v):.2f} ms" for name, v in ms.items())
                + f"  (int8 {statistics.median(ms[first]) / statistics.median(ms['int8']):.2f}x faster)", flush=True)


if __name__ == "__main__":
    main()
