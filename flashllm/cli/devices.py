"""`flashllm devices`: backends available here, the precision capability matrix and the registered models."""

from __future__ import annotations

import argparse
import json
from typing import Any

from flashllm.registry.matrix import (
    LEGEND,
    PROOF_LEGEND,
    STATIC_LEGEND,
    MatrixRow,
    ModelRow,
    build_rows,
    op_backends,
    static_graph_row,
)
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import PRECISIONS
from flashllm.registry.resolve import DeviceSelectionError, select_device


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("devices", help="list backends and what each device can run")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def collect() -> dict[str, Any]:
    """Backends with availability on this machine, the auto-selected device, the matrix and the models.

    Static-graph mode (onnxruntime running an exported graph) is not a backend: it is listed
    under "static_graph" and its matrix row has kind "onnxruntime static graph".
    """
    plugins = make_plugin_manager()
    backends = []
    here: dict[str, str] = {}
    for backend in plugins.backends().values():
        ok, reason = backend.is_available()
        profile = None
        if ok and backend.device_type != "*":
            profile = backend.device_profile(select_device(backend.device_type, plugins=plugins).device).name
            here[backend.name] = profile
        backends.append({
            "name": backend.name, "device_type": backend.device_type, "priority": backend.priority,
            "proof": backend.proof, "available": ok, "reason": reason, "device_profile_here": profile,
            "install_hint": "" if ok else backend.install_hint,
        })
    try:
        auto = str(select_device("auto", plugins=plugins).device)
    except DeviceSelectionError as err:
        auto = f"none: {err}"
    rows = []
    for row in build_rows(plugins):
        available = next(b for b in backends if b["name"] == row.backend)
        here_row = here.get(row.backend) == row.profile or (row.backend == "reference")
        rows.append(_row_json(row, here_row, available["available"], available["reason"]))
    static = _static_graph()
    rows.append(_row_json(static_graph_row(), static["available"], static["available"], static["reason"]))
    failures = [f.describe() for f in plugins.failures]
    return {"backends": backends, "static_graph": static, "auto_device": auto, "matrix": rows,
            "models": _models_json(plugins), "plugin_failures": failures}


def _models_json(plugins: Any) -> list[dict[str, Any]]:
    # imported here, not at module level: `flashllm --help` imports every command module and must stay light
    from flashllm.models.catalog import model_rows

    ops = op_backends(plugins)
    return [{"architecture": m.architecture, "family": m.family, "class": m.target, "error": m.error,
             "required_ops": {op: ops.get(op, []) for op in m.required_ops},
             "attention_needs": list(m.attention_needs),
             "weight_only": None if m.weight_only is None else list(m.weight_only),
             "prequantized": None if m.prequantized is None else list(m.prequantized),
             "tokenizer": None if m.tokenizer is None else list(m.tokenizer)}
            for m in model_rows(plugins)]


def _row_json(row: MatrixRow, here: bool, available: bool, reason: str) -> dict[str, Any]:
    return {
        "backend": row.backend, "kind": row.kind, "device": row.profile, "proof": row.proof, "here": here,
        "available": available, "reason": reason,
        "cells": {k: {"status": c.status, "detail": c.detail, "proof": c.proof} for k, c in row.cells.items()},
    }


def _static_graph() -> dict[str, Any]:
    from flashllm.registry import static_capabilities as static

    ok, reason = static.onnxruntime_availability()
    return {"name": static.ROW_NAME, "kind": static.ROW_KIND, "proof": static.PROOF, "available": ok,
            "reason": reason, "why_not": dict(static.NOT_EXPORTED)}


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print("Backends (highest priority first):")
    for b in data["backends"]:
        state = "available" if b["available"] else "UNAVAILABLE"
        # a reason that already names the package to install need not repeat it
        hint = f" [install: {b['install_hint']}]" if b["install_hint"] and b["install_hint"] not in b["reason"] else ""
        print(f"  {b['name']:<10} {b['device_type']:<5} prio {b['priority']:<4} proof {b['proof']:<11} "
              f"{state}: {b['reason']}{hint}")
    for failure in data["plugin_failures"]:
        print(f"  ! {failure}")
    g = data["static_graph"]
    print(f"Static-graph mode (--mode static; not a backend: {g['kind']} runs the whole exported graph):")
    print(f"  {g['name']:<10} {'':<5} {'':<9} proof {g['proof']:<11} "
          f"{'available' if g['available'] else 'UNAVAILABLE'}: {g['reason']}")
    print(f"\n--device auto selects: {data['auto_device']}\n")
    print(_matrix_text(data["matrix"]))
    print("\n" + LEGEND + "\n" + PROOF_LEGEND + "\n" + STATIC_LEGEND +
          " (--json says why)\n* = this machine; rows of unavailable backends show why.")
    print("\nModels (architecture names in config.json; docs/capabilities.md has the backends per op):")
    print(_models_text(data["models"]))
    return 0


def _models_text(models: list[dict[str, Any]]) -> str:
    headers = ["architecture", "family", "needs", "weight-only", "pre-quantized", "tokenizer"]
    table = [headers]
    for m in models:
        if m["error"]:
            table.append([m["architecture"], m["family"], m["error"], "", "", ""])
            continue
        row = ModelRow(m["architecture"], m["class"], m["family"], tuple(m["required_ops"]),
                       tuple(m["attention_needs"]), _maybe_tuple(m["weight_only"]), _maybe_tuple(m["prequantized"]),
                       _maybe_tuple(m["tokenizer"]))
        weight, pre = row.quant_text()
        table.append([row.architecture, row.family, row.needs(), weight, pre, row.tokenizer_text()])
    widths = [max(len(r[i]) for r in table) for i in range(len(headers) - 1)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
                     for r in table)


def _maybe_tuple(value: list[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def _matrix_text(rows: list[dict[str, Any]]) -> str:

    headers = ["backend", "device", "proof"] + [p.key for p in PRECISIONS] + ["here"]
    table = [headers]
    for row in rows:
        cells = [_cell(row["cells"][p.key]) for p in PRECISIONS]
        where = "*" if row["here"] and row["available"] else ("" if row["available"] else f"no: {row['reason']}")
        table.append([row["backend"], row["device"], row["proof"]] + cells + [where])
    widths = [max(_width(r[i]) for r in table) for i in range(len(headers) - 1)]
    out = []
    for r in table:
        out.append("  ".join(c + " " * (w - _width(c)) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    return "\n".join(out)


def _cell(cell: dict[str, str]) -> str:
    from flashllm.registry.matrix import SYMBOLS

    # op lists of unimplemented cells are in docs/capabilities.md; the terminal keeps counts only
    return SYMBOLS[cell["status"]] + (cell["detail"] if cell["status"] == "partial" else "")


def _width(text: str) -> int:
    # emoji symbols take two terminal columns
    from flashllm.registry.matrix import SYMBOLS

    return len(text) + sum(text.count(s) for s in SYMBOLS.values())
