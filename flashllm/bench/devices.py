"""`flashllm bench devices`: batch-1 decode and offline throughput of reference, cpu, ipex and onnx static mode in one run.

Every engine runs the same requests on the same weights, one after the other, against the
matmul ceiling measured at the start of the run and a memory-bandwidth ceiling read just before
and just after that engine ran (the higher of the two; bench/repeats.py says why) (docs/benchmarks.md):
reference and cpu in this process with the backend forced; ipex in a subprocess of the
interpreter that has IPEX (torch 2.8, `nox -s ipex`), which runs this module with --worker;
onnx through static mode (`StaticLLM`), exported once into a cache directory keyed by the
weights' sha256. The reference backend is slow, so it runs a shorter workload (the first
--reference-num-prompts requests, --reference-decode-tokens new tokens); every rate is computed
from the tokens that engine produced, and the table says how many that was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

from flashllm.bench.workload import BenchRequest

ENGINES = ("reference", "cpu", "ipex", "onnx")
IPEX_PYTHON = Path(".nox") / "ipex" / "bin" / "python"
STATIC_CACHE = "static"  # under the flashllm cache root: <model>-<sha256[:16]>-<dtype>


class EngineSkipped(Exception):
    """An engine that cannot run here (interpreter or package missing); the message says why."""


@dataclass(frozen=True)
class Workload:
    """What one engine runs: a batch-1 prompt decoded for `decode_tokens`, then `requests` all at once."""

    latency_prompt: list[int]
    decode_tokens: int
    requests: list[BenchRequest]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        return cls(data["latency_prompt"], data["decode_tokens"], [BenchRequest(**r) for r in data["requests"]])

    def max_len(self) -> int:
        """The longest context any request reaches (prompt + new tokens)."""
        lens = [len(r.prompt_token_ids) + r.output_len for r in self.requests]
        return max([len(self.latency_prompt) + self.decode_tokens, *lens])


def add_parser(modes: Any) -> None:
    """Register `flashllm bench devices` on the bench subcommand's subparsers."""
    p = modes.add_parser("devices", help="reference vs cpu vs ipex vs onnx static mode: decode and throughput")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--model", default=None, help="HF model directory")
    group.add_argument("--shape", default=None, help="a named model shape (default qwen2.5-0.5b)")
    p.add_argument("--backends", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}, run in order")
    p.add_argument("--ipex-python", type=Path, default=None,
                   help=f"interpreter with IPEX for the ipex engine (default: {IPEX_PYTHON} when it exists)")
    p.add_argument("--dtype", default="float32", help="float32 | float16 (onnx exports these two)")
    p.add_argument("--prompt-len", type=int, default=128, help="batch-1 decode: prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode: new tokens")
    p.add_argument("--num-prompts", type=int, default=16, help="offline throughput: requests")
    p.add_argument("--input-len", default="32:256", help="offline throughput: prompt lengths A or A:B")
    p.add_argument("--output-len", default="16:128", help="offline throughput: output lengths A or A:B")
    p.add_argument("--reference-decode-tokens", type=int, default=16, help="the reference backend's batch-1 decode")
    p.add_argument("--reference-num-prompts", type=int, default=2, help="the reference backend's requests")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--onnx-cache", type=Path, default=None,
                   help=f"where exports are kept (default: <flashllm cache>/{STATIC_CACHE})")
    p.add_argument("--roofline-mib", type=int, default=1024, help="buffer of the bandwidth probe (far above L3)")
    p.add_argument("--json", type=Path, default=None, help="write the record here (else print it after the table)")


def run_devices(args: argparse.Namespace) -> int:
    """Measure the ceilings, then every engine in turn; print the table and the JSON record.

    Returns 1 when an engine failed (it is recorded with its error and the others still run).
    """
    from flashllm.bench.shapes import parameter_bytes, shape_model_dir

    engines = [e.strip() for e in args.backends.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise SystemExit(f"flashllm bench devices: unknown --backends {unknown or args.backends!r}; "
                         f"choose from {', '.join(ENGINES)}")
    if min(args.decode_tokens, args.reference_decode_tokens) < 2:
        raise SystemExit("flashllm bench devices: --decode-tokens and --reference-decode-tokens must be >= 2 "
                         "(the decode rate is measured between the first and the last token)")
    model_dir = Path(args.model) if args.model else shape_model_dir(args.shape or "qwen2.5-0.5b", args.dtype)
    workload = _workload(args, model_dir)
    record: dict[str, Any] = {
        "mode": "devices", "model": str(model_dir), "shape": args.shape, "dtype": args.dtype,
        "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "weight_bytes": parameter_bytes(model_dir),
        "workload": {"prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
                     "num_prompts": len(workload.requests), "input_len": args.input_len,
                     "output_len": args.output_len},
    }
    record.update(_roofline(args, model_dir, workload))
    record["engines"] = [_bracketed_engine(name, args, model_dir, workload, record) for name in engines]
    for engine in record["engines"]:
        if engine["status"] == "ok":
            _apply_ceilings(engine, record)
    print(format_table(record))
    text = json.dumps(record, indent=2)
    if args.json:
        args.json.write_text(text)
    else:
        print(text)
    return 1 if any(e["status"] == "failed" for e in record["engines"]) else 0


def _workload(args: argparse.Namespace, model_dir: Path) -> Workload:
    import random

    from flashllm.bench.workload import parse_range, random_requests
    from flashllm.models.hf_config import load_hf_config

    vocab = load_hf_config(model_dir).vocab_size
    requests = random_requests(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab,
                               args.seed)
    rng = random.Random(args.seed + 1)
    return Workload([rng.randrange(vocab) for _ in range(args.prompt_len)], args.decode_tokens, requests)


def _roofline(args: argparse.Namespace, model_dir: Path, workload: Workload) -> dict[str, Any]:
    """Read/copy bandwidth and GEMM FLOP/s measured now, and the throughput run's compute ceiling."""
    import torch

    from flashllm.bench import roofline as rl
    from flashllm.bench.shapes import flops_per_token

    size = args.roofline_mib << 20
    roof = rl.Roofline(rl.measure_read_bandwidth(size), rl.measure_bandwidth(size),
                       rl.measure_matmul(getattr(torch, args.dtype)), args.dtype, "read stream")
    mean_context = sum(len(r.prompt_token_ids) + r.output_len / 2 for r in workload.requests) / len(workload.requests)
    return {"roofline": {"read_bandwidth_gb_s": roof.bandwidth / 1e9, "copy_bandwidth_gb_s": roof.copy_bandwidth / 1e9,
                         "matmul_gflop_s": roof.matmul_flops / 1e9, "probe_bytes": size},
            "compute_ceiling_tokens_per_s": roof.compute_ceiling(flops_per_token(model_dir, mean_context))}


def _run_engine(name: str, args: argparse.Namespace, model_dir: Path, workload: Workload,
                record: dict[str, Any]) -> dict[str, Any]:
    """One engine's record: status ok / skipped / failed, its numbers as fractions of the ceilings."""
    if name == "reference":
        workload = replace(workload, decode_tokens=args.reference_decode_tokens,
                           requests=workload.requests[: args.reference_num_prompts])
    spec = {"model": str(model_dir), "dtype": args.dtype, "backend": name, "max_model_len": workload.max_len(),
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    try:
        if name == "ipex":
            result = _run_ipex(args, spec, workload)
        elif name == "onnx":
            result = _run_onnx(args, spec, workload)
        else:
            result = measure_llm(spec, workload)
            result["runs_in"] = f"this process, {result['runs_in']}"
    except EngineSkipped as exc:
        return {"engine": name, "status": "skipped", "reason": str(exc)}
    except Exception as exc:  # recorded and reported; the other engines still run
        return {"engine": name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    return {"engine": name, "status": "ok", **result}


def _bracketed_engine(name: str, args: argparse.Namespace, model_dir: Path, workload: Workload,
                      record: dict[str, Any]) -> dict[str, Any]:
    """_run_engine between two read probes: the record carries "probe_gb_s" and
    "ceiling_bandwidth_gb_s", the higher of the two, which its decode ceiling divides by.

    The shared VM's read stream drifts within a run (20 GB/s in one probe where others that hour
    read 34-35), so one probe for all engines would hand each a ceiling from another moment. The
    probe's buffers are held for the engine's run (roofline.held_ceiling_probe says why).
    """
    from flashllm.bench import roofline as rl
    from flashllm.bench.repeats import bracketed_run

    probe = rl.held_ceiling_probe("cpu", replace(rl.CPU_PLAN, read_bytes=args.roofline_mib << 20))
    return bracketed_run(lambda: _run_engine(name, args, model_dir, workload, record), probe)


def _apply_ceilings(engine: dict[str, Any], record: dict[str, Any]) -> None:
    """An engine's decode ceiling and its fractions of the bandwidth and compute ceilings."""
    bandwidth = engine["ceiling_bandwidth_gb_s"] * 1e9
    engine["decode_ceiling_tokens_per_s"] = bandwidth / engine["weight_bytes"]
    engine["latency"]["fraction_of_bandwidth_ceiling"] = (engine["latency"]["decode_tokens_per_s"]
                                                          / engine["decode_ceiling_tokens_per_s"])
    engine["latency"]["fraction_of_sustained_bandwidth"] = (engine["latency"]["decode_tokens_per_s"] * engine["weight_bytes"]
                                                       / (engine["sustained_bandwidth_gb_s"] * 1e9))
    engine["throughput"]["fraction_of_compute_ceiling"] = (engine["throughput"]["total_tokens_per_s"]
                                                           / record["compute_ceiling_tokens_per_s"])


def measure_llm(spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """Load flashllm with the spec's backend forced on the CPU and measure it (this process)."""
    import gc

    from flashllm.llm import LLM
    from flashllm.models.weight_bytes import weight_bytes

    start = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], device="cpu", backend=spec["backend"],
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"])
    load_s = time.perf_counter() - start
    sources = sorted(set(llm.engine.parts.ops.sources.values()))
    info = {"runs_in": f"backend {spec['backend']} (kernels of {', '.join(sources)})",
            "weight_bytes": weight_bytes(llm.engine.parts.model).total, "load_s": load_s}
    result = {**info, **measure(llm, workload)}
    del llm
    gc.collect()  # the next engine loads its own copy of the weights
    return result


def measure(llm: Any, workload: Workload) -> dict[str, Any]:
    """Warm up, then the batch-1 decode and the offline run of `workload` on an LLM or StaticLLM."""
    from flashllm.sampling_params import SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    llm.generate([workload.latency_prompt[:8]], params(2))
    single = llm.generate([workload.latency_prompt], params(workload.decode_tokens))[0]
    produced, metrics = len(single.outputs[0].token_ids), single.metrics
    latency = {"prompt_tokens": len(workload.latency_prompt), "requested_tokens": workload.decode_tokens,
               "output_tokens": produced, "ttft_s": metrics.time_to_first_token,
               "decode_tokens_per_s": (produced - 1) / (metrics.latency - metrics.time_to_first_token)}
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in workload.requests],
                           [params(r.output_len) for r in workload.requests])
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(r.prompt_token_ids) for r in workload.requests)
    throughput = {"num_requests": len(outputs), "prompt_tokens": in_tokens,
                  "requested_tokens": sum(r.output_len for r in workload.requests), "output_tokens": out_tokens,
                  "elapsed_s": elapsed, "output_tokens_per_s": out_tokens / elapsed,
                  "total_tokens_per_s": (out_tokens + in_tokens) / elapsed}
    return {"latency": latency, "throughput": throughput}


def ipex_python(given: Path | None) -> Path:
    """The interpreter for the ipex engine: --ipex-python, else .nox/ipex/bin/python here or in the checkout."""
    if given is not None:
        if not given.is_file():
            raise EngineSkipped(f"--ipex-python {given} does not exist")
        return given
    checkout = Path(__file__).resolve().parents[2]
    for candidate in (Path.cwd() / IPEX_PYTHON, checkout / IPEX_PYTHON):
        if candidate.is_file():
            return candidate
    raise EngineSkipped(f"no {IPEX_PYTHON} (build it with `nox -s ipex`, or pass --ipex-python PATH)")


def _run_ipex(args: argparse.Namespace, spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """Run measure_llm with backend ipex under the IPEX interpreter; this module's source is put on its path."""
    python = ipex_python(args.ipex_python)
    source_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (source_root, os.environ.get("PYTHONPATH"))))}
    with tempfile.TemporaryDirectory(prefix="flashllm-devices-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"spec": spec, "workload": asdict(workload)}))
        done = subprocess.run([str(python), "-m", "flashllm.bench.devices", "--worker", str(job), str(out)],
                              env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            raise RuntimeError(f"{python} exited with {done.returncode}:\n{tail}")
        result = json.loads(out.read_text())
    result["runs_in"] = f"{python} ({result.pop('versions')}), {result['runs_in']}"
    return result


def _run_onnx(args: argparse.Namespace, spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """Static mode: the cached export (made now if missing) through onnxruntime on the CPU."""
    import gc
    import importlib.util

    missing = [m for m in ("onnx", "onnxruntime", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise EngineSkipped(f"static mode needs {', '.join(missing)} (pip install 'flashllm[onnx]')")
    from flashllm.static import StaticLLM

    export_dir, export_s = onnx_export(Path(spec["model"]), spec["dtype"], args.onnx_cache)
    start = time.perf_counter()
    llm = StaticLLM(export_dir, device="cpu", dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                    max_num_seqs=spec["max_num_seqs"])
    info = {"runs_in": f"onnxruntime {llm.graph.provider}, export {export_dir}",
            "weight_bytes": sum((export_dir / name).stat().st_size for name in llm.manifest.files),
            "load_s": time.perf_counter() - start, "export_s": export_s}
    result = {**info, **measure(llm, workload)}
    del llm
    gc.collect()
    return result


def onnx_export(model_dir: Path, dtype: str, cache: Path | None = None) -> tuple[Path, float | None]:
    """The export of model_dir's weights in `dtype`, made on first use; (directory, seconds spent exporting or None).

    The directory is keyed by the sha256 the manifest records, so changed weights get a new export.
    """
    from flashllm.bench.shapes import cache_root
    from flashllm.models.loader import safetensors_files
    from flashllm.static.export import export_onnx
    from flashllm.static.manifest import MANIFEST_FILE, read_manifest, weights_sha256

    digest = weights_sha256(list(safetensors_files(model_dir)), model_dir / "config.json")
    target = (cache or cache_root() / STATIC_CACHE) / f"{model_dir.name}-{digest[:16]}-{dtype}"
    if (target / MANIFEST_FILE).is_file():
        manifest = read_manifest(target)
        if manifest.weights_sha256 == digest and manifest.dtype == dtype:
            return target, None
    start = time.perf_counter()
    export_onnx(model_dir, target, dtype)
    return target, time.perf_counter() - start


def format_table(record: dict[str, Any]) -> str:
    """One row per engine: batch-1 decode and offline throughput, each with its share of the ceiling."""
    roof = record["roofline"]
    lines = [f"model {record['model']} ({record['dtype']}), {record['cpu_count']} cores; read bandwidth at the start "
             f"{roof['read_bandwidth_gb_s']:.1f} GB/s (each engine: its own probes), matmul {roof['matmul_gflop_s']:.0f} GFLOP/s, compute ceiling "
             f"{record['compute_ceiling_tokens_per_s']:.1f} tok/s",
             f"{'engine':<10} {'decode tok/s':>12} {'of ceil':>7} {'TTFT s':>7} {'tokens':>7} | "
             f"{'out tok/s':>9} {'total tok/s':>11} {'of ceil':>7} {'reqs':>4} {'tokens':>7} {'s':>6}"]
    for e in record["engines"]:
        if e["status"] != "ok":
            lines.append(f"{e['engine']:<10} {e['status']}: {e['reason'].splitlines()[0]}")
            continue
        lat, thr = e["latency"], e["throughput"]
        lines.append(
            f"{e['engine']:<10} {lat['decode_tokens_per_s']:>12.2f} {lat['fraction_of_bandwidth_ceiling']:>7.1%} "
            f"{lat['ttft_s']:>7.3f} {lat['output_tokens']:>7} | {thr['output_tokens_per_s']:>9.2f} "
            f"{thr['total_tokens_per_s']:>11.2f} {thr['fraction_of_compute_ceiling']:>7.1%} "
            f"{thr['num_requests']:>4} {thr['output_tokens']:>7} {thr['elapsed_s']:>6.1f}")
    return "\n".join(lines)


def _worker(job_path: Path, out_path: Path) -> int:
    """The ipex subprocess: measure_llm on the job's spec and workload, written as JSON to out_path."""
    import torch

    job = json.loads(job_path.read_text())
    result = measure_llm(job["spec"], Workload.from_json(job["workload"]))
    from flashllm.backends.ipex import ipex_status

    result["versions"] = ipex_status()[1] if job["spec"]["backend"] == "ipex" else f"torch {torch.__version__}"
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        raise SystemExit("usage: python -m flashllm.bench.devices --worker JOB.json RESULT.json "
                         "(started by `flashllm bench devices`)")
    raise SystemExit(_worker(Path(sys.argv[2]), Path(sys.argv[3])))
