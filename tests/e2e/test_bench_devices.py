"""`flashllm bench devices` on a tiny model: one row per engine, every engine producing the requested tokens."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from flashllm.bench.devices import IPEX_PYTHON
from flashllm.bench.workload import random_requests
from flashllm.cli import main
from flashllm.testing.tiny_models import build_tiny_model

CHECKOUT = Path(__file__).resolve().parents[2]
HAS_IPEX_VENV = (CHECKOUT / IPEX_PYTHON).is_file()
HAS_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime", "onnxscript"))
SMALL = ["--prompt-len", "12", "--decode-tokens", "6", "--num-prompts", "3", "--input-len", "4:12",
         "--output-len", "2:6", "--reference-decode-tokens", "3", "--reference-num-prompts", "1", "--seed", "7",
         "--roofline-mib", "16"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("devices") / "llama", "llama", seed=0)


def _bench(tmp_path: Path, model_dir: Path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "record.json"
    code = main(["bench", "devices", "--model", str(model_dir), *SMALL, "--onnx-cache", str(tmp_path / "onnx"),
                 "--json", str(out), *argv])
    return code, json.loads(out.read_text())


def test_every_engine_runs_the_requested_tokens_against_the_same_ceilings(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, record = _bench(tmp_path, model_dir)
    table = capsys.readouterr().out
    assert code == 0
    engines = {e["engine"]: e for e in record["engines"]}
    assert list(engines) == ["reference", "cpu", "ipex", "onnx"]
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert list(rows) == list(engines)

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    requested = [r.output_len for r in random_requests(3, (4, 12), (2, 6), vocab, seed=7)]
    expected_runs = {"reference": (3, requested[:1]), "cpu": (6, requested), "ipex": (6, requested),
                     "onnx": (6, requested)}
    expected_status = {"reference": "ok", "cpu": "ok", "ipex": "ok" if HAS_IPEX_VENV else "skipped",
                       "onnx": "ok" if HAS_ONNX else "skipped"}
    assert {name: e["status"] for name, e in engines.items()} == expected_status, engines
    for name, e in engines.items():
        # each engine between its own two read probes, against the higher one
        assert len(e["probe_gb_s"]) == 2 and e["ceiling_bandwidth_gb_s"] == max(e["probe_gb_s"]) > 0
        bandwidth = e["ceiling_bandwidth_gb_s"] * 1e9
        if e["status"] != "ok":
            assert rows[name].split()[1] == "skipped:"
            continue
        decode_tokens, outputs = expected_runs[name]
        lat, thr = e["latency"], e["throughput"]
        assert lat["output_tokens"] == lat["requested_tokens"] == decode_tokens, name
        assert thr["num_requests"] == len(outputs) and thr["output_tokens"] == sum(outputs), name
        assert lat["decode_tokens_per_s"] > 0 and lat["ttft_s"] > 0 and thr["elapsed_s"] > 0
        assert lat["fraction_of_bandwidth_ceiling"] == pytest.approx(
            lat["decode_tokens_per_s"] * e["weight_bytes"] / bandwidth)
        assert e["sustained_bandwidth_gb_s"] == max(e["sustained_probe_gb_s"]) <= e["ceiling_bandwidth_gb_s"]
        assert lat["fraction_of_sustained_bandwidth"] == pytest.approx(
            lat["decode_tokens_per_s"] * e["weight_bytes"] / (e["sustained_bandwidth_gb_s"] * 1e9))
        assert thr["fraction_of_compute_ceiling"] == pytest.approx(
            thr["total_tokens_per_s"] / record["compute_ceiling_tokens_per_s"])
        cells = rows[name].split()
        assert int(cells[4]) == decode_tokens and int(cells[-2]) == sum(outputs), rows[name]
    if HAS_IPEX_VENV:
        assert str(IPEX_PYTHON) in engines["ipex"]["runs_in"] and "ipex" in engines["ipex"]["runs_in"]
    else:
        assert "nox -s ipex" in engines["ipex"]["reason"]
    assert engines["cpu"]["runs_in"].startswith("this process, backend cpu")
    if HAS_ONNX:
        assert engines["onnx"]["export_s"] > 0
        again = _bench(tmp_path, model_dir, "--backends", "onnx")[1]["engines"][0]
        assert again["status"] == "ok" and again["export_s"] is None  # the cached export is reused
        assert again["runs_in"] == engines["onnx"]["runs_in"]


def test_a_missing_ipex_interpreter_is_skipped_with_the_reason(model_dir: Path, tmp_path: Path) -> None:
    code, record = _bench(tmp_path, model_dir, "--backends", "ipex", "--ipex-python", str(tmp_path / "nope"))
    assert code == 0
    [engine] = record["engines"]
    assert engine["status"] == "skipped" and str(tmp_path / "nope") in engine["reason"]


def test_unknown_engines_are_refused(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "devices", "--model", str(model_dir), *SMALL, "--backends", "cpu,tpu"])
    assert code == 2 and "unknown --backends" in capsys.readouterr().err
