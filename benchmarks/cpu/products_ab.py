"""A/B of native kernel builds on one token's fp32 products of the qwen2.5-0.5b shape, in rounds.

    python benchmarks/cpu/products_ab.py --rounds 12 --set token A=/tmp/lib_a.so B=/tmp/lib_b.so
    python benchmarks/cpu/products_ab.py --rounds 12 --tokens 16 A=/tmp/lib_a.so B=/tmp/lib_b.so

Each library is a build of flashllm/backends/cpu/csrc (e.g. `cc -O3 -mavx2 -mfma -fPIC -shared
-pthread -DVARIANT ... -o lib.so *.c`). The weights are random, of the shape's sizes, in huge pages as
the engine places them; --set token runs all 97 products of a token, --set pairs only the LM head and
the 24 gate_up products; --tokens runs them for a decode batch of that many tokens. Every round
times each library (three passes after one untimed pass) and each of the roofline's read patterns
(read_probe.PATTERNS) over the same tensors, in a rotating order, so a slow phase of the host meets
all of them; "of the round's fastest read" is against the fastest pattern, the ceiling's rule. These
reads are per tensor, a call each: on a 2-vCPU Intel Xeon VM eight streams read the
token's tensors at ~0.85 of the rate they read one 1 GiB buffer at, the bench's ceiling probe, so a
product can pass 1.0 here without passing the ceiling. Outputs must be bit-identical to the first library's, or it says so.
Ratios are medians of per-round ratios against the first library; "faster in" counts rounds.
A copy of the first library runs as a control arm (common.load_builds; --no-control drops it).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from functools import partial

import torch
from common import CONFIG, add_build_arguments, load_builds, token_products  # beside this file, first on sys.path

from flashllm.backends.cpu import huge_pages, native, parallel, read_probe


def weights(which: str) -> list[torch.Tensor]:
    """Random weights of the shape's products in huge pages: a whole token's, or ("pairs") the LM
    head's and the gate_up products' only."""
    torch.manual_seed(0)
    shapes = token_products()
    if which == "pairs":
        shapes = shapes[-1:] + [s for s in shapes if s[0] == 2 * CONFIG["intermediate_size"]]
    return [huge_pages.huge_page_copy(torch.randn(*shape) * 0.02) for shape in shapes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--set", choices=("token", "pairs"), default="token")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per product (a decode batch)")
    add_build_arguments(parser)
    args = parser.parse_args()
    ws = weights(args.set)
    nbytes = sum(w.nbytes for w in ws)
    xs = {k: torch.randn(args.tokens, k) for k in {k for _, k in token_products()}}
    ys = [torch.empty(args.tokens, w.shape[0]) for w in ws]
    threads = parallel.workers()

    def products(lib: ctypes.CDLL) -> None:
        for w, y in zip(ws, ys, strict=True):
            n, k = w.shape
            lib.flashllm_f32_gemv_mt(xs[k].data_ptr(), w.data_ptr(), y.data_ptr(), args.tokens, k, n, n, threads)

    def read(streams: int, step: int) -> None:
        for w in ws:
            native.read_stream(w.view(-1), streams, step)

    libs = load_builds(args)
    calls = {name: partial(products, lib) for name, lib in libs.items()}
    names = list(calls)
    reference = None
    for name, call in calls.items():
        call()
        outputs = [y.clone() for y in ys]
        reference = reference or outputs
        if not all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True)):
            print(f"{name}: outputs differ from {names[0]}'s")
    for pattern_name, pattern in read_probe.PATTERNS.items():  # the roofline's reads, its ceiling the fastest
        calls[pattern_name] = partial(read, *pattern)
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds):
        order = list(calls)[r % len(calls):] + list(calls)[: r % len(calls)]
        for name in order:
            calls[name]()
            time.sleep(0.005)  # another library's workers stop spinning
            start = time.perf_counter()
            for _ in range(3):
                calls[name]()
            rates[name].append(3 * nbytes / (time.perf_counter() - start) / 1e9)
        print(r, "  ".join(f"{name} {v[-1]:.1f} GB/s" for name, v in rates.items()), flush=True)
    base = rates[names[0]]
    fastest_read = [max(rates[p][r] for p in read_probe.PATTERNS) for r in range(args.rounds)]
    for name, v in rates.items():
        ratios = [a / b for a, b in zip(v, base, strict=True)]
        print(f"{name}: {statistics.median(ratios):.3f}x {names[0]}, faster in {sum(x > 1 for x in ratios)} of "
              f"{len(ratios)}; {statistics.median(a / b for a, b in zip(v, fastest_read, strict=True)):.3f}"
              " of the round's fastest read")


if __name__ == "__main__":
    main()
