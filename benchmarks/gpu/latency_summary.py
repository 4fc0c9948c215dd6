"""One line per engine of a GPU latency bench's JSON (`flashllm bench latency ... --json FILE`): the
per-round decode rates and times to first token, then the speedup, the bandwidth fraction and the
copy bandwidth it came from. run.sh beside this file prints it after its latency run.

    python3 benchmarks/gpu/latency_summary.py $OUT/latency-0.5b.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    r = json.load(open(path))
    print("flashllm", [(round(x["decode_tokens_per_s"], 1), round(x["mean_ttft_s"], 4)) for x in r["flashllm"]["runs"]])
    print("hf", [(round(x["decode_tokens_per_s"], 1), round(x["ttft_s"], 4)) for x in r["transformers_latency"]["runs"]])
    print("speedup", r["decode_speedup_vs_transformers"], "fraction", r["fraction_of_bandwidth_ceiling"],
          "sustained fractions", r.get("fractions_of_sustained_bandwidth"), "method", r.get("bandwidth_fraction_method"),
          "copy GB/s", r["roofline"]["copy_bandwidth_gb_s"])


if __name__ == "__main__":
    main(sys.argv[1])
