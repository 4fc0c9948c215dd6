"""Export a Llama / Qwen2 model directory to an ONNX decoder step plus its tokenizer, config and manifest."""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from flashllm.models.loader import _allowed_roots, safetensors_files
from flashllm.static.decoder import StaticDecoder, load_static_decoder
from flashllm.static.manifest import (
    FIXED_INPUTS,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_FILE,
    StaticManifest,
    StaticModelError,
    past_names,
    present_names,
    weights_sha256,
)

logger = logging.getLogger(__name__)

DEFAULT_OPSET = 18
MIN_OPSET = 18  # the torch.export-based exporter emits opset 18 and newer
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# copied beside the graph when present, so the export directory is all the runner needs
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
              "chat_template.jinja", "chat_template.json")
SIDE_DIRS = ("additional_chat_templates",)
# past a 2 GiB protobuf the weights must live in a side file: switch well before
EXTERNAL_DATA_BYTES = 1 << 30
# Example sizes the graph is traced with; >= 2 so torch.export keeps the axes symbolic.
EXAMPLE_BATCH, EXAMPLE_NEW_TOKENS, EXAMPLE_PAST = 2, 3, 4


def require_export_packages() -> None:
    """Raise StaticModelError naming the extra when onnx or onnxscript (torch's exporter) is missing."""
    import importlib.util

    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise StaticModelError(f"exporting needs {' and '.join(missing)}, not installed; "
                               "run `pip install 'flashllm[onnx]'`")


def export_onnx(model_dir: str | Path, output_dir: str | Path, dtype: str = "float32",
                opset: int = DEFAULT_OPSET) -> StaticManifest:
    """Write `model.onnx`, config, tokenizer files and `flashllm_static.json` into output_dir.

    The graph is one decoder step (see StaticDecoder.forward) traced by torch's torch.export-based
    ONNX exporter, with symbolic batch, new-token and past-length axes. dtype: "float32" or
    "float16" (weights and KV cache; logits stay fp32). The manifest is written last, so a failed
    export never leaves a directory that looks complete. Raises StaticModelError (one line) on
    a bad dtype / opset or a non-empty output directory that is not an earlier export.
    """
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    if dtype not in TORCH_DTYPES:
        raise StaticModelError(f"--dtype {dtype!r} cannot be exported; choose one of {', '.join(TORCH_DTYPES)}")
    if opset < MIN_OPSET:
        raise StaticModelError(f"--opset {opset} is too old; the exporter needs opset >= {MIN_OPSET}")
    require_export_packages()
    _check_output(output_dir)
    decoder = load_static_decoder(model_dir, TORCH_DTYPES[dtype])
    _prepare_output(output_dir)
    files = _export_graph(decoder, output_dir, opset)
    _copy_side_files(model_dir, output_dir)
    config = decoder.config
    attn = decoder.model.layers[0].self_attn
    manifest = StaticManifest(
        format_version=FORMAT_VERSION, architecture=config.architecture, dtype=dtype, opset=opset,
        exporter=f"torch.onnx.export(dynamo=True), torch {torch.__version__}",
        num_layers=decoder.num_layers, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        vocab_size=config.vocab_size, inputs=[*FIXED_INPUTS, *past_names(decoder.num_layers)],
        outputs=["logits", *present_names(decoder.num_layers)], files=files,
        weights_sha256=weights_sha256(list(safetensors_files(model_dir)), model_dir / "config.json"),
    )
    manifest.write(output_dir)
    logger.info("exported %s to %s (%s)", model_dir, output_dir, ", ".join(files))
    return manifest


def _check_output(output_dir: Path) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise StaticModelError(f"--output {output_dir} is a file; give a directory")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not (output_dir / MANIFEST_FILE).is_file():
        raise StaticModelError(f"--output {output_dir} is not empty and holds no earlier export; "
                               "give a new or empty directory")


def _prepare_output(output_dir: Path) -> None:
    """Create the directory, clearing what an earlier export wrote (its manifest first: incomplete until the end)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / MANIFEST_FILE).unlink(missing_ok=True)
    for name in (MODEL_FILE, f"{MODEL_FILE}.data", *SIDE_FILES):
        (output_dir / name).unlink(missing_ok=True)
    for name in SIDE_DIRS:
        if (output_dir / name).is_dir() and not (output_dir / name).is_symlink():
            shutil.rmtree(output_dir / name)


def _example_inputs(decoder: StaticDecoder) -> tuple[torch.Tensor, ...]:
    b, t, p = EXAMPLE_BATCH, EXAMPLE_NEW_TOKENS, EXAMPLE_PAST
    positions = torch.arange(p, p + t).expand(b, t).contiguous()
    return (torch.zeros(b, t, dtype=torch.long), positions, torch.ones(b, p + t, dtype=torch.long),
            *decoder.empty_past(b, past_len=p))


def _dynamic_shapes(num_layers: int) -> tuple:
    from torch.export import Dim

    batch, new_tokens, past = Dim("batch"), Dim("sequence"), Dim("past_sequence")
    # attention_mask spans past + new tokens; torch.export derives that relation from the graph
    return ({0: batch, 1: new_tokens}, {0: batch, 1: new_tokens}, {0: batch, 1: Dim.AUTO},
            tuple({0: batch, 2: past} for _ in range(2 * num_layers)))


def _export_graph(decoder: StaticDecoder, output_dir: Path, opset: int) -> list[str]:
    """Trace and save the graph; returns the files written (the graph, and its weights file if external)."""
    import onnx

    num_layers = decoder.num_layers
    external = sum(p.numel() * p.element_size() for p in decoder.parameters()) > EXTERNAL_DATA_BYTES
    # the exporter reports progress on stdout and warns about axis names; keep the CLI quiet
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _quiet("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            decoder, _example_inputs(decoder), None, dynamo=True, opset_version=opset,
            input_names=[*FIXED_INPUTS, *past_names(num_layers)],
            output_names=["logits", *present_names(num_layers)],
            dynamic_shapes=_dynamic_shapes(num_layers), external_data=external, verbose=False,
        )
    model = program.model_proto
    mask = model.graph.input[FIXED_INPUTS.index("attention_mask")]
    mask.type.tensor_type.shape.dim[1].dim_param = "past_sequence + sequence"
    path, data_file = output_dir / MODEL_FILE, f"{MODEL_FILE}.data"
    if external:
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data_file)
        return [MODEL_FILE, data_file]
    onnx.save_model(model, path)
    return [MODEL_FILE]


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Raise a logger's level to ERROR for the block (the exporter warns about unrelated torchvision ops)."""
    log = logging.getLogger(logger_name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _copy_side_files(model_dir: Path, output_dir: Path) -> None:
    roots = _allowed_roots(model_dir)
    for name in SIDE_FILES:
        _copy_inside(model_dir / name, output_dir / name, roots)
    for name in SIDE_DIRS:
        if (model_dir / name).is_dir():
            for source in sorted((model_dir / name).iterdir()):
                (output_dir / name).mkdir(exist_ok=True)
                _copy_inside(source, output_dir / name / source.name, roots)


def _copy_inside(source: Path, target: Path, roots: list[Path]) -> None:
    if not source.is_file():
        return
    if not any(source.resolve().is_relative_to(root) for root in roots):
        raise StaticModelError(f"{source} links outside the model directory ({source.resolve()}); refusing to copy it")
    shutil.copyfile(source, target)


def graph_domains(model_path: str | Path) -> set[str]:
    """Operator domains a saved graph uses ("" is the standard ONNX domain); for custom-op checks."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    domains = {node.domain for node in model.graph.node}
    domains |= {node.domain for function in model.functions for node in function.node}
    return domains | {function.domain for function in model.functions}
