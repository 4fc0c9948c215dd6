"""The precision capability matrix, generated from backends' kernels and device profiles.

The models section takes ModelRow records built above this layer (flashllm.models.catalog, which
also has the page's entry point: `python -m flashllm.models.catalog --write docs/capabilities.md`,
`--check` fails when it is stale); the registry never imports a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashllm.ops import op_specs
from flashllm.registry.backend import ANY_DEVICE, PROOF_LEVELS, Backend, OpRequest
from flashllm.registry.plugins import FlashPlugins
from flashllm.registry.precision import PRECISIONS, DeviceProfile, Precision, activation_dtype, device_supports

# Shape used to ask kernels about head- and block-size gated ops in the matrix.
MATRIX_HEAD_SIZE = 128
MATRIX_BLOCK_SIZE = 64

SYMBOLS = {"native": "✅", "partial": "🟡", "reference": "🔵", "unsupported": "❌", "missing": "⛔"}
LEGEND = (
    "✅ every op has a kernel of this backend · 🟡 some ops run the reference kernel · "
    "🔵 every op runs the reference kernel · ❌ the device cannot run it · ⛔ not implemented yet"
)
KERNELS_LEGEND = ("Activation dtypes each backend's kernels claim, then weight formats, ALiBi (attention biases "
                  "of models such as Baichuan-13B), score softcap (Gemma 2), sinks and swigluoai experts (gpt-oss) "
                  "where claimed; an op a backend lacks, or a model needing what its kernel does not claim, runs the "
                  "reference kernel, listed at engine start.")
# Cells whose status says something runs carry the proof level of their backend.
PROVEN_STATUSES = frozenset({"native", "partial", "reference"})
PROOF_LEGEND = "Proof levels: " + " · ".join(f"{level}: {why}" for level, why in PROOF_LEVELS.items())

STATIC_LEGEND = ("The onnx row is static-graph mode (`flashllm export --format onnx`, then `--mode static`): ✅ the "
                 "exporter writes this precision and onnxruntime runs the whole graph · ⛔ not exported")
BACKEND_KIND = "registry backend"
# cell detail of a precision static-graph mode does not export (the row's notes say why)
NOT_EXPORTED_DETAIL = "not exported"

MODELS_LEGEND = ("One row per registered architecture name (plugins' included). Needs: ops beyond a dense decoder's, "
                 "with the backends that have a kernel for them, and attention features beyond causal attention. "
                 "Weight-only: `--quant_type` schemes quantized at load (columns of the matrix above). "
                 "Pre-quantized: `quantization_config` methods the config parser accepts (refused: it loads "
                 "float checkpoints only). Tokenizer: the checkpoint file it is built from, never remote code.")
NOT_DECLARED = "not declared"

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


@dataclass(frozen=True, slots=True)
class ModelRow:
    """What one registered architecture declares (its class attributes; see flashllm.models.base.CausalLM).

    Tuples that are None were not declared by the class; `error` is set (and the rest empty) when
    its lazy target could not be imported.
    """

    architecture: str
    target: str  # "module:Class"
    family: str  # the module's last component, e.g. "mixtral"
    required_ops: tuple[str, ...] = ()
    attention_needs: tuple[str, ...] = ()
    weight_only: tuple[str, ...] | None = None
    prequantized: tuple[str, ...] | None = None
    tokenizer: tuple[str, ...] | None = None
    error: str = ""

    def needs(self, op_backends: dict[str, list[str]] | None = None) -> str:
        """Ops and attention features beyond a dense decoder's, "—" for none; op_backends adds who serves each op."""
        ops = [f"{op} ({', '.join(op_backends.get(op, []) or ['no backend'])})" if op_backends is not None else op
               for op in self.required_ops]
        return ", ".join([*ops, *(f"attention: {need}" for need in self.attention_needs)]) or "—"

    def quant_text(self) -> tuple[str, str]:
        """(weight-only schemes, pre-quantized methods) as shown in both renderings."""
        weight = NOT_DECLARED if self.weight_only is None else (", ".join(self.weight_only) or "none")
        pre = NOT_DECLARED if self.prequantized is None else (", ".join(m.upper() for m in self.prequantized)
                                                               or "refused")
        return weight, pre

    def tokenizer_text(self) -> str:
        return NOT_DECLARED if self.tokenizer is None else " or ".join(self.tokenizer)


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


def render_markdown(plugins: FlashPlugins, models: Sequence[ModelRow] = ()) -> str:
    """The capability page: machine-independent, so it can be committed and checked.

    `models` (from flashllm.models.catalog.model_rows) adds the models section; none: backends only.
    """
    header = "| backend | device | proof | " + " | ".join(p.label for p in PRECISIONS) + " | notes |"
    sep = "|" + "---|" * (len(PRECISIONS) + 4)
    lines = [
        "# Capability matrix",
        "",
        "Generated by `python -m flashllm.models.catalog --write docs/capabilities.md` from the",
        "registered backends' kernels and device profiles and the registered models; CI fails when it is",
        "stale. `flashllm devices` prints the same matrix with what is available on the machine at hand.",
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
    if models:
        lines += ["## Models", "", MODELS_LEGEND, "", models_markdown(models, op_backends(plugins)), ""]
    return "\n".join(lines)


def op_backends(plugins: FlashPlugins) -> dict[str, list[str]]:
    """Op name -> the backends with at least one kernel for it, highest priority first."""
    backends = plugins.backends()
    return {op: [name for name, b in backends.items() if b.kernels.get(op)] for op in op_specs()}


def models_markdown(models: Sequence[ModelRow], ops: dict[str, list[str]]) -> str:
    """The models table: one row per architecture name, in the order given."""
    lines = ["| architecture | family | class | needs | weight-only | pre-quantized | tokenizer |",
             "|---|---|---|---|---|---|---|"]
    for m in models:
        if m.error:
            lines.append(f"| `{m.architecture}` | {m.family} | `{m.target}` | {m.error} | | | |")
            continue
        weight, pre = m.quant_text()
        lines.append(f"| `{m.architecture}` | {m.family} | `{m.target}` | {m.needs(ops)} | {weight} | {pre} | "
                     f"{m.tokenizer_text()} |")
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
    softcap = "; score softcap" if any(k.caps.softcap for k in kernels) else ""
    sinks = "; sinks" if any(k.caps.sinks for k in kernels) else ""
    activations = sorted({a for k in kernels for a in k.caps.moe_activations} - {"silu"})
    extra = "".join(f"; {a}" for a in activations)
    return ", ".join(dtypes) + (f"; {', '.join(quant)}" if quant else "") + alibi + softcap + sinks + extra
