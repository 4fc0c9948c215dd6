"""The capability matrix: generated from the registry, committed page kept fresh."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from flashllm.cli import main
from flashllm.models import catalog
from flashllm.registry import matrix
from flashllm.registry.backend import Backend, Caps
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import PRECISIONS, DeviceProfile

ROOT = Path(__file__).resolve().parents[2]


def test_committed_capability_page_is_fresh() -> None:
    page = ROOT / "docs" / "capabilities.md"
    assert catalog.main(["--check", str(page)]) == 0, "run: python -m flashllm.models.catalog --write docs/capabilities.md"


def test_check_detects_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "capabilities.md"
    stale.write_text("# old\n")
    assert catalog.main(["--check", str(stale)]) == 1
    assert catalog.main(["--write", str(stale)]) == 0
    assert catalog.main(["--check", str(stale)]) == 0


def test_cells_follow_device_rules_and_kernel_coverage() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    reference = plugins.backends()["reference"]
    by_key = {p.key: p for p in PRECISIONS}
    no_bf16 = DeviceProfile("old", frozenset({torch.float32, torch.float16}))
    partial = Backend("partial", "cpu", 1)
    partial.kernel("silu_and_mul", Caps(dtypes=frozenset({torch.float32})))(lambda x: x)
    assert matrix.precision_cell(partial, reference, no_bf16, by_key["bf16"]).status == "unsupported"
    fp32 = matrix.precision_cell(partial, reference, no_bf16, by_key["fp32"])
    assert (fp32.status, fp32.detail) == ("partial", f"1/{len(matrix.op_specs())}")
    assert matrix.precision_cell(partial, reference, no_bf16, by_key["fp16"]).status == "reference"


def test_cells_carry_the_proof_level_of_their_backend() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    reference = plugins.backends()["reference"]
    by_key = {p.key: p for p in PRECISIONS}
    no_bf16 = DeviceProfile("old", frozenset({torch.float32, torch.float16}))
    for level in ("conformance", "mapped"):
        backend = Backend(f"b_{level}", "cpu", 1, proof=level)
        backend.kernel("silu_and_mul", Caps(dtypes=frozenset({torch.float32})))(lambda x: x)
        assert matrix.precision_cell(backend, reference, no_bf16, by_key["fp32"]).proof == level
        assert matrix.precision_cell(backend, reference, no_bf16, by_key["bf16"]).proof == ""  # nothing runs
    page = matrix.render_markdown(plugins)
    assert matrix.PROOF_LEGEND in page and "| backend | device | proof |" in page
    for name, backend in plugins.backends().items():
        assert f"| {name} | " in page and backend.proof in matrix.PROOF_LEVELS
        rows = [line for line in page.splitlines() if line.startswith(f"| {name} | ")]
        assert rows and all(line.split(" | ")[2] == backend.proof for line in rows)


def test_devices_command_shows_cuda_rows_unavailable_with_reason(capsys) -> None:
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cuda_rows = [r for r in data["matrix"] if r["backend"] == "cuda"]
    assert {r["device"] for r in cuda_rows} >= {"Hopper (sm90)", "Ada (sm89)", "Ampere (sm80/86)", "Turing (sm75)", "Volta (sm70)"}
    if not torch.cuda.is_available():
        assert all(not r["available"] and "CUDA" in r["reason"] for r in cuda_rows)
    assert data["auto_device"] in {"cpu", "cuda"}
    cpu_here = [r for r in data["matrix"] if r["backend"] == "cpu" and r["here"]]
    assert len(cpu_here) == 1 and cpu_here[0]["cells"]["fp32"]["status"] == "native"
    assert main(["devices"]) == 0
    text = capsys.readouterr().out
    assert "cuda" in text and "UNAVAILABLE" in text and "Volta (sm70)" in text


def test_devices_command_shows_vendor_adapters_with_reasons_and_proof(capsys) -> None:
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    backends = {b["name"]: b for b in data["backends"]}
    for name in ("npu", "xpu", "dcu", "gcu"):
        rows = [r for r in data["matrix"] if r["backend"] == name]
        assert rows and backends[name]["proof"] == "mapped" and all(r["proof"] == "mapped" for r in rows)
        if not backends[name]["available"]:
            assert backends[name]["reason"] and all(r["reason"] == backends[name]["reason"] for r in rows)
    for row in data["matrix"]:
        for cell in row["cells"].values():
            runs = cell["status"] in ("native", "partial", "reference")
            assert cell["proof"] == (row["proof"] if runs else "")
    if importlib.util.find_spec("torch_npu") is None:
        assert "torch_npu is not installed" in backends["npu"]["reason"]
    assert main(["devices"]) == 0
    text = capsys.readouterr().out
    assert "Proof levels:" in text and " proof " in text and "Ascend 910B/910C (Atlas A2/A3)" in text
