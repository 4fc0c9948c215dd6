"""LoRAManager on its own: LRU device slots, host copies bounded and re-read, per-token slots of a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.lora import LoRAError, LoRARequest
from flashllm.lora.manager import LoRAManager, check_allowed
from flashllm.models.layers.lora import LoRAContext
from flashllm.testing.tiny_lora import build_random_adapter

SHAPES = {"model.layers.0.self_attn.q_proj.weight": (8, 6), "model.layers.0.mlp.down_proj.weight": (6, 10)}


class FakeTable:
    """Records what the manager writes into each slot."""

    def __init__(self) -> None:
        self.slots: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def clear(self, slot: int) -> None:
        self.slots[slot] = []

    def set(self, slot: int, shard: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        self.slots[slot].append((shard, lora_a, lora_b))


def _manager(tmp_path: Path, max_loras: int = 2, max_cpu_loras: int | None = None):
    table = FakeTable()
    manager = LoRAManager(LoRAContext(), lambda name: (table, 0) if name in SHAPES else None, SHAPES, {},
                          max_loras, 4, torch.float32, torch.device("cpu"), max_cpu_loras, [table])
    adapters = [LoRARequest(f"a{i}", i + 1, str(build_random_adapter(tmp_path / f"a{i}", SHAPES, r=2, alpha=4,
                                                                     seed=i))) for i in range(4)]
    return manager, table, adapters


def test_slots_are_least_recently_used_and_indices_follow_rows(tmp_path) -> None:
    manager, table, adapters = _manager(tmp_path)
    salts = {manager.add(a) for a in adapters}
    assert len(salts) == 4  # every adapter keys its own prefix-cache blocks
    manager.prepare([1, 0, 2], [2, 3, 1], 8)
    a, b = manager.slot_of(1), manager.slot_of(2)
    assert manager.context.indices.tolist() == [a, a, -1, -1, -1, b, -1, -1]
    manager.prepare([1], [1], 1)  # adapter 1 used again: adapter 2 is now the least recently used
    manager.prepare([3], [1], 1)
    assert manager.slot_of(2) is None and manager.slot_of(3) == b and manager.slot_of(1) == a
    # the slot was cleared and got adapter 3's two projections
    assert len(table.slots[b]) == 2 and all(lora_b.abs().sum() > 0 for _, _, lora_b in table.slots[b])
    manager.prepare([0, 0], [1, 1], 2)
    assert manager.context.indices is None  # a base-only step: the layers do nothing extra
    with pytest.raises(RuntimeError, match="--max-loras"):
        manager.prepare([1, 2, 3], [1, 1, 1], 3)


def test_scale_is_folded_into_b(tmp_path) -> None:
    manager, table, adapters = _manager(tmp_path)
    manager.add(adapters[0])
    manager.prepare([1], [1], 1)
    from safetensors.torch import load_file

    tensors = load_file(Path(adapters[0].lora_path) / "adapter_model.safetensors")
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    written = [w for w in table.slots[manager.slot_of(1)] if w[2].shape == b.shape]
    torch.testing.assert_close(written[0][2], b * 2.0)  # lora_alpha 4 / r 2


def test_host_copies_are_bounded_and_read_again(tmp_path) -> None:
    manager, _, adapters = _manager(tmp_path, max_loras=1, max_cpu_loras=1)
    for a in adapters[:3]:
        manager.add(a)
    held = [i for i, e in manager._registered.items() if e.writes is not None]
    assert held == [3]
    manager.prepare([1], [1], 1)  # re-read from disk
    assert manager.slot_of(1) == 0
    assert manager.remove(1) and manager.slot_of(1) is None and not manager.remove(1)


def test_refusals(tmp_path) -> None:
    manager, _, adapters = _manager(tmp_path)
    manager.add(adapters[0])
    with pytest.raises(ValueError, match="already"):
        manager.add(LoRARequest("a0", 9, adapters[1].lora_path))
    wide = build_random_adapter(tmp_path / "wide", SHAPES, r=8)
    with pytest.raises(LoRAError, match="max-lora-rank"):
        manager.add(LoRARequest("wide", 7, str(wide)))
    with pytest.raises(LoRAError, match="allowed-lora-dir"):
        check_allowed(tmp_path / "a0" / ".." / "..", [tmp_path])
    assert check_allowed(tmp_path / "a0", [tmp_path]) == (tmp_path / "a0").resolve()
