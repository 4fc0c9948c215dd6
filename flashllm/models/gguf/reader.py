"""Open a GGUF file with the `gguf` package, bounded: hostile counts, offsets and sizes are refused in one line."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from flashllm.models.errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install gguf"
# Bounds a real model stays far below; past them a header is corrupt or hostile, and the reader would
# build one Python object per entry, so they are refused before anything is read.
MAX_METADATA_ENTRIES = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_LEN = 1 << 24          # tokens, scores, merges of a vocabulary of a few million entries
# The gguf package's reader makes two numpy views per string in an array (~1.5 KB for a string of 8
# bytes or more), so strings are budgeted per file: twice the tokens and merges of the largest
# vocabularies (Llama 3: 128,256 tokens and 280,147 merges; Gemma 3: 262,144 tokens).
MAX_ARRAY_STRINGS = 1 << 20
MAX_TENSOR_DIMS = 4              # ggml's GGML_MAX_DIMS
MAX_TENSOR_ELEMENTS = 1 << 40
# The smallest encoding of one array element by value type id (GGUFValueType): a string is its
# 8-byte length at least.
_ELEMENT_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 8: 8, 10: 8, 11: 8, 12: 8}
_ARRAY_TYPE = 9
_STRING_TYPE = 8

# Tensor types flashllm loads: floats as they are; the block formats below dequantize exactly with
# the gguf package (or load as QuantizedWeight where flashllm.quant.gguf_blocks represents them).
FLOAT_TYPE_NAMES = ("F32", "F16", "BF16")
QUANT_TYPE_NAMES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
SUPPORTED_TYPE_NAMES = FLOAT_TYPE_NAMES + QUANT_TYPE_NAMES


def is_gguf_path(path: str | Path | None) -> bool:
    """Whether `path` names a GGUF file: an existing file ending in .gguf or starting with the GGUF magic."""
    if path is None:
        return False
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == GGUF_SUFFIX:
        return True
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def import_gguf() -> Any:
    """The gguf package, or a one-line ModelLoadError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(f"reading GGUF files needs the gguf package, which is not installed; run: "
                             f"{INSTALL_HINT}") from None
    return gguf


class GGUFFile:
    """A GGUF file opened with the gguf package's reader (memory-mapped: tensor data is read on use).

    metadata: key -> value (ints, floats, bools, strings, lists of them); tensors: name -> the
    reader's ReaderTensor (`tensor_type`, `shape` in ggml order (ne0 = row length first), `data`
    a numpy view: floats as (rows, cols), block formats as (rows, bytes per row) uint8). Every
    tensor lies inside the file and has a supported type; `open_gguf` builds it.
    """

    def __init__(self, path: Path, reader: Any) -> None:
        self.path, self.reader = path, reader
        self.size = path.stat().st_size
        self.tensors: dict[str, Any] = {t.name: t for t in reader.tensors}
        self._metadata: dict[str, Any] = {}

    @property
    def name(self) -> str:
        """The file name, for messages."""
        return self.path.name

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value under `key` (decoded once), or `default` when the file lacks it."""
        if key in self._metadata:
            return self._metadata[key]
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as exc:
            raise ModelLoadError(f"{self.name}: metadata {key!r} cannot be decoded ({exc}); the file is corrupt, "
                                 "re-download or re-convert it") from None
        self._metadata[key] = value
        return value

    def keys(self) -> Iterable[str]:
        """The metadata keys the file holds."""
        return self.reader.fields.keys()


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and check a GGUF file, once per process per (path, size, mtime): later calls reuse it.

    Raises ModelLoadError (one line, before any tensor is read or allocated) for: a file that is
    not GGUF, truncated, or an unsupported GGUF version; metadata or tensor counts, array lengths
    or tensor sizes past the bounds above or past the file's end; a tensor whose data lies outside
    the file; a tensor type flashllm does not load (the message lists those it does).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist or is not a file")
    stat = path.stat()
    return _open_cached(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    reader_cls = _bounded_reader_class()
    try:
        reader = reader_cls(str(path), "r")
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path.name}: {exc}") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, RecursionError,
            MemoryError) as exc:
        raise ModelLoadError(f"{path.name} is not a valid GGUF file ({type(exc).__name__}: {exc}); re-download or "
                             "re-convert it") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    return GGUFFile(path, reader)


@functools.cache
def _bounded_reader_class() -> type:
    """gguf.GGUFReader with every read, count and tensor checked against the file before it is used."""
    gguf = import_gguf()
    known = {int(t): t.name for t in gguf.GGMLQuantizationType}

    class BoundedReader(gguf.GGUFReader):
        def __init__(self, path: str, mode: str = "r") -> None:
            self._strings = 0  # strings in metadata arrays so far (the package's __init__ reads everything)
            super().__init__(path, mode)

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            count, offset = int(count), int(offset)
            end = offset + np.dtype(dtype).itemsize * count
            if offset < 0 or count < 0 or end > len(self.data):
                raise ModelLoadError(f"the file is truncated: a field at byte {offset} needs {end - offset} bytes "
                                     f"but the file ends at byte {len(self.data)}; re-download or re-convert it")
            return super()._get(offset, dtype, count, override_order)

        def _build_fields(self, offs: int, count: int) -> int:
            _check_count("metadata entries", count, MAX_METADATA_ENTRIES, len(self.data) - offs, 13)
            return super()._build_fields(offs, count)

        def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list]:
            _check_count("tensors", count, MAX_TENSORS, len(self.data) - offs, 24)
            return super()._build_tensor_info(offs, count)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
            if int(raw_type) != _ARRAY_TYPE:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_item_type, raw_length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            item_type, length = int(raw_item_type[0]), int(raw_length[0])
            if item_type not in _ELEMENT_BYTES:
                raise ModelLoadError(f"a metadata array at byte {orig_offs} holds value type {item_type}; "
                                     "arrays of arrays and unknown types are not read")
            if item_type == _STRING_TYPE:
                self._strings += length
                if self._strings > MAX_ARRAY_STRINGS:
                    raise ModelLoadError(f"the header claims {length} more strings in a metadata array at byte "
                                         f"{orig_offs}; at most {MAX_ARRAY_STRINGS} are read in all (a corrupt or "
                                         "hostile file)")
            _check_count("array elements", length, MAX_ARRAY_LEN, len(self.data) - orig_offs - 12,
                         _ELEMENT_BYTES[item_type])
            if item_type == _STRING_TYPE:
                return super()._get_field_parts(orig_offs, raw_type)
            # Numbers as one view of the whole array, where the package makes a view (~700 bytes) per
            # element; ReaderField.contents() lists both the same.
            values = self._get(orig_offs + 12, self.gguf_scalar_to_np[gguf.GGUFValueType(item_type)], length)
            types = [gguf.GGUFValueType.ARRAY, *([gguf.GGUFValueType(item_type)] if length else [])]
            return 12 + int(values.nbytes), [raw_item_type, raw_length, values], [2] if length else [], types

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _check_tensor(field, start_offs, len(self.data), known, gguf)
            super()._build_tensors(start_offs, fields)

    return BoundedReader


def _check_count(what: str, count: Any, limit: int, bytes_left: int, min_bytes: int) -> None:
    count = int(count)
    if count > limit:
        raise ModelLoadError(f"the header claims {count} {what}; at most {limit} are read (a corrupt or hostile file)")
    if count * min_bytes > bytes_left:
        raise ModelLoadError(f"the header claims {count} {what}, which cannot fit in the {bytes_left} bytes left in "
                             "the file; it is truncated or corrupt")


def _check_tensor(field: Any, start_offs: int, file_size: int, known: dict[int, str], gguf: Any) -> None:
    """One tensor's info, before the reader maps its data: dims, type, and data inside the file."""
    _name_len, name_data, n_dims, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", "replace")[:200]
    if not 1 <= int(n_dims[0]) <= MAX_TENSOR_DIMS or any(int(d) < 1 for d in dims):
        raise ModelLoadError(f"tensor {name!r} has dimensions {[int(d) for d in dims]}; expected 1 to "
                             f"{MAX_TENSOR_DIMS} positive sizes")
    type_id = int(raw_type[0])
    type_name = known.get(type_id)
    if type_name not in SUPPORTED_TYPE_NAMES:
        shown = type_name or f"unknown type id {type_id}"
        raise ModelLoadError(f"tensor {name!r} is stored as {shown}, which flashllm does not load; supported tensor "
                             f"types: {', '.join(SUPPORTED_TYPE_NAMES)}")
    elements = 1
    for d in dims:
        elements *= int(d)
    if elements > MAX_TENSOR_ELEMENTS:
        raise ModelLoadError(f"tensor {name!r} claims {elements} elements; at most {MAX_TENSOR_ELEMENTS}")
    block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    if int(dims[0]) % block:
        raise ModelLoadError(f"tensor {name!r} ({type_name}) has rows of {int(dims[0])} values, not a multiple of "
                             f"its {block}-value blocks")
    n_bytes = elements // block * type_bytes
    start = start_offs + int(offset[0])
    if start + n_bytes > file_size:
        raise ModelLoadError(f"tensor {name!r} lies at bytes [{start}, {start + n_bytes}) but the file has {file_size} "
                             "bytes; it is truncated or corrupt, re-download or re-convert it")
