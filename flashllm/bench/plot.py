"""PNG charts of `flashllm bench` records: output tokens/s per engine and batch size, serving latency vs load."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'flashllm[bench]'"
SERVE_METRICS = ("ttft", "tpot", "itl")
SERVE_PERCENTILES = (50, 99)
OFFLINE_MODES = ("throughput", "latency")


class PlotError(ValueError):
    """A record cannot be plotted, or matplotlib is missing."""


@dataclass(frozen=True, slots=True)
class ThroughputBars:
    """What the throughput chart draws: one bar per engine run, left to right.

    batch_sizes: None for flashllm (continuous batching), the static batch size for a baseline;
    ceiling: the batch-1 decode ceiling in tokens/s from --roofline, None when not measured.
    """

    labels: list[str]
    batch_sizes: list[int | None]
    tokens_per_s: list[float]
    ceiling: float | None


@dataclass(frozen=True, slots=True)
class ServeSeries:
    """What the latency-vs-load chart draws: one point per record, by ascending request rate.

    rates: requests/s, math.inf for "all at once"; positions: the x of each point, where inf sits
    one step right of the largest finite rate; latency_ms: "p50_ttft_ms" etc. -> y per point
    (nan where the record has no samples, e.g. TPOT of one-token replies); output_throughput: tok/s.
    """

    rates: list[float]
    positions: list[float]
    latency_ms: dict[str, list[float]]
    output_throughput: list[float]


def require_matplotlib() -> None:
    """Raise PlotError naming the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotError(f"plotting needs matplotlib, which is not installed; run: {INSTALL_HINT}") from exc


def check_plot_target(output: Path) -> None:
    """Fail before a long benchmark, not after it: `output` must be a .png path and matplotlib installed."""
    if Path(output).suffix.lower() != ".png":
        raise PlotError(f"plot file {output} must end in .png (the chart is written as PNG)")
    require_matplotlib()


def load_record(path: Path) -> dict[str, Any]:
    """The JSON object `flashllm bench ... --json FILE` wrote to `path`."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise PlotError(f"cannot read benchmark record {path}: {exc}; pass a file written by "
                        "`flashllm bench ... --json FILE`") from exc
    if not isinstance(record, dict) or "mode" not in record:
        raise PlotError(f"{path} is not a benchmark record (no 'mode' key); pass a file written by "
                        "`flashllm bench ... --json FILE`")
    return record


# ---------------------------------------------------------------- offline throughput

BASELINES = ("transformers", "llama.cpp")  # record keys holding lists of baseline runs


def throughput_bars(record: dict[str, Any]) -> ThroughputBars:
    """Output tokens/s of flashllm and of each baseline run (transformers static batches, llama.cpp)."""
    _expect_mode(record, OFFLINE_MODES)
    labels, sizes = ["flashllm\n(continuous batching)"], [None]
    values = [float(_field(record["flashllm"], "output_tokens_per_s", "flashllm"))]
    for engine in BASELINES:
        for run in record.get(engine, []):
            if "error" in run:  # a static batch that did not run (out of memory): no bar
                continue
            size = int(_field(run, "batch_size", engine))
            labels.append(f"{engine}\nbatch {size}")
            sizes.append(size)
            values.append(float(_field(run, "output_tokens_per_s", engine)))
    ceiling = record.get("decode_ceiling_batch1_tokens_per_s")
    return ThroughputBars(labels, sizes, values, None if ceiling is None else float(ceiling))


def throughput_figure(record: dict[str, Any]) -> Any:
    """A matplotlib Figure with one bar per engine run (and the batch-1 ceiling as a dashed line)."""
    bars = throughput_bars(record)
    fig, ax = _figure((8.0, 5.0))
    colors = ["tab:blue"] + ["tab:gray"] * (len(bars.labels) - 1)  # flashllm stands out from the baselines
    drawn = ax.bar(range(len(bars.labels)), bars.tokens_per_s, color=colors)
    ax.bar_label(drawn, fmt="%.1f")
    ax.set_xticks(range(len(bars.labels)), bars.labels)
    if bars.ceiling is not None:
        ax.axhline(bars.ceiling, color="tab:red", linestyle="--", label="memory-bandwidth ceiling, batch 1")
        ax.legend(loc="upper right")
    ax.set_ylabel("output tokens/s")
    ax.set_title(_offline_title(record), fontsize=10)
    return fig


def plot_throughput(record: dict[str, Any], output: Path) -> ThroughputBars:
    """Write the throughput chart of `record` to `output` (PNG); returns the plotted numbers."""
    _save(throughput_figure(record), output)
    return throughput_bars(record)


def _offline_title(record: dict[str, Any]) -> str:
    model = record.get("shape") or Path(str(record.get("model", "?"))).name
    dtype = record.get("dtype", "?")
    if record.get("quant_type", "none") != "none":
        dtype = f"{dtype}, {record['quant_type']}"
    device = record.get("device") or "device ?"
    return (f"flashllm bench {record['mode']}: {model} ({dtype}), {record.get('num_requests', '?')} requests\n"
            f"{device} on {record.get('machine', '?')}, {record.get('date', '?')}")


# ---------------------------------------------------------------- serving latency vs load


def serve_series(records: list[dict[str, Any]]) -> ServeSeries:
    """The points of the latency-vs-load chart: one per `bench serve` record, sorted by request rate."""
    if not records:
        raise PlotError("no serve records to plot; pass one or more files written by `flashllm bench serve --json`")
    for record in records:
        _expect_mode(record, ("serve",))
    ordered = sorted(records, key=_rate)
    rates = [_rate(r) for r in ordered]
    keys = [f"p{q}_{name}_ms" for name in SERVE_METRICS for q in SERVE_PERCENTILES]
    latency = {key: [_number_or_nan(_field(r, key, "serve")) for r in ordered] for key in keys}
    throughput = [float(_field(r, "output_throughput", "serve")) for r in ordered]
    return ServeSeries(rates, rate_positions(rates), latency, throughput)


def rate_positions(rates: list[float]) -> list[float]:
    """x positions for ascending request rates: finite rates as they are, inf one step to the right
    of the largest finite rate, or at 1.0 when every rate is inf.

    The step is the mean gap between distinct finite rates, at least a tenth of the largest rate
    (so inf stays visibly apart from nearly equal rates), or half the rate when there is only one.
    """
    finite = sorted({r for r in rates if math.isfinite(r)})
    if not finite:
        inf_x = 1.0
    elif len(finite) == 1:
        inf_x = finite[0] * 1.5
    else:
        inf_x = finite[-1] + max((finite[-1] - finite[0]) / (len(finite) - 1), finite[-1] / 10)
    return [r if math.isfinite(r) else inf_x for r in rates]


def serve_figure(records: list[dict[str, Any]]) -> Any:
    """A matplotlib Figure: TTFT/TPOT/ITL p50 (solid, o) and p99 (dashed, ^) in ms on the left axis,
    output tokens/s (dotted black) on the right, against the request rate."""
    series = serve_series(records)
    fig, ax = _figure((9.0, 5.5))
    colors = {"ttft": "tab:blue", "tpot": "tab:orange", "itl": "tab:green"}
    for name in SERVE_METRICS:
        # p99 differs by line and marker, so a single-rate chart (points, no lines) still tells them apart
        for q, style, marker in zip(SERVE_PERCENTILES, ("-", "--"), ("o", "^"), strict=True):
            ax.plot(series.positions, series.latency_ms[f"p{q}_{name}_ms"], style, marker=marker,
                    color=colors[name], label=f"{name.upper()} p{q}")
    right = ax.twinx()
    right.plot(series.positions, series.output_throughput, ":", marker="s", color="black",
               label="output throughput")
    ticks = sorted(set(zip(series.positions, series.rates, strict=True)))
    ax.set_xticks([x for x, _ in ticks], ["inf\n(all at once)" if math.isinf(r) else f"{r:g}" for _, r in ticks])
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("latency (ms)")
    right.set_ylabel("output throughput (tokens/s)")
    ax.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title(_serve_title(records), fontsize=10)
    return fig


def plot_serve(records: list[dict[str, Any]], output: Path) -> ServeSeries:
    """Write the latency-vs-load chart of `records` to `output` (PNG); returns the plotted numbers."""
    _save(serve_figure(records), output)
    return serve_series(records)


def plot_records(records: list[dict[str, Any]], output: Path) -> None:
    """Plot saved records: any number of serve records, or one throughput/latency record."""
    modes = {r.get("mode") for r in records}
    if modes == {"serve"}:
        plot_serve(records, output)
    elif len(records) == 1 and modes <= set(OFFLINE_MODES):
        plot_throughput(records[0], output)
    else:
        raise PlotError(f"cannot plot records of modes {sorted(map(str, modes))} together; pass serve records "
                        "(one per request rate) or a single throughput/latency record")


def _serve_title(records: list[dict[str, Any]]) -> str:
    first = records[0]
    models = sorted({str(r.get("model", "?")) for r in records})
    return (f"flashllm bench serve: {', '.join(models)} ({first.get('endpoint', '?')}, "
            f"{first.get('dataset', '?')} dataset, {first.get('num_prompts', '?')} prompts per rate)\n"
            f"{first.get('machine', '?')}, {max(str(r.get('date', '?')) for r in records)}")


def _rate(record: dict[str, Any]) -> float:
    value = _field(record, "request_rate", "serve")
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise PlotError(f"bad request_rate {value!r} in a serve record: expected a number > 0 or \"inf\"")


# ---------------------------------------------------------------- shared


def _expect_mode(record: dict[str, Any], modes: tuple[str, ...]) -> None:
    if record.get("mode") not in modes:
        raise PlotError(f"expected a `flashllm bench {' | '.join(modes)}` record, got mode {record.get('mode')!r}")


def _field(record: dict[str, Any], key: str, mode: str) -> Any:
    if key not in record:
        raise PlotError(f"the {mode} record has no {key!r}; write it again with a current `flashllm bench ... --json`")
    return record[key]


def _number_or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def _figure(size: tuple[float, float]) -> tuple[Any, Any]:
    """A Figure on the Agg canvas, built without pyplot so no global backend or figure list is touched."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Any, output: Path) -> None:
    output = Path(output)
    check_plot_target(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=120)
