"""The capability matrix's `onnx` row (static-graph mode): cells from what the exporter writes, availability here."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from flashllm.cli import main
from flashllm.registry import matrix
from flashllm.registry import static_capabilities as capabilities
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import PRECISIONS, parse_dtype
from flashllm.static.manifest import DTYPES


def _exported_keys() -> set[str]:
    """Precision columns whose plain dtype is one the manifest (so the exporter) allows."""
    dtypes = {parse_dtype(name) for name in DTYPES}
    return {p.key for p in PRECISIONS if p.dtype in dtypes and p.quant == "none" and p.kv_dtype is None}


def test_onnx_row_claims_exactly_the_exported_dtypes_and_says_why_not_the_rest() -> None:
    row = matrix.static_graph_row()
    assert (row.backend, row.kind, row.proof) == ("onnx", "onnxruntime static graph", "conformance")
    claimed = {key for key, cell in row.cells.items() if cell.status == "native"}
    assert claimed == _exported_keys() == {"fp32", "fp16"}
    assert all(row.cells[k].proof == "conformance" for k in claimed)
    others = {p.key for p in PRECISIONS} - claimed
    assert all(row.cells[k].status == "missing" and row.cells[k].proof == "" for k in others)
    assert set(capabilities.NOT_EXPORTED) == others and all(capabilities.NOT_EXPORTED.values())


def test_page_has_one_onnx_row_after_the_backend_rows() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    page = matrix.render_markdown(plugins)
    table = [line for line in page.splitlines() if line.startswith("| ") and " | " in line]
    onnx_rows = [line for line in table if line.startswith("| onnx | ")]
    assert len(onnx_rows) == 1 and "onnx" not in plugins.backends()
    cells = onnx_rows[0].split(" | ")
    assert cells[1:3] == ["onnxruntime static graph", "conformance"]
    backend_rows = [line for line in table if line.split(" | ")[0][2:] in plugins.backends()]
    assert table.index(onnx_rows[0]) > max(table.index(line) for line in backend_rows)
    assert matrix.STATIC_LEGEND in page


def test_devices_lists_static_graph_mode_with_availability(capsys) -> None:
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    installed = importlib.util.find_spec("onnxruntime") is not None
    static = data["static_graph"]
    assert (static["name"], static["kind"], static["available"]) == ("onnx", "onnxruntime static graph", installed)
    if installed:
        import onnxruntime

        for provider in set(onnxruntime.get_available_providers()) & set(capabilities.PROVIDERS):
            assert provider in static["reason"]
    (row,) = [r for r in data["matrix"] if r["backend"] == "onnx"]
    assert (row["kind"], row["available"], row["here"]) == ("onnxruntime static graph", installed, installed)
    assert {r["kind"] for r in data["matrix"] if r["backend"] != "onnx"} == {matrix.BACKEND_KIND}
    assert main(["devices"]) == 0
    text = capsys.readouterr().out
    assert "Static-graph mode" in text and ("available: onnxruntime" if installed else "UNAVAILABLE") in text


def test_devices_without_onnxruntime_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    ok, reason = capabilities.onnxruntime_availability()
    assert not ok and "pip install 'flashllm[onnx]'" in reason
    assert main(["devices"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("onnx "))
    assert "UNAVAILABLE" in line and "flashllm[onnx]" in line
