"""The precision capability matrix, generated from backends' kernels and device profiles.

`python -m flashllm.registry.matrix --write docs/capabilities.md` renders the committed page;
`--check` fails when it is stale.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from flashllm.ops import op_specs
from flashllm.registry.backend import ANY_DEVICE, PROOF_LEVELS, Backend, OpRequest
from flashllm.registry.plugins import FlashPlugins, make_plugin_manager
from flashllm.registry.precision import PRECISIONS, DeviceProfile, Precision, activation_dtype, device_supports

# Shape used to ask kernels about head- and block-size gated ops in the matrix.
MATRIX_HEAD_SIZE = 128
MATRIX_BLOCK_SIZE = 64

SYMBOLS = {"native": "✅", "partial": "🟡", "reference": "🔵", "unsupported": "❌", "missing": "⛔"}
LEGEND = (
    "✅ every op has a kernel of this backend · 🟡 some ops run the reference kernel · "
    "🔵 every op runs the reference kernel · ❌ the device cannot run it · ⛔ not implemented yet"
)
KERNELS_LEGEND = ("Activation dtypes each backend's kernels claim, then weight formats and ALiBi (attention biases "
                  "of models such as Baichuan-13B) where claimed; an op a backend lacks, or a model needing what "
                  "its kernel does not claim, runs the reference kernel, listed at engine start.")
# Cells whose status says something runs carry the proof level of their backend.
PROVEN_STATUSES = frozenset({"native", "partial", "reference"})
PROOF_LEGEND = "Proof levels: " + " · ".join(f"{level}: {why}" for level, why in PROOF_LEVELS.items())

STATIC_LEGEND = ("The onnx row is static-graph mode (`flashllm export --format onnx`, then `--mode static`): ✅ the "
                 "exporter writes this precision and onnxruntime runs the whole graph · ⛔ not exported")
BACKEND_KIND = "registry backend"
# cell detail of a precision static-graph mode does not export (the row's notes say why)
NOT_EXPORTED_DETAIL = "not exported"

# The reference backend runs wherever torch runs: its row shows what it implements.
ANY_PROFILE = DeviceProfile(
    "any torch device",
    frozenset({torch.float32, torch.float16, torch.bfloat16}),
    frozenset(p.quant for p in PRECISIONS),
    frozenset({torch.int8, torch.float8_e4m3fn}),
)


@dataclass(frozen=True, slots=True)
class Cell:
    """One backend x device x precision verdict."""

    status: str  # native | partial | reference | unsupported | missing
    detail: str
    proof: str = ""  # a PROOF_LEVELS key where something runs, "" where nothing does

    def render(self) -> str:
        return f"{SYMBOLS[self.status]} {self.detail}".strip()


@dataclass(frozen=True, slots=True)
class MatrixRow:
    """One backend on one device generation (or static-graph mode), with a cell per precision."""

    backend: str
    profile: str
    cells: dict[str, Cell]
    notes: str = ""
    proof: str = ""
    kind: str = BACKEND_KIND


def precision_cell(backend: Backend, reference: Backend, profile: DeviceProfile, precision: Precision) -> Cell:
    """What `backend` offers for `precision` on a device described by `profile`, and how it is proven."""
    cell = _coverage_cell(backend, reference, profile, precision)
    if cell.status in PROVEN_STATUSES:
        return Cell(cell.status, cell.detail, backend.proof)
    return cell


def _coverage_cell(backend: Backend, reference: Backend, profile: DeviceProfile, precision: Precision) -> Cell:
    why_not = device_supports(precision, profile)
    if why_not is not None:
        return Cell("unsupported", "")
    dtype = activation_dtype(precision, profile)
    request = OpRequest(dtype, precision.kv_dtype or dtype, precision.quant, MATRIX_HEAD_SIZE, MATRIX_BLOCK_SIZE)
    native, missing = 0, []
    specs = op_specs()
    for name, spec in specs.items():
        if _serves(backend, name, request, spec.uses):
            native += 1
        elif not _serves(reference, name, request, spec.uses):
            missing.append(name)
    if missing:
        return Cell("missing", ", ".join(missing))
    if native == len(specs) or backend is reference:
        return Cell("native" if backend is not reference else "reference", "")
    return Cell("partial" if native else "reference", f"{native}/{len(specs)}" if native else "")


def _serves(backend: Backend, op: str, request: OpRequest, uses: frozenset[str]) -> bool:
    return any(k.mismatch(request, uses) is None for k in backend.kernels.get(op, []))


def build_rows(plugins: FlashPlugins) -> list[MatrixRow]:
    """Every backend x every device profile it documents (the reference: any device)."""
    backends = plugins.backends()
    reference = backends["reference"]
    rows = []
    for backend in backends.values():
        profiles = [ANY_PROFILE] if backend.device_type == ANY_DEVICE else backend.known_profiles()
        for profile in profiles:
            cells = {p.key: precision_cell(backend, reference, profile, p) for p in PRECISIONS}
            rows.append(MatrixRow(backend.name, profile.name, cells, profile.notes, backend.proof))
    return rows


def static_graph_row() -> MatrixRow:
    """Static-graph mode's row: onnxruntime runs the whole exported graph, so it has no kernels to match.

    Cells come from what the exporter writes (registry/static_capabilities.py); every other precision
    is "missing" with the reason in NOT_EXPORTED.
    """
    from flashllm.registry import static_capabilities as static

    exported = set(static.EXPORTED_PRECISIONS.values())
    cells = {p.key: Cell("native", "", static.PROOF) if p.key in exported else Cell("missing", NOT_EXPORTED_DETAIL)
             for p in PRECISIONS}
    return MatrixRow(static.ROW_NAME, static.ROW_KIND, cells, static.NOTES, static.PROOF, kind=static.ROW_KIND)


def render_markdown(plugins: FlashPlugins) -> str:
    """The capability page: machine-independent, so it can be committed and checked."""
    header = "| backend | device | proof | " + " | ".join(p.label for p in PRECISIONS) + " | notes |"
    sep = "|" + "---|" * (len(PRECISIONS) + 4)
    lines = [
        "# Capability matrix",
        "",
        "Generated by `python -m flashllm.registry.matrix --write docs/capabilities.md` from the",
        "registered backends' kernels and device profiles; CI fails when it is stale. `flashllm devices`",
        "prints the same matrix with what is available on the machine at hand.",
        "",
        LEGEND,
        "",
        PROOF_LEGEND + ". Every runnable cell of a row is proven at the row's level.",
        "",
        STATIC_LEGEND + " (the row's notes say why).",
        "",
        header,
        sep,
    ]
    for row in [*build_rows(plugins), static_graph_row()]:
        cells = " | ".join(row.cells[p.key].render() for p in PRECISIONS)
        lines.append(f"| {row.backend} | {row.profile} | {row.proof} | {cells} | {row.notes} |")
    lines += ["", "## Kernels by op", "", KERNELS_LEGEND, "", _kernel_table(plugins), ""]
    return "\n".join(lines)


def _kernel_table(plugins: FlashPlugins) -> str:
    backends = plugins.backends()
    lines = ["| op | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for op in op_specs():
        cells = [_describe_kernels(b, op) for b in backends.values()]
        lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _describe_kernels(backend: Backend, op: str) -> str:
    kernels = backend.kernels.get(op, [])
    if not kernels:
        return "—"
    dtypes = sorted({str(d).removeprefix("torch.") for k in kernels for d in k.caps.dtypes})
    quant = sorted({q for k in kernels for q in k.caps.quant} - {"none"})
    alibi = "; ALiBi" if any(k.caps.alibi for k in kernels) else ""
    return ", ".join(dtypes) + (f"; {', '.join(quant)}" if quant else "") + alibi


def main(argv: list[str] | None = None) -> int:
    """--write PATH renders the page; --check PATH exits 1 if the committed page is stale."""
    parser = argparse.ArgumentParser(prog="python -m flashllm.registry.matrix", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, metavar="PATH")
    group.add_argument("--check", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    # Only built-in backends belong in the committed page, whatever plugins are installed here.
    text = render_markdown(make_plugin_manager(load_entry_points=False))
    if args.write:
        args.write.write_text(text, encoding="utf-8")
        return 0
    current = args.check.read_text(encoding="utf-8") if args.check.exists() else ""
    if current != text:
        print(f"{args.check} is stale: run python -m flashllm.registry.matrix --write {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
