"""The example third-party backend package: discovered by entry point, one kernel, the rest falls back."""

from __future__ import annotations

import torch

from flashllm.ops import op_specs
from flashllm.ops.testing import make_inputs, run_case
from flashllm.ops.tolerances import assert_close
from flashllm.registry.backend import OpRequest
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.resolve import resolve_ops, select_device


def test_example_backend_resolves_its_kernel_and_falls_back_for_the_rest(example_plugin) -> None:
    plugins = make_plugin_manager()
    assert "example" in plugins.backends()
    selection = select_device("cpu", plugins=plugins)
    assert selection.backend.name == "example"  # priority 50 beats the built-in cpu backend
    table = resolve_ops(selection, OpRequest(torch.float32, torch.float32, "none", 64, 16), plugins=plugins)
    assert table.sources["silu_and_mul"] == "example"
    fallen = {f.op: f for f in table.fallbacks}
    assert set(fallen) == set(op_specs()) - {"silu_and_mul"}
    assert all(f.backend == "example" and "no kernel registered" in f.reason for f in fallen.values())
    inputs = make_inputs("silu_and_mul", torch.float32)
    assert_close(run_case(table.silu_and_mul, "silu_and_mul", inputs),
                 run_case(op_specs()["silu_and_mul"].reference, "silu_and_mul", inputs), torch.float32)


def test_example_backend_can_be_blocked(example_plugin, monkeypatch) -> None:
    monkeypatch.setenv("FLASHLLM_DISABLE_PLUGINS", "example")
    assert select_device("cpu", plugins=make_plugin_manager()).backend.name == "cpu"
