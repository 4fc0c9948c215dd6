"""`flashllm bench serve --baseline llama.cpp`: flashllm serve and llama-server in turn, same requests and client.

Each round starts every engine's server on the same weights (flashllm per --quant-type on the model
directory, llama-server per --gguf-type on a GGUF converted from it), sends one untimed warm-up
request, runs the requests through the same OpenAI client (serve_client.run_benchmark), reads the
server's peak resident memory and stops it: one server at a time, so none competes for the cores
or memory of another. llama-server gets one slot per concurrent request (-np = --max-concurrency,
or every request when unset) and flashllm's thread count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from flashllm.bench.repeats import paired_ratio
from flashllm.bench.serve_client import ServeRequest, ServeTarget, fetch_model_name, run_benchmark
from flashllm.bench.serve_metrics import per_request, summarize

if TYPE_CHECKING:
    from flashllm.bench.workload import BenchRequest

RANK_KEY = "output_throughput"
# the numbers whose median over rounds the record and the table give (each over its own runs)
MEDIAN_KEYS = ("output_throughput", "total_token_throughput", "duration_s", "p50_ttft_ms", "p99_ttft_ms",
               "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "peak_rss_bytes")


@dataclass(frozen=True, slots=True)
class Engine:
    """One server to run: flashllm at a --quant-type, or llama-server on a GGUF of a --gguf-type."""

    kind: str  # "flashllm" | "llama.cpp"
    setting: str  # the quant type or the GGUF file type

    @property
    def name(self) -> str:
        return f"{self.kind}[{self.setting}]"


def engines(args: argparse.Namespace) -> list[Engine]:
    """flashllm once per --quant-type (a comma list), then llama-server once per --gguf-type."""
    from flashllm.bench.llamacpp_baseline import GGUF_TYPE_FOR_DTYPE

    quants = [q.strip() for q in (args.quant_type or "none").split(",") if q.strip()] or ["none"]
    ggufs = args.gguf_type or [GGUF_TYPE_FOR_DTYPE.get(args.dtype or "float32", "f32")]
    return [Engine("flashllm", q) for q in quants] + [Engine("llama.cpp", g) for g in dict.fromkeys(ggufs)]


def check_baseline_flags(args: argparse.Namespace) -> Path:
    """The llama-server binary; SystemExit in one line for --url (the bench starts both servers) or no binary."""
    from flashllm.bench.llamacpp_server import LlamaServerUnavailable, find_llama_server

    if args.url:
        raise SystemExit("flashllm bench serve: --baseline starts every server itself; drop --url")
    try:
        return find_llama_server(args.llama_server)
    except LlamaServerUnavailable as exc:
        raise SystemExit(f"flashllm bench serve: --baseline llama.cpp: {exc}") from exc


def run_compare(args: argparse.Namespace, model_dir: Path, requests: list[ServeRequest], server_flags: list[str]) -> int:
    """Run every engine --repeats times, round-robin; print a table, write --json; 0 when no request failed.

    server_flags: `flashllm serve` flags for every flashllm engine (each adds its own --quant-type)."""
    from flashllm.bench.gguf_export import GGUFExportError, cached_gguf
    from flashllm.bench.llamacpp_server import llama_server_version

    binary = check_baseline_flags(args)
    todo = engines(args)
    try:  # convert before anything is timed (minutes for a big model; cached after)
        ggufs = {e.setting: cached_gguf(model_dir, e.setting) for e in todo if e.kind == "llama.cpp"}
    except GGUFExportError as exc:
        raise SystemExit(f"flashllm bench serve: --baseline llama.cpp: {exc}") from exc
    concurrency = args.max_concurrency or len(requests)
    runs: dict[Engine, list[dict[str, Any]]] = {e: [] for e in todo}
    commands: dict[Engine, list[str]] = {}
    for _ in range(args.repeats):
        for engine in todo:
            with _started(engine, args, model_dir, ggufs, binary, requests, concurrency,
                          server_flags) as (url, pid, command):
                runs[engine].append(_timed_run(args, url, pid, requests, concurrency))
                commands[engine] = command
    record = _record(args, model_dir, requests, todo, runs, commands)
    record["llama_server"] = {"binary": str(binary), "version": llama_server_version(binary)}
    print(format_comparison(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2, allow_nan=False))
    return 0 if all(run["failed"] == 0 for engine_runs in runs.values() for run in engine_runs) else 1


@contextmanager
def _started(engine: Engine, args: argparse.Namespace, model_dir: Path, ggufs: dict[str, Path], binary: Path,
             requests: list[ServeRequest], concurrency: int,
             server_flags: list[str]) -> Iterator[tuple[str, int, list[str]]]:
    """Start `engine`'s server; yield (API root, server pid, its command line); stop it after."""
    if engine.kind == "flashllm":
        from flashllm.testing.server import start_server

        flags = [str(model_dir), *_without_quant(server_flags), "--quant-type", engine.setting]
        server = start_server(flags, timeout=600.0)
        try:
            yield server.url, server.proc.pid, ["flashllm", "serve", *flags]
        finally:
            server.stop()
        return
    from flashllm.bench.llamacpp_server import LlamaServerPlan, running_llama_server, slot_context

    longest = max(r.prompt_len + r.output_len for r in requests)
    plan = LlamaServerPlan(ggufs[engine.setting], concurrency, slot_context(longest, _int(args.max_model_len)),
                           flashllm_threads(), tuple(args.llama_server_arg or ()))
    with running_llama_server(binary, plan) as server:
        yield server.url, server.proc.pid, server.command


def flashllm_threads() -> int:
    """The intra-op thread count torch (and so flashllm's CPU backend) uses in this environment."""
    import torch

    return torch.get_num_threads()


def _without_quant(flags: list[str]) -> list[str]:
    """Server flags minus any --quant-type pair (each engine passes its own)."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--quant-type":
            skip = True
        else:
            out.append(flag)
    return out


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _timed_run(args: argparse.Namespace, url: str, pid: int, requests: list[ServeRequest],
               concurrency: int) -> dict[str, Any]:
    return measure_server(url, pid, requests, concurrency, args.endpoint, args.request_rate, args.seed, args.api_key,
                          progress=not args.no_progress)


def measure_server(url: str, pid: int, requests: list[ServeRequest], concurrency: int, endpoint: str = "completions",
                   request_rate: float = float("inf"), seed: int = 0, api_key: str | None = None,
                   progress: bool = False) -> dict[str, Any]:
    """One untimed warm-up request (as long as the first, two tokens), then the timed run of
    `requests` at most `concurrency` at a time: serve_metrics.summarize's numbers plus the server
    process's peak resident memory (peak_rss_bytes: its tree; peak_rss_main_process_bytes) and the
    first few distinct errors."""
    from flashllm.bench.peak_memory import peak_rss_bytes
    from flashllm.bench.workload import BenchRequest, warm_up_prompt

    model = fetch_model_name(url, api_key)
    first = requests[0]
    warm = first.prompt if not isinstance(first.prompt, list) else warm_up_prompt(BenchRequest(first.prompt, 2))
    # not streamed: a server may hold back tokens that end inside a UTF-8 character, so a short stream can
    # carry no text at all
    body = {"model": model, "prompt": warm, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    answer = httpx.post(f"{url.rstrip('/')}/completions", json=body, headers=ServeTarget(url, model, api_key=api_key)
                        .headers(), timeout=600.0)
    if answer.status_code != 200:
        raise SystemExit(f"flashllm bench: the warm-up request to {url} failed: HTTP {answer.status_code} "
                         f"{answer.text[:300]}")
    target = ServeTarget(url, model, endpoint, api_key)
    results, duration = asyncio.run(run_benchmark(target, requests, request_rate, concurrency, seed, progress=progress))
    summary = summarize(results, duration)
    peaks = peak_rss_bytes(pid) or {}
    summary["peak_rss_bytes"] = peaks.get("tree")
    summary["peak_rss_main_process_bytes"] = peaks.get("process")
    summary["errors"] = sorted({r.error for r in results if not r.success})[:5]
    summary["requests"] = per_request(results)  # with each output token's arrival stamp
    return summary


def _record(args: argparse.Namespace, model_dir: Path, requests: list[ServeRequest], todo: list[Engine],
            runs: dict[Engine, list[dict[str, Any]]], commands: dict[Engine, list[str]]) -> dict[str, Any]:
    record: dict[str, Any] = {
        "mode": "serve-compare", "model": str(model_dir), "shape": getattr(args, "shape", None),
        "endpoint": args.endpoint, "num_prompts": len(requests), "input_len": args.input_len,
        "output_len": args.output_len, "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency or len(requests), "seed": args.seed, "repeats": args.repeats,
        "threads": flashllm_threads(), "date": date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "engines": {e.name: {"kind": e.kind, "setting": e.setting, "command": commands[e], "runs": runs[e]}
                    for e in todo},
    }
    return with_medians(record)


def with_medians(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with each engine's medians over its runs and the paired flashllm / llama.cpp ratios filled in
    (every engine must have run the same number of rounds, in the same order)."""
    record["method"] = ("each engine's median over rounds of each number (round-robin rounds, one server at a "
                        "time); speedups: median over rounds of the ratio within a round")
    engines_ = record["engines"]
    for engine in engines_.values():
        engine_runs = engine["runs"]
        engine["median"] = {k: statistics.median(r[k] for r in engine_runs)
                            if all(r.get(k) is not None for r in engine_runs) else None for k in MEDIAN_KEYS}
    flash = [name for name, e in engines_.items() if e["kind"] == "flashllm"]
    llama = [name for name, e in engines_.items() if e["kind"] == "llama.cpp"]
    record["output_throughput_speedups"] = {
        f"{a} / {b}": paired_ratio(engines_[a]["runs"], engines_[b]["runs"], RANK_KEY) for a in flash for b in llama}
    record["repeats"] = len(next(iter(engines_.values()))["runs"]) if engines_ else 0
    return record


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the rounds of several `bench serve --baseline` records of the same workload and
    engines (commands kept short on a shared machine, each running one or more rounds)."""
    if not records:
        raise ValueError("merge_records needs at least one record")
    same = ("model", "endpoint", "num_prompts", "input_len", "output_len", "request_rate", "max_concurrency", "seed")
    first = records[0]
    for other in records[1:]:
        differ = [k for k in same if other.get(k) != first.get(k)] + (
            ["engines"] if set(other["engines"]) != set(first["engines"]) else [])
        if differ:
            raise ValueError(f"cannot merge records that differ in {', '.join(differ)}; merge runs of one workload "
                             "and one set of engines")
    merged = {**first, "engines": {name: {**engine, "runs": [run for r in records for run in r["engines"][name]["runs"]]}
                                   for name, engine in first["engines"].items()},
              "dates": sorted({r["date"] for r in records})}
    return with_medians(merged)


def format_comparison(record: dict[str, Any]) -> str:
    """One line per engine: medians of output tok/s, TTFT p50 / p99, TPOT p50, ITL p50 / p99 and peak RSS."""
    head = (f"{'engine':<22}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'ITL p50':>9}{'ITL p99':>9}{'peak RSS':>10}")
    lines = [f"{record['num_prompts']} requests at concurrency {record['max_concurrency']}, "
             f"medians of {record['repeats']} round(s); times in ms", head, "-" * len(head)]
    for name, engine in record["engines"].items():
        m = engine["median"]
        rss = "n/a" if m["peak_rss_bytes"] is None else f"{m['peak_rss_bytes'] / 2**30:.2f} GiB"
        lines.append(f"{name:<22}{_num(m['output_throughput'], 1):>10}{_num(m['p50_ttft_ms']):>10}"
                     f"{_num(m['p99_ttft_ms']):>10}{_num(m['p50_tpot_ms']):>10}{_num(m['p50_itl_ms']):>9}"
                     f"{_num(m['p99_itl_ms']):>9}{rss:>10}")
    lines += [f"{pair}: {ratio:.2f}x output tok/s" for pair, ratio in record["output_throughput_speedups"].items()]
    return "\n".join(lines)


def _num(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def throughput_run(binary: Path, gguf: Path, requests: list[BenchRequest], slots: int, threads: int,
                   max_model_len: int | None = None, extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """`bench throughput`'s llama.cpp run: llama-server with `slots` slots on `gguf`, every request
    sent at once through the serving benchmark's client, at most `slots` in flight (flashllm's
    --max-num-seqs); the record carries the offline keys (batch_size = slots) and the server's peak memory."""
    from flashllm.bench.llamacpp_server import LlamaServerPlan, running_llama_server, slot_context

    sent = [ServeRequest(r.prompt_token_ids, len(r.prompt_token_ids), r.output_len) for r in requests]
    longest = max(r.prompt_len + r.output_len for r in sent)
    plan = LlamaServerPlan(gguf, slots, slot_context(longest, max_model_len), threads, extra_args)
    with running_llama_server(binary, plan) as server:
        summary = measure_server(server.url, server.proc.pid, sent, slots)
        command = server.command
    if summary["failed"]:
        raise RuntimeError(f"llama-server failed {summary['failed']} of {len(sent)} requests: {summary['errors']}")
    return {"batch_size": slots, "elapsed_s": summary["duration_s"], "output_tokens": summary["total_output_tokens"],
            "output_tokens_per_s": summary["output_throughput"],
            "total_tokens_per_s": summary["total_token_throughput"], "mean_ttft_s": summary["mean_ttft_ms"] / 1000,
            "p99_ttft_s": summary["p99_ttft_ms"] / 1000, "p50_tpot_s": (summary["p50_tpot_ms"] or 0.0) / 1000,
            "peak_rss_bytes": summary["peak_rss_bytes"], "engine": "llama-server", "command": command}


def main(argv: list[str] | None = None) -> int:
    """`python -m flashllm.bench.serve_compare A.json B.json ... [--json OUT]`: the medians over every round."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("records", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, default=None, help="write the merged record here")
    args = parser.parse_args(argv)
    try:
        merged = merge_records([json.loads(path.read_text()) for path in args.records])
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"flashllm.bench.serve_compare: {exc}") from exc
    print(format_comparison(merged))
    if args.json:
        args.json.write_text(json.dumps(merged, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
