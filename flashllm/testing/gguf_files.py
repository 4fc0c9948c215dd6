"""Write GGUF files from tiny Hugging Face model directories as llama.cpp's converter lays them out, for tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

# transformers name (after "model.layers.N.") -> llama.cpp name (after "blk.N.")
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def interleave_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's Q/K rows: per head, rows i and i + d/2 become 2i and 2i + 1."""
    out = np.empty_like(rows)
    head_dim = rows.shape[0] // num_heads
    half = head_dim // 2
    for h in range(num_heads):
        base = h * head_dim
        for i in range(half):
            out[base + 2 * i] = rows[base + i]
            out[base + 2 * i + 1] = rows[base + half + i]
    return out


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a transformers Llama/Qwen2 tensor name."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def write_gguf(model_dir: str | Path, out_path: str | Path, qtype: str = "F32", *, tokenizer: bool = True,
               metadata: dict[str, Any] | None = None, types: dict[str, str] | None = None) -> Path:
    """Write the tiny model in `model_dir` (config.json, model.safetensors, tokenizer.json) as a GGUF file.

    qtype: "F32", "F16" or a block type of gguf.quants ("Q8_0", "Q4_0", ...) for the 2-D weights
    (norms and biases stay F32, as llama.cpp keeps them). Llama's q/k rows are interleaved for
    llama.cpp's rotary; Qwen2's and Qwen3's are not. A tied lm_head is left out, as llama.cpp does.
    metadata: extra key -> value pairs (strings, ints, floats) written as they are.
    types: per-projection exceptions to qtype, llama.cpp's name part -> type ({"attn_v": "Q8_0"}), as
    llama.cpp's mixes (Q4_K_M) store some projections in another type.
    """
    import gguf

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"] if config["model_type"] in ("qwen2", "qwen3") else "llama"
    writer = gguf.GGUFWriter(str(out_path), arch)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads:  # as llama.cpp's converter records Qwen3's explicit head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if tokenizer:
        add_bpe_vocab(writer, model_dir, config["vocab_size"])
    for key, value in (metadata or {}).items():
        _add_value(writer, key, value)
    weights = load_file(str(model_dir / "model.safetensors"))
    for name in sorted(weights):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = weights[name].to(torch.float32).numpy()
        proj = name.rsplit(".", 2)[-2]
        if arch == "llama" and proj in ("q_proj", "k_proj"):
            array = interleave_rope_rows(array, heads if proj == "q_proj" else kv_heads)
        kind = tensor_type(gguf_name(name), qtype, types) if array.ndim == 2 else "F32"
        _add_tensor(writer, gguf, gguf_name(name), array, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


def tensor_type(name: str, qtype: str, types: dict[str, str] | None) -> str:
    """The type write_gguf stores the 2-D tensor `name` ("blk.0.attn_v.weight") in."""
    parts = name.split(".")
    part = parts[2] if len(parts) > 3 else parts[0]
    return (types or {}).get(part, qtype)


def _add_tensor(writer: Any, gguf: Any, name: str, array: np.ndarray, qtype: str) -> None:
    if qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, quantize_rows(array, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])


def _add_value(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        writer.add_string(key, str(value))


def add_bpe_vocab(writer: Any, model_dir: Path, rows: int, pre: str = "gpt-2") -> None:
    """tokenizer.json's byte-level BPE as a "gpt2" vocabulary of `rows` tokens (unused rows padded), with its
    special tokens as CONTROL tokens, bos/eos from tokenizer_config.json and the chat template."""
    import gguf

    data = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(rows)]
    types = [int(gguf.TokenType.UNUSED)] * rows
    for text, index in data["model"]["vocab"].items():
        tokens[index], types[index] = text, int(gguf.TokenType.NORMAL)
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    for key, add in (("eos_token", writer.add_eos_token_id), ("bos_token", writer.add_bos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if isinstance(config.get(key), str):
            add(tokens.index(config[key]))
    writer.add_add_bos_token(False)
    template = model_dir / "chat_template.jinja"
    source = template.read_text() if template.is_file() else config.get("chat_template")
    if isinstance(source, str):
        writer.add_chat_template(source)


def quantize_rows(rows: np.ndarray, qtype: str) -> np.ndarray:
    """(N, K) fp32 rows as GGUF blocks of `qtype`, uint8 (N, row bytes): the gguf package's quantizer
    where it has one, else this module's plain Q4_K / Q6_K ones (the gguf package has none for them)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if qtype == "Q4_K":
        return _q4_k(rows)
    if qtype == "Q6_K":
        return _q6_k(rows)
    return gguf.quants.quantize(rows, kind)


def _half(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K: per 256 features fp16 d and dmin, 8 sub-blocks of 32 with 6-bit scale and minimum codes,
    4-bit codes; W = d * sc * q - dmin * m (the block layout of ggml's block_q4_K)."""
    n, k = rows.shape
    x = rows.reshape(-1, 8, 32)
    low = np.minimum(x.min(-1), 0.0)                       # (B, 8) <= 0
    step = (x.max(-1) - low) / 15.0
    d = _half(step.max(-1) / 63.0).astype(np.float32)      # (B,)
    dmin = _half(-low.min(-1) / 63.0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(step / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(-low / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        scale = d[:, None] * sc.astype(np.float32)
        q = np.where(scale[..., None] > 0, np.rint((x + (dmin[:, None] * m)[..., None]) / scale[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)   # 32 bytes per 64 features: low nibbles first
    packed = np.concatenate((
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)), axis=-1).astype(np.uint8)
    heads = np.stack((_half(d), _half(dmin)), -1).view(np.uint8).reshape(-1, 4)
    return np.concatenate((heads, packed, qs), axis=-1).reshape(n, -1)


def _q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K: per 256 features 6-bit codes (low 4 bits in ql, high 2 in qh), 16 int8 scales of 16
    features and an fp16 d; W = d * scale * (q - 32) (the block layout of ggml's block_q6_K)."""
    n, k = rows.shape
    x = rows.reshape(-1, 16, 16)
    step = np.abs(x).max(-1) / 31.0                         # (B, 16)
    d = _half(step.max(-1) / 127.0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sub = np.where(d[:, None] > 0, np.rint(step / d[:, None]), 0).clip(-128, 127).astype(np.int8)
        scale = d[:, None] * sub.astype(np.float32)
        q = np.where(scale[..., None] > 0, np.rint(x / scale[..., None]), 0)
    c = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)   # (B, half, quarter, 32)
    low, high = c & 15, c >> 4
    ql = np.stack((low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)), axis=2).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    tail = np.concatenate((sub.view(np.uint8), _half(d).view(np.uint8).reshape(-1, 2)), axis=-1)
    return np.concatenate((ql, qh, tail), axis=-1).reshape(n, -1)


# ---------------------------------------------------------------- reading exported files back, for the GGUF tests

def exports(root: Path, sources: Any) -> Any:
    """get(name, file_type) -> `sources[name]` exported once by bench/gguf_export.py as "f32" or "q8_0" under
    `root` (sources: a mapping of names to model directories)."""
    from flashllm.bench.gguf_export import export_gguf

    written: dict[tuple[str, str], Path] = {}

    def get(name: str, file_type: str) -> Path:
        if (name, file_type) not in written:
            written[name, file_type] = export_gguf(sources[name], root / f"{name}-{file_type}.gguf", file_type)
        return written[name, file_type]

    return get


def export_of(root: Path, name: str, source: Path) -> Callable[[str], Path]:
    """file_type -> the one directory `source` exported once as "f32" or "q8_0" under `root` (`exports` of
    {name: source})."""
    get = exports(root, {name: source})
    return lambda file_type: get(name, file_type)


def moe_source(root: Path, preset: str, seed: int, **changes: Any) -> Path:
    """tiny_moe's `preset` built in `root` with `changes` beside a trained 300-token tokenizer (the exporter writes
    the vocabulary) that sets its vocab_size."""
    from flashllm.testing.tiny_moe import build_moe_model
    from flashllm.testing.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(root, vocab_size=300)
    return build_moe_model(root, preset, seed=seed, vocab_size=len(tokenizer), **changes)


def check_config_fields(path: Path, source: Path, fields: tuple[str, ...], approx: tuple[str, ...] = ("rms_norm_eps",),
                        rel: float | None = None) -> tuple[Any, Any]:
    """load_hf_config of the GGUF file `path` equals that of its source directory in `fields`, and is
    pytest.approx(..., rel=rel) of it in `approx` (float32 metadata); returns both configs (the file's first)."""
    import pytest

    from flashllm.models.hf_config import load_hf_config

    ours, expected = load_hf_config(path), load_hf_config(source)
    for field in fields:
        assert getattr(ours, field) == getattr(expected, field), field
    for field in approx:
        assert getattr(ours, field) == pytest.approx(getattr(expected, field), rel=rel), field
    return ours, expected


def load_float_model(path: str | Path, ops: Any, registry: Any, **kwargs: Any) -> torch.nn.Module:
    """The model of a directory or GGUF file, fp32 on the CPU (flashllm's loader)."""
    from flashllm.models.loader import load_model

    return load_model(path, ops, torch.float32, "cpu", registry, progress=False, **kwargs)[0]


def prompt_logits(model: torch.nn.Module, driver_cls: Any, prompt: list[int]) -> torch.Tensor:
    """Every prompt position's logits from one prefill through the paged test driver (8-token blocks)."""
    driver = driver_cls(model, block_size=8, num_blocks=16)
    return driver.step([(driver.add_sequence(), prompt)])[0]


def greedy_tokens(model: torch.nn.Module, driver_cls: Any, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt`, decoded one at a time through the paged test driver."""
    driver = driver_cls(model, block_size=8, num_blocks=16)
    seq = driver.add_sequence()
    logits, out = driver.step([(seq, prompt)])[0][-1], []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = driver.step([(seq, [out[-1]])])[0][-1]
    return out


def check_f32_file(path: Path, source: Path, ops: Any, registry: Any, driver_cls: Any, prompt: list[int],
                   steps: int = 8) -> torch.nn.Module:
    """The model of the F32 GGUF file `path` gives the prompt logits of its source directory (within 1e-5) and
    transformers' greedy tokens on the directory; returns that model."""
    from transformers import AutoModelForCausalLM

    ours = load_float_model(path, ops, registry)
    expected = prompt_logits(load_float_model(source, ops, registry), driver_cls, prompt)
    torch.testing.assert_close(prompt_logits(ours, driver_cls, prompt), expected, rtol=0, atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():  # no stop token: the greedy run here does not stop either
        tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    assert greedy_tokens(ours, driver_cls, prompt, steps) == tokens[0, len(prompt):].tolist()
    return ours


def q8_0_round_trip_copy(source: Path, out: Path, keep: tuple[str, ...] = ()) -> Path:
    """A copy of the directory `source` whose every matrix (except names ending in `keep`) is replaced by gguf's
    Q8_0 quantize-then-dequantize of it: the float model a Q8_0 export stands for (rows must be whole blocks)."""
    return round_trip_copy(source, out, lambda name: None if name.endswith(keep) else "Q8_0")


def round_trip_copy(source: Path, out: Path, types: dict[str, str] | Callable[[str], str | None],
                    transposed: Callable[[str], bool] = lambda name: False) -> Path:
    """A copy of the directory `source` whose matrices are replaced by their quantize_rows-then-gguf-dequantize
    values: in types[part] for a name `...<part>.weight` ({"gate_proj": "Q4_K"}), or in types(name) where that
    is not None; a stack of matrices (experts stored (E, N, K)) row by row as the matrices would be, or, where
    transposed(name), stored (E, K, N) (gpt-oss's experts: the rows a file holds are its columns). Raises
    ValueError for a matrix whose rows are not whole blocks of its type."""
    import shutil

    import gguf
    from safetensors.torch import save_file

    type_of = types if callable(types) else (lambda name: types.get(name.rsplit(".", 2)[-2]))
    shutil.copytree(source, out)
    weights = load_file(str(source / "model.safetensors"))
    for name, value in weights.items():
        qtype = type_of(name) if value.dim() in (2, 3) else None
        if qtype is None:
            continue
        kind = gguf.GGMLQuantizationType[qtype]
        flip = transposed(name)
        value = value.transpose(-1, -2).contiguous() if flip else value
        if value.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            raise ValueError(f"{name}: rows of {value.shape[-1]} are not whole {qtype} blocks")
        rows = value.float().reshape(-1, value.shape[-1]).numpy()
        rounded = torch.from_numpy(gguf.quants.dequantize(quantize_rows(rows, qtype), kind)).reshape(value.shape)
        weights[name] = rounded.transpose(-1, -2).contiguous() if flip else rounded
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def rewritten_copy(path: Path, out: Path, tensors: Callable[[dict[str, Any]], Any],
                   values: dict[str, Any] | None = None, dropped: tuple[str, ...] = ()) -> Path:
    """A copy of the GGUF file `path`: its metadata as is, except keys in `values` (their new values, same types; a
    key the file lacks, or one also in `dropped`, is added, typed as write_gguf's metadata) and keys ending in
    `dropped` (left out); its tensors as tensors(name -> the reader's tensor) yields them, (name, numpy data, GGML
    type or None for a float array's own) in order."""
    import gguf

    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.endswith(dropped):
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, (values or {}).get(key, field.contents()), field.types[0],
                             sub_type=field.types[-1] if array else None)
    for key, value in (values or {}).items():
        if key not in reader.fields or key.endswith(dropped):  # dropped and given: retyped as write_gguf's metadata
            _add_value(writer, key, value)
    for name, data, kind in tensors({t.name: t for t in reader.tensors}):
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def edited_copy(path: Path, out: Path, *, left_out: tuple[str, ...] = (), extra: Any = (),
                values: dict[str, Any] | None = None, dropped: tuple[str, ...] = ()) -> Path:
    """A copy of the GGUF file `path` (rewritten_copy) without the tensors whose names end in `left_out`, with the
    (name, numpy data, GGML type or None) tensors of `extra` appended, metadata `values` and `dropped` as there."""
    def tensors(stored: dict[str, Any]) -> Any:
        for name, tensor in stored.items():
            if not name.endswith(left_out):
                yield name, np.array(tensor.data), tensor.tensor_type
        yield from extra

    return rewritten_copy(path, out, tensors, values=values, dropped=dropped)


def retyped_copy(path: Path, out: Path, types: dict[str, str]) -> Path:
    """A copy of the GGUF file `path` (its metadata as is) with the F32 tensors whose part after "blk.N." is a key
    of `types` ("ffn_down_exps": "Q6_K") stored in that type instead (quantize_rows, along each tensor's rows)."""
    import gguf

    def retyped(tensors: dict[str, Any]) -> Any:
        for name, tensor in tensors.items():
            data = np.array(tensor.data)
            part = name.split(".")[2] if name.startswith("blk.") else None
            if part not in types:
                yield name, data, tensor.tensor_type
                continue
            if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
                raise ValueError(f"{name} is {tensor.tensor_type.name}; retyped_copy re-stores F32 tensors")
            blocks = quantize_rows(data.reshape(-1, data.shape[-1]), types[part])
            yield name, blocks.reshape(*data.shape[:-1], -1), gguf.GGMLQuantizationType[types[part]]

    return rewritten_copy(path, out, retyped)


def with_nextn_layer(path: Path, out: Path, arch: str, layers: int, hidden: int) -> Path:
    """The GGUF file `path` (of `layers` blocks, hidden size `hidden`) as llama.cpp's converter writes it from a
    checkpoint with its MTP layer: one more block (the last block's tensors, halved, and the nextn.* ones), counted in
    `<arch>.block_count` and `<arch>.nextn_predict_layers`."""
    last, appended = f"blk.{layers - 1}.", f"blk.{layers}."

    def with_block(tensors: dict[str, Any]) -> Any:
        for name, tensor in tensors.items():
            yield name, np.array(tensor.data), tensor.tensor_type
        for name, tensor in tensors.items():
            if name.startswith(last):
                yield name.replace(last, appended, 1), np.array(tensor.data) * 0.5, tensor.tensor_type
        yield f"{appended}nextn.eh_proj.weight", np.zeros((hidden, 2 * hidden), dtype=np.float32), None
        for part in ("enorm", "hnorm", "shared_head_norm"):
            yield f"{appended}nextn.{part}.weight", np.ones(hidden, dtype=np.float32), None

    return rewritten_copy(path, out, with_block, values={f"{arch}.block_count": layers + 1,
                                                         f"{arch}.nextn_predict_layers": 1})


def patched_metadata(path: Path, out: Path, key: str, value: bytes) -> Path:
    """A copy of the GGUF file `path` with metadata `key`'s (fixed-size) value bytes replaced by `value`."""
    import gguf

    reader = gguf.GGUFReader(path)
    offset = reader.fields[key].offset + 8 + len(key.encode()) + 4  # past its length-prefixed key and value type
    data = path.read_bytes()
    out.write_bytes(data[:offset] + value + data[offset + len(value):])
    return out


def check_q8_0_logits(ours: torch.nn.Module, source: Path, ops: Any, registry: Any, driver_cls: Any,
                      prompt: list[int], scratch: Path, keep: tuple[str, ...] = ()) -> None:
    """A model loaded from a Q8_0 export of `source` gives the logits of `source` with each exported matrix
    rounded through Q8_0 (within 1e-5), and not those of `source` itself (so that comparison could fail)."""
    ours_logits = prompt_logits(ours, driver_cls, prompt)
    rounded = load_float_model(q8_0_round_trip_copy(source, scratch, keep), ops, registry)
    torch.testing.assert_close(ours_logits, prompt_logits(rounded, driver_cls, prompt), rtol=0, atol=1e-5)
    unquantized = prompt_logits(load_float_model(source, ops, registry), driver_cls, prompt)
    assert (unquantized - ours_logits).abs().max() > 1e-4, "the Q8_0 rounding did not change the logits"


def check_q8_0_file(path: Path, source: Path, ops: Any, registry: Any, driver_cls: Any, prompt: list[int],
                    scratch: Path, types: dict[str, str], keep: tuple[str, ...] = ()) -> torch.nn.Module:
    """The Q8_0 GGUF file `path` stores the tensors named in `types` in those types ({"blk.1.attn_q.weight": "Q8_0"})
    and its model passes check_q8_0_logits against `source` (matrices ending in `keep` not rounded); returns it."""
    import gguf

    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {name: stored[name] for name in types} == types
    ours = load_float_model(path, ops, registry)
    check_q8_0_logits(ours, source, ops, registry, driver_cls, prompt, scratch, keep)
    return ours


def two_ranks_decode_as_one(prompts: list[list[int]], path: Path, **options: Any) -> None:
    """Two gloo ranks of the engine on the cpu backend (with `options`: expert parallelism, say) give one rank's
    greedy tokens for `prompts`, and logprobs within 1e-4."""
    from flashllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = []
    for tp, extra in ((1, {}), (2, options)):
        llm = LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp, block_size=16, num_kv_blocks=32,
                  max_model_len=128, **extra)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(*runs, strict=True):
        assert tokens1 == tokens2
        torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), rtol=0, atol=1e-4)
