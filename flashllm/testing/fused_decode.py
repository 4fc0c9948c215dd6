"""Test helper: which decode steps the cpu backend's fused native step took."""

from __future__ import annotations

from typing import Any


def record_fused_steps(monkeypatch: Any) -> list[bool]:
    """Wrap the cpu backend's `FusedDecode.__call__` (undone with `monkeypatch`) and return the list it
    appends to: True for a call that ran the fused step, False for one that declined (None: the
    model's own forward ran)."""
    from flashllm.backends.cpu import decode_stack

    taken: list[bool] = []
    real = decode_stack.FusedDecode.__call__

    def counting(self: Any, *args: Any) -> Any:
        hidden = real(self, *args)
        taken.append(hidden is not None)
        return hidden

    monkeypatch.setattr(decode_stack.FusedDecode, "__call__", counting)
    return taken
