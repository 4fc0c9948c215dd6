"""A checkpoint tensor read lazily from a safetensors file: narrowing it reads only the narrowed part."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor

from flashllm.models.hf_config import ModelLoadError

__all__ = ["CheckpointTensor", "materialize"]


class CheckpointTensor:
    """One tensor of a safetensors file, or a rectangular part of it, not yet read.

    The loader hands these to the weight loaders instead of whole tensors, so each
    tensor-parallel rank reads only its shard: `shape`, `dtype`, `dim()`, `size()`, `narrow()` and
    step-1 slicing cost nothing; `materialize()` reads the part this view covers (once, then
    cached). Anything else (a torch function given this object, or any other Tensor attribute)
    reads the part first and works on the real tensor, so a weight loader written for plain
    tensors still works, reading everything it touches.

    source: safetensors' `get_slice(name)` object (`source[a:b, c:d]` reads just those elements);
    ranges: the [start, stop) of this view along each dimension (None: the whole tensor).
    """

    __slots__ = ("_cached", "_dtype", "_name", "_ranges", "_source")

    def __init__(self, name: str, source: Any, dtype: torch.dtype,
                 ranges: tuple[tuple[int, int], ...] | None = None) -> None:
        self._name, self._source, self._dtype = name, source, dtype
        self._ranges = tuple((0, n) for n in source.get_shape()) if ranges is None else ranges
        self._cached: Tensor | None = None

    @classmethod
    def open(cls, name: str, source: Any) -> CheckpointTensor:
        """The whole tensor `name` of `source` (a safetensors slice); reads no element to learn its dtype."""
        shape = source.get_shape()
        # an empty slice carries the dtype without reading data; a scalar is one element anyway
        probe = source[tuple(slice(0, 0) for _ in shape)] if shape else source[()]
        return cls(name, source, probe.dtype)

    @property
    def name(self) -> str:
        """The tensor's name in its checkpoint."""
        return self._name

    @property
    def shape(self) -> torch.Size:
        """The shape of this view (the whole tensor's until narrowed)."""
        return torch.Size(stop - start for start, stop in self._ranges)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype stored in the file (weight loaders convert on copy)."""
        return self._dtype

    def dim(self) -> int:
        """Number of dimensions, as Tensor.dim()."""
        return len(self._ranges)

    def size(self, dim: int | None = None) -> torch.Size | int:
        """As Tensor.size()."""
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        """Number of elements of this view."""
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor | Tensor:
        """Elements [start, start + length) along `dim`, as Tensor.narrow, still unread.

        Raises ValueError (not torch's RuntimeError) when the range leaves the tensor, so the
        model's load_weights reports it as a checkpoint that does not match its config.
        """
        dim = dim + self.dim() if dim < 0 else dim
        if not 0 <= dim < self.dim():
            raise ValueError(f"{self._name} has {self.dim()} dimension(s); cannot narrow dimension {dim}")
        size = self.shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(
                f"{self._name} has {size} elements along dimension {dim} (shape {tuple(self.shape)}); this rank "
                f"needs [{start}, {start + length}): the checkpoint does not match its config.json"
            )
        if self._cached is not None:
            return self._cached.narrow(dim, start, length)
        base = self._ranges[dim][0]
        ranges = (*self._ranges[:dim], (base + start, base + start + length), *self._ranges[dim + 1:])
        return CheckpointTensor(self._name, self._source, self._dtype, ranges)

    def __getitem__(self, key: Any) -> CheckpointTensor | Tensor:
        """Step-1 slices (one per leading dimension) stay unread; any other index reads this view first."""
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > self.dim() or not all(isinstance(k, slice) and k.step in (None, 1) for k in keys):
            return self.materialize()[key]
        view: CheckpointTensor | Tensor = self
        for dim, k in enumerate(keys):
            start, stop, _ = k.indices(self.shape[dim])
            view = view.narrow(dim, start, max(stop - start, 0))
        return view

    def materialize(self) -> Tensor:
        """Read the elements of this view from the file: a CPU tensor of `shape` and `dtype`."""
        if self._cached is None:
            try:
                index = tuple(slice(start, stop) for start, stop in self._ranges)
                tensor = self._source[index] if index else self._source[()]
            except SafetensorError as exc:
                raise ModelLoadError(f"checkpoint tensor {self._name!r} could not be read ({exc})") from None
            if tuple(tensor.shape) != tuple(self.shape):
                raise ModelLoadError(f"checkpoint tensor {self._name!r} read as {tuple(tensor.shape)}, expected "
                                     f"{tuple(self.shape)}; the safetensors file is malformed")
            self._cached = tensor
        return self._cached

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # torch calls this when a CheckpointTensor is an argument (e.g. param.copy_(it)): read, then run
        return func(*[_read(a) for a in args], **{k: _read(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # never read the file for private or special lookups (copy, pickle probes)
            raise AttributeError(attr)
        return getattr(self.materialize(), attr)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"CheckpointTensor({self._name!r}, shape={tuple(self.shape)}, dtype={self._dtype})"


def _read(arg: Any) -> Any:
    """An argument of a torch function with every CheckpointTensor in it (or in its list) read."""
    if isinstance(arg, (list, tuple)):
        return type(arg)(materialize(a) for a in arg)
    return materialize(arg)


def materialize(tensor: Any) -> Any:
    """`tensor` read into a real Tensor when it is a CheckpointTensor; anything else unchanged."""
    return tensor.materialize() if isinstance(tensor, CheckpointTensor) else tensor
