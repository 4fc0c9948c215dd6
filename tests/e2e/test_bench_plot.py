"""`flashllm bench ... --plot` and `flashllm bench plot`: valid PNGs whose plotted numbers are the records'."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")

from flashllm.bench.plot import (  # noqa: E402
    PlotError,
    plot_records,
    plot_serve,
    plot_throughput,
    serve_figure,
    serve_series,
    throughput_bars,
    throughput_figure,
)
from flashllm.cli import main  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SERVE_KEYS = [f"p{q}_{m}_ms" for m in ("ttft", "tpot", "itl") for q in (50, 99)]


def check_png(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature and that an image reader agrees."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} lacks the PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13  # the first chunk of every PNG
    width, height = struct.unpack(">II", data[16:24])
    assert width > 0 and height > 0
    from matplotlib.image import imread

    pixels = imread(path)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0  # something was drawn, not a blank canvas
    return width, height


def throughput_record() -> dict[str, Any]:
    return {
        "mode": "throughput", "model": "/cache/shapes/qwen2.5-0.5b-float32", "shape": "qwen2.5-0.5b",
        "dtype": "bfloat16", "device": "cpu", "quant_type": "none", "date": "2031-02-03", "machine": "x86_64",
        "num_requests": 16, "flashllm": {"output_tokens_per_s": 412.5, "elapsed_s": 3.0},
        "transformers": [{"batch_size": 1, "output_tokens_per_s": 23.25, "elapsed_s": 50.0},
                         {"batch_size": 16, "output_tokens_per_s": 150.75, "elapsed_s": 8.0}],
        "decode_ceiling_batch1_tokens_per_s": 61.0,
    }


def serve_record(rate: float | str, base: float, throughput: float, **overrides: Any) -> dict[str, Any]:
    """A serve record whose six latency numbers are base + 1, base + 2, ... in SERVE_KEYS order."""
    record = {"mode": "serve", "model": "tiny", "endpoint": "completions", "dataset": "random", "num_prompts": 8,
              "request_rate": rate, "date": "2031-02-03", "machine": "x86_64", "output_throughput": throughput}
    record.update({key: base + i + 1 for i, key in enumerate(SERVE_KEYS)})
    return {**record, **overrides}


# ---------------------------------------------------------------- throughput chart


def test_throughput_chart_draws_the_record_numbers(tmp_path: Path) -> None:
    record = throughput_record()
    bars = throughput_bars(record)
    assert bars.tokens_per_s == [412.5, 23.25, 150.75]
    assert bars.batch_sizes == [None, 1, 16]
    assert bars.ceiling == 61.0
    fig = throughput_figure(record)
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == [412.5, 23.25, 150.75]
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [61.0]  # the ceiling
    title = ax.get_title()
    for part in ("qwen2.5-0.5b", "bfloat16", "cpu", "2031-02-03"):
        assert part in title
    out = tmp_path / "throughput.png"
    assert plot_throughput(record, out) == bars
    check_png(out)


def test_throughput_without_baseline_or_roofline_is_one_bar() -> None:
    record = {k: v for k, v in throughput_record().items()
              if k not in ("transformers", "decode_ceiling_batch1_tokens_per_s")}
    bars = throughput_bars(record)
    assert bars.tokens_per_s == [412.5] and bars.ceiling is None
    assert [p.get_height() for p in throughput_figure(record).axes[0].patches] == [412.5]


def test_a_baseline_batch_that_ran_out_of_memory_gets_no_bar() -> None:
    record = throughput_record()
    record["transformers"] = [*record["transformers"], {"batch_size": 256, "error": "out of memory"}]
    bars = throughput_bars(record)
    assert bars.tokens_per_s == [412.5, 23.25, 150.75] and bars.batch_sizes == [None, 1, 16]


def test_llama_cpp_runs_get_their_own_bars() -> None:
    record = {**throughput_record(), "llama.cpp": [{"batch_size": 1, "output_tokens_per_s": 31.5, "elapsed_s": 9.0}]}
    bars = throughput_bars(record)
    assert bars.tokens_per_s == [412.5, 23.25, 150.75, 31.5]
    assert bars.labels[-1].startswith("llama.cpp")
    assert [p.get_height() for p in throughput_figure(record).axes[0].patches] == [412.5, 23.25, 150.75, 31.5]


# ---------------------------------------------------------------- serve chart


def test_serve_series_sorts_by_rate_and_puts_inf_at_the_right_end(tmp_path: Path) -> None:
    records = [serve_record(4.0, 400, 40.5), serve_record("inf", 900, 90.5), serve_record(1, 100, 10.5),
               serve_record(2.0, 200, 20.5, p99_tpot_ms=None)]
    series = serve_series(records)
    assert series.rates == [1.0, 2.0, 4.0, math.inf]
    assert series.output_throughput == [10.5, 20.5, 40.5, 90.5]
    for i, key in enumerate(SERVE_KEYS):
        expected = [100 + i + 1, 200 + i + 1, 400 + i + 1, 900 + i + 1]
        got = series.latency_ms[key]
        if key == "p99_tpot_ms":  # None in the record: a gap in the line
            assert math.isnan(got[1])
            got, expected = got[:1] + got[2:], expected[:1] + expected[2:]
        assert got == expected, key
    assert series.positions[:3] == [1.0, 2.0, 4.0] and series.positions[3] > 4.0

    fig = serve_figure(records)
    left, right = fig.axes
    lines = {line.get_label(): line for line in left.get_lines()}
    assert set(lines) == {f"{m} p{q}" for m in ("TTFT", "TPOT", "ITL") for q in (50, 99)}
    assert list(lines["TTFT p50"].get_ydata()) == [101, 201, 401, 901]
    assert list(lines["ITL p99"].get_ydata()) == [106, 206, 406, 906]
    assert {lines[f"TPOT p{q}"].get_linestyle() for q in (50, 99)} == {"-", "--"}
    assert lines["TPOT p99"].get_linestyle() == "--"  # the legend's key: dashed = p99
    assert list(lines["TTFT p50"].get_xdata()) == series.positions
    assert list(right.get_lines()[0].get_ydata()) == [10.5, 20.5, 40.5, 90.5]
    labels = [t.get_text() for t in left.get_xticklabels()]
    assert labels[:3] == ["1", "2", "4"] and labels[3].startswith("inf")
    out = tmp_path / "serve.png"
    plot_serve(records, out)
    check_png(out)


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(st.floats(0.01, 1e4), min_size=0, max_size=6, unique=True), with_inf=st.booleans(),
       seed=st.randoms(use_true_random=False))
def test_every_point_is_its_record_at_an_order_keeping_position(rates: list[float], with_inf: bool,
                                                               seed: Any) -> None:
    all_rates: list[float | str] = [*rates, "inf"] if with_inf else list(rates)
    if not all_rates:
        all_rates = ["inf"]
    records = [serve_record(r, 1000.0 * i, float(i)) for i, r in enumerate(all_rates)]
    seed.shuffle(records)
    series = serve_series(records)
    as_float = [math.inf if r == "inf" else r for r in all_rates]
    assert series.rates == sorted(as_float)
    for j, rate in enumerate(series.rates):
        (i,) = [i for i, r in enumerate(as_float) if r == rate]  # rates are unique: the record of this point
        assert series.output_throughput[j] == float(i)
        assert [series.latency_ms[k][j] for k in SERVE_KEYS] == [1000.0 * i + n + 1 for n in range(6)]
        if math.isfinite(rate):
            assert series.positions[j] == rate
    assert all(a < b for a, b in zip(series.positions, series.positions[1:], strict=False))  # inf is right of every rate
    if with_inf and len(rates) > 1:  # inf keeps at least the mean gap, and a tenth of the top rate, from it
        top, gap = max(rates), (max(rates) - min(rates)) / (len(rates) - 1)
        assert series.positions[-1] - top >= max(gap, top / 10) * (1 - 1e-9)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(("records", "message"), [
    ([{"mode": "serve"}], "request_rate"),
    ([serve_record(0, 1, 1)], "request_rate"),
    ([serve_record("fast", 1, 1)], "request_rate"),
    ([{k: v for k, v in serve_record(1, 1, 1).items() if k != "p99_itl_ms"}], "p99_itl_ms"),
    ([serve_record(1, 1, 1), throughput_record()], "together"),
    ([throughput_record(), throughput_record()], "together"),
    ([{"mode": "eval"}], "together"),
])
def test_bad_records_are_refused_with_the_reason(records: list[dict[str, Any]], message: str,
                                                 tmp_path: Path) -> None:
    with pytest.raises(PlotError, match=message):
        plot_records(records, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(PlotError, match=r"pip install 'flashllm\[bench\]'"):
        plot_throughput(throughput_record(), tmp_path / "x.png")


def test_bench_refuses_a_non_png_plot_before_loading_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", "--model", str(tmp_path / "no-such-model"), "--plot", str(tmp_path / "t.jpg")]) == 2
    assert ".png" in capsys.readouterr().err


# ---------------------------------------------------------------- CLI


def test_bench_plot_command_charts_saved_serve_records(tmp_path: Path) -> None:
    paths = []
    for i, rate in enumerate([0.5, "inf", 8.0]):
        paths.append(tmp_path / f"serve_{i}.json")
        paths[-1].write_text(json.dumps(serve_record(rate, 10.0 * i, 5.0 + i)))
    out = tmp_path / "plots" / "latency.png"
    assert main(["bench", "plot", *map(str, paths), "--output", str(out)]) == 0
    check_png(out)
    (tmp_path / "t.json").write_text(json.dumps(throughput_record()))
    assert main(["bench", "plot", str(tmp_path / "t.json"), "-o", str(tmp_path / "t.png")]) == 0
    check_png(tmp_path / "t.png")


def test_real_throughput_run_plots_its_own_numbers(tmp_path: Path) -> None:
    from flashllm.testing.tiny_models import build_tiny_model

    # bench throughput asks for max_model_len 4096
    model = build_tiny_model(tmp_path / "llama", "llama", seed=0, max_position_embeddings=4096)
    record_path, png = tmp_path / "run.json", tmp_path / "run.png"
    argv = ["bench", "throughput", "--model", str(model), "--num-prompts", "3", "--input-len", "4:8",
            "--output-len", "2:3", "--device", "cpu", "--baseline", "transformers", "--baseline-batch-sizes", "1,2",
            "--json", str(record_path), "--plot", str(png)]
    assert main(argv) == 0
    record = json.loads(record_path.read_text())
    bars = throughput_bars(record)
    assert bars.tokens_per_s == [record["flashllm"]["output_tokens_per_s"],
                                 *[r["output_tokens_per_s"] for r in record["transformers"]]]
    assert bars.batch_sizes == [None, 1, 2] and all(v > 0 for v in bars.tokens_per_s)
    assert record["device"] == "cpu"
    check_png(png)


def test_real_serve_run_plots_its_one_rate(tmp_path: Path) -> None:
    from flashllm.testing.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "llama", "llama", seed=0)
    record_path, png = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = ["bench", "serve", "--model", str(model), "--max-model-len", "256", "--device", "cpu", "--dtype", "float32",
            "--num-prompts", "4", "--input-len", "4:8", "--output-len", "3:4", "--no-progress",
            "--json", str(record_path), "--plot", str(png)]
    assert main(argv) == 0
    record = json.loads(record_path.read_text())
    series = serve_series([record])
    assert series.rates == [math.inf] and series.output_throughput == [record["output_throughput"]]
    assert {k: v[0] for k, v in series.latency_ms.items()} == {k: record[k] for k in SERVE_KEYS}
    check_png(png)


def test_serve_plot_without_json_charts_a_temporary_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flashllm.bench.serve_run as serve_run

    seen: list[Path] = []

    def fake_run_serve(args: Any) -> int:  # stands in for the server round trip; writes what run_serve would
        seen.append(args.json)
        args.json.write_text(json.dumps(serve_record(3.0, 50.0, 12.0)))
        return 0

    monkeypatch.setattr(serve_run, "run_serve", fake_run_serve)
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9/v1", "--plot", str(tmp_path / "s.png")]) == 0
    check_png(tmp_path / "s.png")
    assert len(seen) == 1 and not seen[0].exists()  # the temporary record is gone
