"""Malformed GGUF files: each is refused with one line before anything near its claimed sizes is allocated."""

from __future__ import annotations

import re
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.gguf import open_gguf  # noqa: E402
from flashllm.models.gguf.reader import MAX_ARRAY_STRINGS  # noqa: E402
from flashllm.models.loader import load_model  # noqa: E402
from flashllm.models.tokenizer import load_tokenizer  # noqa: E402
from flashllm.testing.gguf_files import write_gguf  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

# Far above what refusing a ~100 KB file needs, far below what any claimed size in the corpus would take.
ALLOCATION_LIMIT = 16 << 20


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    root = tmp_path_factory.mktemp("gguf-valid")
    source = build_tiny_model(root / "src", "llama", seed=2)
    return write_gguf(source, root / "model.gguf", "Q8_0").read_bytes()


def _layout(data: bytes, tmp: Path) -> tuple[object, int]:
    """The gguf package's own reading of the valid file (for offsets), and the file length."""
    path = tmp / "layout.gguf"
    path.write_bytes(data)
    return gguf.GGUFReader(str(path)), len(data)


def _value_offset(reader, key: str) -> int:
    """Byte offset of the value of metadata `key` (after its key string and value type)."""
    field = reader.fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def _tensor_info(reader, name: str) -> dict[str, int]:
    """Byte offsets of a tensor info's n_dims, dims, type and data offset fields."""
    tensor = next(t for t in reader.tensors if t.name == name)
    start = tensor.field.offset + 8 + len(name.encode())
    n_dims = len(tensor.shape)
    return {"n_dims": start, "dims": start + 4, "type": start + 4 + 8 * n_dims, "offset": start + 8 + 8 * n_dims}


def _patch(data: bytes, offset: int, fmt: str, value) -> bytes:
    packed = struct.pack("<" + fmt, value)
    return data[:offset] + packed + data[offset + len(packed):]


def _rewrite(tmp: Path, arch: str = "llama", extra: Callable | None = None, tokens: int = 0) -> bytes:
    """A small file written by GGUFWriter with chosen metadata (for refusals no byte patch expresses)."""
    writer = gguf.GGUFWriter(str(tmp / "rewritten.gguf"), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    if tokens:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(tokens)])
        writer.add_token_merges([])
    if extra:
        extra(writer)
    writer.add_tensor("token_embd.weight", torch.zeros(16, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return (tmp / "rewritten.gguf").read_bytes()


def _corpus(valid: bytes, tmp: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, a regex the one-line refusal must match)."""
    reader, size = _layout(valid, tmp)
    q = _tensor_info(reader, "blk.0.attn_q.weight")
    tokens_array = _value_offset(reader, "tokenizer.ggml.tokens")  # uint32 item type, then uint64 length
    types_array = _value_offset(reader, "tokenizer.ggml.token_type")
    arch_value = _value_offset(reader, "general.architecture")     # uint64 length, then the bytes
    first_key = reader.fields["general.architecture"].offset
    return {
        "empty file": (b"", "not a valid GGUF|truncated"),
        "bad magic": (b"GGML" + valid[4:], "not a valid GGUF file .*magic"),
        "unsupported version": (_patch(valid, 4, "I", 99), "version 99"),
        "truncated header": (valid[:20], "truncated"),
        "truncated metadata": (valid[:tokens_array + 200], "truncated"),
        "truncated tensor data": (valid[:size - 100], "lies at bytes .* but the file has"),
        "absurd metadata count": (_patch(valid, 16, "Q", 1 << 62), "claims 4611686018427387904 metadata entries"),
        "absurd tensor count": (_patch(valid, 8, "Q", 1 << 40), "claims 1099511627776 tensors"),
        "metadata count past the file": (_patch(valid, 16, "Q", 60000), "cannot fit|truncated"),
        "absurd string length": (_patch(valid, arch_value, "Q", 1 << 50), "truncated"),
        "absurd array length": (_patch(valid, tokens_array + 4, "Q", 1 << 50), "claims 1125899906842624 "),
        "absurd number-array length": (_patch(valid, types_array + 4, "Q", 1 << 50),
                                       "claims 1125899906842624 array elements"),
        "array length past the file": (_patch(valid, tokens_array + 4, "Q", 1 << 19), "cannot fit"),
        "unknown value type": (_patch(valid, first_key + 8 + len("general.architecture"), "I", 77),
                               "not a valid GGUF file"),
        "array of arrays": (_patch(valid, tokens_array, "I", 9), "arrays of arrays"),
        "unsupported tensor type": (_patch(valid, q["type"], "I", int(gguf.GGMLQuantizationType.IQ2_XXS)),
                                    "'blk.0.attn_q.weight' is stored as IQ2_XXS, .*supported tensor types: F32"),
        "unknown tensor type id": (_patch(valid, q["type"], "I", 200), "unknown type id 200.*supported"),
        "tensor offset outside the file": (_patch(valid, q["offset"], "Q", 1 << 40), "lies at bytes"),
        "too many tensor dims": (_patch(valid, q["n_dims"], "I", 9), "dimensions|truncated"),
        "zero tensor dim": (_patch(valid, q["dims"], "Q", 0), "expected 1 to 4 positive sizes"),
        "huge tensor dims": (_patch(valid, q["dims"] + 8, "Q", 1 << 45), "claims .* elements|lies at bytes"),
        # 2^32 x 2^32 is 0 in uint64 arithmetic (the gguf package's np.prod): a size check multiplying so passes
        "tensor dims whose product wraps 64 bits": (_patch(_patch(valid, q["dims"], "Q", 1 << 32), q["dims"] + 8, "Q",
                                                           1 << 32), "claims 18446744073709551616 elements"),
        "rows not whole blocks": (_patch(valid, q["dims"], "Q", 48), "not a multiple of its 32-value blocks"),
        "unsupported architecture": (_rewrite(tmp, "rwkv6"), "architecture 'rwkv6' is not supported; supported: "
                                                              "apertus, arcee, baichuan, bloom, chatglm, cohere2, command-r, deepseek2, .*, llama, "),
        "vocabulary larger than the embedding": (_rewrite(tmp, tokens=20), "20 tokens but the embedding only 16"),
        "vocab_size disagrees with the embedding": (_rewrite(tmp, extra=lambda w: w.add_vocab_size(99)),
                                                    "vocab_size metadata 99 differs"),
        "per-layer head counts": (_rewrite(tmp, extra=lambda w: w.add_head_count_kv([1])), "expected a single int"),
        "invalid utf-8 key": (valid[:first_key + 8] + b"\xff" + valid[first_key + 9:], "not a valid GGUF"),
    }


def test_the_corpus_is_large_and_the_valid_file_loads(valid, tmp_path, ops, model_registry):
    assert len(_corpus(valid, tmp_path)) >= 15
    path = tmp_path / "ok.gguf"
    path.write_bytes(valid)
    load_model(path, ops, torch.float32, "cpu", model_registry, progress=False)


def test_each_malformed_file_is_refused_in_one_line_without_large_allocations(valid, tmp_path, ops, model_registry):
    failures = []
    for index, (name, (data, pattern)) in enumerate(_corpus(valid, tmp_path).items()):
        path = tmp_path / f"case{index}.gguf"
        path.write_bytes(data)
        tracemalloc.start()
        try:
            load_model(path, ops, torch.float32, "cpu", model_registry, progress=False)
        except ModelLoadError as exc:
            message = str(exc)
        else:
            message = "<loaded>"
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        if "\n" in message or not re.search(pattern, message) or peak > ALLOCATION_LIMIT:
            failures.append(f"{name}: {message!r} (peak {peak} bytes)")
    assert not failures, "\n".join(failures)


def test_the_tokenizer_path_refuses_the_same_way(valid, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(valid[:200])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_tokenizer(path)


def _with_array(tmp: Path, key: str, values: list) -> Path:
    """A valid small file with one extra metadata array."""
    path = tmp / "array.gguf"
    path.write_bytes(_rewrite(tmp, extra=lambda w: w.add_array(key, values)))
    return path


def test_a_long_array_of_small_values_is_read_in_memory_near_its_size(tmp_path):
    # The gguf package's reader makes a numpy view per array element (~700 bytes each, for one byte
    # of file with uint8 or bool elements): 50,000 of them would take ~35 MB for a 50 KB array.
    values = [True, False] * 25_000
    path = _with_array(tmp_path, "x.flags", values)
    tracemalloc.start()
    try:
        gf = open_gguf(path)
        read = gf.get("x.flags")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert read == values
    assert peak < 4 << 20, f"reading a {path.stat().st_size}-byte file took {peak} bytes"


def test_strings_in_metadata_arrays_are_budgeted_per_file(valid, tmp_path):
    reader, _ = _layout(valid, tmp_path)
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    merges_length = _value_offset(reader, "tokenizer.ggml.merges") + 4
    # each array alone is under MAX_ARRAY_LEN; with the tokens before it, the merges pass the file's budget
    data = _patch(valid, merges_length, "Q", MAX_ARRAY_STRINGS - tokens + 1)
    path = tmp_path / "strings.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match=rf"claims {MAX_ARRAY_STRINGS - tokens + 1} more strings .* "
                                             rf"at most {MAX_ARRAY_STRINGS} are read") as info:
        open_gguf(path)
    assert "\n" not in str(info.value)
