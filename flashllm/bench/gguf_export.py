"""Convert a flashllm-loadable HF directory (Llama, Qwen2, Qwen3, first-generation Qwen, Baichuan, Qwen2-MoE, Qwen3-MoE,
Mixtral, Gemma 3 text, Granite, Phi-3, DeepSeek-V2/V3, GLM, GLM-4-0414, GLM-4.5, ERNIE 4.5) to a GGUF file for the
llama.cpp baseline."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashllm.bench import gguf_gemma3, gguf_moe
from flashllm.bench.gguf_archs import ARCHS, ArchSpec

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install gguf"
CONVERTER_VERSION = "3"  # bumped when the file changes for the same weights (cached GGUFs are rebuilt); 3: F32 routers
FILE_TYPES = ("f32", "f16", "bf16", "q8_0", "mxfp4")
QUANT_BLOCK = 32  # Q8_0 packs rows in blocks of 32 values


class GGUFExportError(ValueError):
    """The model directory cannot be written as GGUF; the message says why and what to do."""


_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    **gguf_moe.LAYER_NAMES,
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
                 "model.embed_positions": "position_embd",  # learned absolute positions (GPT-2's wpe)
                 "model.embed_tokens.norm": "token_embd_norm"}  # BLOOM's word_embeddings_layernorm


def gguf_tensor_name(hf_name: str, layer_names: Mapping[str, str] | None = None) -> str | None:
    """GGUF name of an HF tensor ("model.layers.3.mlp.up_proj.weight" -> "blk.3.ffn_up.weight").

    layer_names: the arch's own HF module -> GGUF part entries, over Llama's (ArchSpec.layer_names).
    None for buffers llama.cpp recomputes (rotary inv_freq); GGUFExportError for anything unknown.
    """
    stem, _, suffix = hf_name.rpartition(".")
    if stem.endswith("rotary_emb"):
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".", 3)
    names = {**_LAYER_NAMES, **(layer_names or {})}
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in names:
        return f"blk.{int(parts[2])}.{names[parts[3]]}.{suffix}"
    raise GGUFExportError(f"no GGUF name for tensor {hf_name!r}; the exporter knows Llama/Qwen2 "
                          "checkpoints (embed_tokens, layers.N.self_attn/mlp/norms, norm, lm_head)")


def permute_for_llama_rope(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorder Q/K projection rows from HF's half-split rope to llama.cpp's interleaved pairs.

    rows: (num_heads * head_dim, ...) weight or (num_heads * head_dim,) bias. Within each head,
    HF rotates feature i with i + head_dim/2; llama.cpp rotates 2i with 2i+1. Output row
    2i of a head is input row i, output row 2i+1 is input row i + head_dim/2. Same shape/dtype.
    """
    head_dim = rows.shape[0] // num_heads
    if head_dim * num_heads != rows.shape[0] or head_dim % 2:
        raise GGUFExportError(f"cannot split {rows.shape[0]} rows into {num_heads} heads of even size")
    split = rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


def weights_hash(model_dir: Path) -> str:
    """sha256 (hex) of config, tokenizer and every safetensors file, plus the converter version."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(CONVERTER_VERSION.encode())
    names = ["config.json", "tokenizer.json", "tokenizer_config.json"]
    names += sorted(p.name for p in model_dir.glob("*.safetensors"))
    for name in names:
        path = model_dir / name
        if not path.is_file():
            continue
        digest.update(name.encode())
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 23):
                digest.update(chunk)
    return digest.hexdigest()


def cached_gguf(model_dir: Path, file_type: str = "f32", cache_dir: Path | None = None) -> Path:
    """The GGUF of `model_dir` in `file_type`, converted once into <cache>/gguf and reused.

    The file is keyed by `weights_hash`, so changed weights (or a new converter) convert again.
    cache_dir defaults to the shape cache root (FLASHLLM_CACHE_DIR or ~/.cache/flashllm).
    """
    from flashllm.bench.shapes import cache_root

    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / "gguf" / f"{Path(model_dir).name}-{weights_hash(model_dir)[:20]}-{file_type}.gguf"
    if not target.is_file():
        export_gguf(model_dir, target, file_type)
    return target


def export_gguf(model_dir: Path, out_path: Path, file_type: str = "f32") -> Path:
    """Write the model in `model_dir` as one GGUF file at `out_path` (atomically); returns out_path.

    file_type: "f32" | "f16" | "bf16" | "q8_0" | "mxfp4"; 1-D tensors (norms) and biases stay F32, and Q8_0
    falls back to F16 for a matrix whose rows are not a multiple of 32; "mxfp4" writes the stacked experts in
    MXFP4 (as the published gpt-oss files hold them) and everything else in F32. Tensors are read and
    written one at a time, so memory stays near the largest tensor.
    """
    gguf = _import_gguf()
    from flashllm.models.hf_config import load_hf_config

    if file_type not in FILE_TYPES:
        raise GGUFExportError(f"unknown GGUF file type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = load_hf_config(model_dir)
    spec = ARCHS.get(config.architecture)
    if spec is None:
        raise GGUFExportError(f"{config.architecture} cannot be exported to GGUF; supported: {', '.join(ARCHS)}")
    _check_supported(config, spec)
    tensors = _plan_tensors(model_dir, config, spec, file_type, gguf)
    writer = gguf.GGUFWriter(None, spec.gguf_arch)
    _add_hparams(writer, config, spec, file_type, gguf)
    if spec.checkpoint_hparams is not None:
        try:
            spec.checkpoint_hparams(writer, model_dir, config)
        except ValueError as exc:
            raise GGUFExportError(str(exc)) from exc
    _add_vocab(writer, model_dir, config, gguf)
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}-", dir=out_path.parent)
    os.close(fd)
    try:
        writer.write_header_to_file(Path(tmp))
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(gguf.quants.quantize(t.load(), t.qtype))
        writer.close()
        os.replace(tmp, out_path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out_path


def _check_supported(config: Any, spec: ArchSpec) -> None:
    """Refuse configs llama.cpp would run differently from the checkpoint (silently wrong baselines)."""
    if spec.permute_qk and config.rotary_dim != config.head_dim:
        raise GGUFExportError(f"partial rotary ({config.rotary_dim} of {config.head_dim} features) has no "
                              "GGUF export here; only full-head rope is supported")
    if config.architecture == gguf_gemma3.ARCHITECTURE:
        try:
            gguf_gemma3.check(config)
        except gguf_gemma3.Gemma3ExportError as exc:
            raise GGUFExportError(str(exc)) from exc
        return
    if spec.check is not None:
        try:
            spec.check(config)
        except ValueError as exc:
            raise GGUFExportError(str(exc)) from exc
        return
    if any(window is not None for window in config.sliding_windows):
        raise GGUFExportError("sliding-window attention layers have no GGUF export here; llama.cpp's "
                              f"{spec.gguf_arch} runs full attention")
    if config.architecture in gguf_moe.ARCHITECTURES:
        try:
            gguf_moe.check(config)
        except gguf_moe.MoEExportError as exc:
            raise GGUFExportError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class _PlannedTensor:
    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    nbytes: int
    load: Any  # () -> the fp32 numpy array to write


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise GGUFExportError(f"GGUF export needs the gguf package, which is not installed; run: {INSTALL_HINT}") from exc
    return gguf


def _plan_tensors(model_dir: Path, config: Any, spec: ArchSpec, file_type: str, gguf: Any) -> list[_PlannedTensor]:
    """Name, shape, type and byte size of every tensor to write, without reading any data yet."""
    planned = []
    for hf_name, shape, source in _hf_tensors(model_dir, config, spec):
        name = gguf_tensor_name(hf_name, spec.layer_names)
        if name is None or (name == "output.weight" and config.tie_word_embeddings):
            continue  # llama.cpp reuses token_embd when there is no output tensor
        # the converter keeps every `_norm.weight` F32, 2-D ones too (StableLM 2 12B's per-head q / k norm scales)
        kept_float = name.endswith((".bias", "_norm.weight")) or any(p in name for p in gguf_moe.FLOAT_NAME_PARTS)
        qtype = _tensor_qtype(shape, "f32" if kept_float else file_type, gguf, name)
        nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))
        planned.append(_PlannedTensor(name, tuple(shape), qtype, nbytes, source))
    names = {t.name for t in planned}
    if "token_embd.weight" not in names:
        raise GGUFExportError(f"{model_dir} has no model.embed_tokens.weight; is it a complete checkpoint?")
    if "output.weight" not in names and not config.tie_word_embeddings:
        # llama.cpp would quietly reuse token_embd as the output head
        raise GGUFExportError(f"{model_dir} has no lm_head.weight and tie_word_embeddings is false; "
                              "is it a complete checkpoint?")
    extra = {} if spec.extra_tensors is None else spec.extra_tensors(config)
    factors = _llama3_rope_factors(config)
    if factors is not None:
        extra["rope_freqs.weight"] = factors
    f32 = gguf.GGMLQuantizationType.F32
    for name, values in extra.items():
        planned.append(_PlannedTensor(name, values.shape, f32, values.nbytes, lambda values=values: values))
    return planned


def _tensor_qtype(shape: tuple[int, ...], file_type: str, gguf: Any, name: str = "") -> Any:
    q = gguf.GGMLQuantizationType
    if file_type == "mxfp4":
        experts = len(shape) == 3 and name.endswith("_exps.weight") and shape[-1] % QUANT_BLOCK == 0
        return q.MXFP4 if experts else q.F32
    if len(shape) < 2 or file_type == "f32":
        return q.F32
    if file_type == "q8_0" and shape[-1] % QUANT_BLOCK == 0:
        return q.Q8_0
    return q.BF16 if file_type == "bf16" else q.F16


def _hf_tensors(model_dir: Path, config: Any, spec: ArchSpec) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """(HF name, shape, loader) for every tensor in the directory's safetensors files, in name order."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GGUFExportError(f"{model_dir} has no *.safetensors files; GGUF export reads safetensors only")
    heads = ({"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
             if spec.permute_qk else {})
    entries = []
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            entries += [(name, tuple(fh.get_slice(name).get_shape()), path) for name in fh.keys()]
    items = [(name, shape, _loader(path, name, spec.norm_shift if name.endswith("norm.weight") else 0.0))
             for name, shape, path in sorted(entries)]
    try:  # MoE experts stacked into one tensor per projection (as llama.cpp reads them), DeepSeek's kv_b split
        items = list(spec.transform(items, config)) if spec.transform is not None else items
    except gguf_moe.MoEExportError as exc:
        raise GGUFExportError(f"{model_dir}: {exc}") from exc
    for name, shape, load in items:  # Q/K rows by the names the transform gives (Baichuan's split W_pack)
        num_heads = heads.get(name.rsplit(".", 1)[0].split(".", 3)[-1])
        yield name, shape, (_permuted(load, num_heads) if num_heads else load)


def _loader(path: Path, name: str, shift: float = 0.0) -> Any:
    def load() -> np.ndarray:
        import torch
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            array = fh.get_tensor(name).to(torch.float32).numpy()
        return array + np.float32(shift) if shift else array

    return load


def _permuted(load: Any, num_heads: int) -> Any:
    return lambda: permute_for_llama_rope(load(), num_heads)


def _llama3_rope_factors(config: Any) -> np.ndarray | None:
    """Per-frequency divisors llama.cpp applies for llama3 rope (plain / scaled inverse frequency)."""
    from flashllm.ops.rope_cache import rope_inv_freq, rope_type_of

    if rope_type_of(config.rope_scaling) != "llama3":
        return None
    plain, _ = rope_inv_freq(config.rotary_dim, config.rope_theta, None)
    scaled, _ = rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)
    return (plain / scaled).float().numpy()


def _add_hparams(writer: Any, config: Any, spec: ArchSpec, file_type: str, gguf: Any) -> None:
    from flashllm.ops.rope_cache import rope_type_of

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size if spec.feed_forward_length is None
                                   else spec.feed_forward_length(config))
    writer.add_head_count(config.num_attention_heads)
    if not spec.latent_heads:
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_dimension_count(config.rotary_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(_FILE_TYPE_IDS[file_type](gguf))
    if config.architecture in gguf_moe.ARCHITECTURES:
        gguf_moe.add_hparams(writer, config)
    if config.architecture == gguf_gemma3.ARCHITECTURE:
        gguf_gemma3.add_hparams(writer, config)
    if spec.add_hparams is not None:
        spec.add_hparams(writer, config)
    rope_type = rope_type_of(config.rope_scaling)
    if rope_type in spec.rope_types:
        return
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(config.rope_scaling["factor"]))
    elif rope_type not in ("default", "llama3"):  # llama3 travels as the rope_freqs tensor
        raise GGUFExportError(f"rope type {rope_type!r} has no GGUF export here; supported: default, linear, llama3")


_FILE_TYPE_IDS = {
    "f32": lambda g: g.LlamaFileType.ALL_F32, "f16": lambda g: g.LlamaFileType.MOSTLY_F16,
    "bf16": lambda g: g.LlamaFileType.MOSTLY_BF16, "q8_0": lambda g: g.LlamaFileType.MOSTLY_Q8_0,
    "mxfp4": lambda g: g.LlamaFileType.MOSTLY_MXFP4_MOE,
}


def _add_vocab(writer: Any, model_dir: Path, config: Any, gguf: Any) -> None:
    """BPE ("gpt2") vocabulary from tokenizer.json, padded with unused tokens to the embedding rows."""
    vocab = read_bpe_vocab(model_dir, config, gguf)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    if vocab.bos_token_id is not None:
        writer.add_bos_token_id(vocab.bos_token_id)
    if vocab.eos_token_id is not None:
        writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_add_bos_token(vocab.add_bos_token)


# ---------------------------------------------------------------- tokenizer

# llama.cpp picks its pre-tokenizer regex by name; these are the split patterns of known tokenizers.
_SPLIT_PATTERNS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}


@dataclass(frozen=True, slots=True)
class BPEVocab:
    """What GGUF's "gpt2" tokenizer model stores: one token text and type per embedding row."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool


def read_bpe_vocab(model_dir: Path, config: Any, gguf: Any) -> BPEVocab:
    """Read `<model_dir>/tokenizer.json` (a byte-level BPE) as a GGUF vocabulary of config.vocab_size.

    Rows the tokenizer does not use (random-weight shapes pair a big embedding with a small
    tokenizer) become "[PAD<id>]" tokens of type UNUSED; added special tokens become CONTROL.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise GGUFExportError(f"{model_dir} has no tokenizer.json; GGUF export needs a fast (tokenizers) BPE tokenizer")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFExportError(f"{path}: tokenizer model {model.get('type')!r} is not supported; expected BPE")
    kinds = gguf.TokenType
    tokens: list[str | None] = [None] * config.vocab_size
    types = [int(kinds.NORMAL)] * config.vocab_size
    for text, token_id in model.get("vocab", {}).items():
        _place(tokens, token_id, text, path)
    for added in data.get("added_tokens", []):
        _place(tokens, added["id"], added["content"], path)
        types[added["id"]] = int(kinds.CONTROL if added.get("special") else kinds.USER_DEFINED)
    for token_id, text in enumerate(tokens):
        if text is None:
            tokens[token_id], types[token_id] = f"[PAD{token_id}]", int(kinds.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    tokenizer_config = _read_json(Path(model_dir) / "tokenizer_config.json")
    add_bos = tokenizer_config.get("add_bos_token")
    if add_bos is None:
        add_bos = _template_adds_special_first(data.get("post_processor"))
    pre = _pre_tokenizer_name(_loaded_pre_tokenizer(model_dir) or data.get("pre_tokenizer"))
    return BPEVocab([t for t in tokens if t is not None], types, merges, pre,
                    _first_id(config.bos_token_id), _first_id(config.eos_token_id), bool(add_bos))


def _place(tokens: list[str | None], token_id: int, text: str, path: Path) -> None:
    if not 0 <= token_id < len(tokens):
        raise GGUFExportError(f"{path}: token {text!r} has id {token_id} but the model's embedding has "
                              f"{len(tokens)} rows; the tokenizer does not belong to this model")
    tokens[token_id] = text


def _loaded_pre_tokenizer(model_dir: Path) -> dict[str, Any] | None:
    """The pre-tokenizer of the tokenizer flashllm loads (transformers), which can differ from tokenizer.json's:
    transformers 5 builds a Qwen2 model's tokenizer with Qwen2's split pattern (digits one by one) whatever
    tokenizer.json says. None where transformers cannot load it."""
    try:
        from flashllm.models.tokenizer import load_tokenizer

        backend = load_tokenizer(model_dir).backend_tokenizer
        return json.loads(backend.to_str()).get("pre_tokenizer")
    except Exception:  # noqa: BLE001 - any failure falls back to tokenizer.json's own pre-tokenizer
        logger.debug("could not load the tokenizer of %s through transformers", model_dir, exc_info=True)
        return None


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenization ("gpt-2", "llama-bpe", "qwen2")."""
    pre = pre or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    for step in steps:
        name = _SPLIT_PATTERNS.get(str((step.get("pattern") or {}).get("Regex")))
        if step.get("type") == "Split" and name:
            return name
    logger.warning("pre-tokenizer %s is not one llama.cpp knows by name; writing 'default' (token ids given "
                   "directly, as the benchmark does, are unaffected)", pre.get("type"))
    return "default"


def _template_adds_special_first(post: dict[str, Any] | None) -> bool:
    """Whether a TemplateProcessing post-processor puts a special token (bos) before the text."""
    post = post or {}
    if post.get("type") != "TemplateProcessing":
        return False
    single = post.get("single") or [{}]
    return "SpecialToken" in single[0]


def _first_id(value: int | list[int] | None) -> int | None:
    return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
