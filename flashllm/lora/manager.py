"""Multi-LoRA serving state: registered adapters (host), the device slot table with LRU eviction, per-step slots."""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flashllm.lora.peft import MAX_RANK, LoRAAdapter, LoRAError, load_adapter

__all__ = ["LoRAManager", "LoRARequest"]

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with: a unique name, a unique integer id >= 1, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not 0 < len(self.lora_name) <= MAX_NAME_CHARS:
            raise ValueError(f"LoRARequest name {self.lora_name!r}: expected a non-empty string of at most "
                             f"{MAX_NAME_CHARS} characters")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest id {self.lora_int_id!r}: expected a whole number >= 1 (0 is the base model)")


@dataclass
class _Registered:
    request: LoRARequest
    salt: bytes
    pinned: bool
    writes: list[tuple[Any, int, Tensor, Tensor]] | None = None  # (slot table, shard, A, scale * B), host


class LoRAManager:
    """Adapters known to one engine and which of them sit in the `max_loras` device slots.

    resolve: checkpoint weight name -> (the layer's slot table, shard index) or None (the model's
    lora_target); base_shapes / packed: what load_adapter checks adapters against; context: the
    object whose `indices` the LoRA layers read. Host copies of unpinned adapters are kept for at
    most `max_cpu_loras` adapters (least recently used dropped, re-read from disk when needed again).
    """

    def __init__(self, context: Any, resolve: Callable[[str], tuple[Any, int] | None],
                 base_shapes: Mapping[str, tuple[int, ...]], packed: Mapping[str, list[str]], max_loras: int,
                 max_lora_rank: int, dtype: torch.dtype, device: torch.device, max_cpu_loras: int | None = None,
                 tables: Sequence[Any] = ()) -> None:
        if not 1 <= max_loras <= 256:
            raise ValueError(f"--max-loras {max_loras}: expected 1..256 adapters on the device at once")
        if not 1 <= max_lora_rank <= MAX_RANK:
            raise ValueError(f"--max-lora-rank {max_lora_rank}: expected 1..{MAX_RANK}")
        self.context, self._resolve = context, resolve
        self._base_shapes, self._packed = base_shapes, packed
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or 0, max_loras)
        self.dtype, self.device = dtype, device
        self._tables = list(tables)
        self._registered: dict[int, _Registered] = {}
        self._host_lru: OrderedDict[int, None] = OrderedDict()
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora id -> device slot, least recently used first
        self._generation = itertools.count(1)
        self.num_slot_loads = 0
        # under tensor parallelism the driver's slot loads since the last step sent (slot, request), in
        # order, for the other ranks to repeat (flashllm/core/parallel.py's StepChannel); None: not kept
        self.slot_loads: list[tuple[int, LoRARequest]] | None = None

    # ---- registration ------------------------------------------------------------------------

    def add(self, request: LoRARequest, pinned: bool = False) -> bytes:
        """Register (and read, checking every shape) an adapter; returns its prefix-cache salt.

        The same request again is a no-op. Raises LoRAError for an adapter that cannot be used and
        ValueError when its id or name is already taken by another adapter.
        """
        known = self._registered.get(request.lora_int_id)
        if known is not None:
            if known.request != request:
                raise ValueError(f"LoRA id {request.lora_int_id} is already {known.request.lora_name!r} at "
                                 f"{known.request.lora_path}; unload it first or use another id")
            self._touch_host(request.lora_int_id)
            return known.salt
        for other in self._registered.values():
            if other.request.lora_name == request.lora_name:
                raise ValueError(f"LoRA name {request.lora_name!r} is already id {other.request.lora_int_id}")
        entry = _Registered(request, self._salt(request), pinned)
        entry.writes = self._read(request)
        self._registered[request.lora_int_id] = entry
        self._touch_host(request.lora_int_id)
        return entry.salt

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter and free its slot; False when it was not registered."""
        entry = self._registered.pop(lora_int_id, None)
        if entry is None:
            return False
        self._host_lru.pop(lora_int_id, None)
        slot = self._slots.pop(lora_int_id, None)
        if slot is not None:
            for table in self._tables:
                table.clear(slot)
        return True

    def requests(self) -> list[LoRARequest]:
        """The registered adapters, in registration order."""
        return [entry.request for entry in self._registered.values()]

    def get(self, name: str) -> LoRARequest | None:
        """The registered adapter called `name`, or None."""
        return next((e.request for e in self._registered.values() if e.request.lora_name == name), None)

    def _salt(self, request: LoRARequest) -> bytes:
        # a fresh generation per registration: an id reloaded from new files never hits KV of the old weights
        text = f"lora\0{request.lora_int_id}\0{request.lora_path}\0{next(self._generation)}"
        return hashlib.sha256(text.encode()).digest()

    def _read(self, request: LoRARequest) -> list[tuple[Any, int, Tensor, Tensor]]:
        adapter = load_adapter(request.lora_path, self._base_shapes, self._packed, self.max_lora_rank)
        return self._writes(adapter)

    def _writes(self, adapter: LoRAAdapter) -> list[tuple[Any, int, Tensor, Tensor]]:
        writes = []
        for name, weights in adapter.weights.items():
            target = self._resolve(name)
            if target is None:
                raise LoRAError(f"LoRA adapter {adapter.path}: {name} is not a linear layer multi-LoRA serves for "
                                "this architecture; merge the adapter at load with --lora_path instead")
            table, shard = target
            b_scaled = weights.lora_b * weights.scale
            writes.append((table, shard, weights.lora_a.to(self.dtype), b_scaled.to(self.dtype)))
        return writes

    def _touch_host(self, lora_int_id: int) -> None:
        self._host_lru[lora_int_id] = None
        self._host_lru.move_to_end(lora_int_id)
        unpinned = [i for i in self._host_lru if not self._registered[i].pinned and self._registered[i].writes]
        while len(unpinned) > self.max_cpu_loras:  # drop the host copy only; the registration stays
            self._registered[unpinned.pop(0)].writes = None

    # ---- device slots --------------------------------------------------------------------------

    def prepare(self, lora_ids: Sequence[int], tokens_per_row: Sequence[int], num_tokens: int) -> None:
        """Set the context's per-token slots for a step: row i has lora_ids[i] (0: base) for tokens_per_row[i]
        tokens; tokens past their sum (padding) get -1. Loads adapters into slots as needed (LRU eviction)."""
        wanted = {i for i in lora_ids if i}
        if not wanted:
            self.context.indices = None
            return
        slots = self._activate(wanted)
        flat: list[int] = []
        for lora_id, count in zip(lora_ids, tokens_per_row, strict=True):
            flat.extend([slots[lora_id] if lora_id else -1] * count)
        flat.extend([-1] * (num_tokens - len(flat)))
        self.context.indices = torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)

    def _activate(self, wanted: set[int]) -> dict[int, int]:
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters but --max-loras is {self.max_loras}; the "
                               "scheduler should have held the extra requests back")
        for lora_id in wanted:
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            used = set(self._slots.values())
            free = next((s for s in range(self.max_loras) if s not in used), None)
            if free is None:  # evict the least recently used adapter this step does not use
                victim = next(i for i in self._slots if i not in wanted)
                free = self._slots.pop(victim)
            self._load_slot(lora_id, free)
            self._slots[lora_id] = free
        return {i: self._slots[i] for i in wanted}

    def _load_slot(self, lora_id: int, slot: int) -> None:
        entry = self._registered.get(lora_id)
        if entry is None:
            raise RuntimeError(f"LoRA id {lora_id} is not registered (unloaded while requests still used it)")
        if entry.writes is None:  # its host copy was dropped: read it again
            entry.writes = self._read(entry.request)
        self._touch_host(lora_id)
        for table in self._tables:
            table.clear(slot)
        for table, shard, lora_a, lora_b in entry.writes:
            table.set(slot, shard, lora_a.to(self.device), lora_b.to(self.device))
        self.num_slot_loads += 1
        if self.slot_loads is not None:
            self.slot_loads.append((slot, entry.request))

    def load_into(self, slot: int, request: LoRARequest) -> None:
        """Another rank's copy of a driver's slot load: `request`'s adapter (registered here first, read
        from its directory and checked as add() does) into device slot `slot`, whatever held it before."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot}: expected 0..{self.max_loras - 1}")
        for other in list(self._registered.values()):  # the driver unloaded and reused an id or a name
            known = other.request
            if known != request and (known.lora_int_id == request.lora_int_id or known.lora_name == request.lora_name):
                self.remove(other.request.lora_int_id)
        self.add(request)
        for lora_id in [i for i, s in self._slots.items() if s == slot or i == request.lora_int_id]:
            del self._slots[lora_id]
        self._load_slot(request.lora_int_id, slot)
        self._slots[request.lora_int_id] = slot

    def slot_of(self, lora_int_id: int) -> int | None:
        """The device slot holding the adapter now, or None."""
        return self._slots.get(lora_int_id)


def check_allowed(path: str | Path, roots: Sequence[str | Path]) -> Path:
    """`path` resolved, when it lies inside one of `roots` (resolved); LoRAError otherwise."""
    try:
        real = Path(path).resolve()
    except (ValueError, OSError, RuntimeError):  # a NUL byte, a symlink loop: a path the caller must fix
        # (not quoting the error: a loop's message names where the links lead)
        raise LoRAError(f"LoRA adapter path {str(path)[:200]!r} cannot be resolved (a NUL byte or a symlink "
                        "loop?); give a plain directory path") from None
    if not any(real.is_relative_to(Path(root).resolve()) for root in roots):
        raise LoRAError(f"LoRA adapter path {path} is outside --allowed-lora-dir; put it there or list it "
                        "with --lora-modules")
    return real
