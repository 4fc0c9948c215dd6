"""A plugin's architecture shows in `flashllm devices` beside the built-in ones, through the engine's plugin manager."""

from __future__ import annotations

import json

from flashllm.cli import main
from flashllm.models.catalog import model_rows
from flashllm.registry.plugins import make_plugin_manager


def test_plugin_architecture_is_listed(example_plugin, capsys) -> None:
    rows = {r.architecture: r for r in model_rows(make_plugin_manager())}
    toy = rows["ToyGeluForCausalLM"]
    assert toy.target == "flashllm_example_backend.toy_model:ToyGeluForCausalLM" and toy.family == "toy_model"
    assert not toy.error and "LlamaForCausalLM" in rows
    assert main(["devices", "--json"]) == 0
    models = {m["architecture"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert models["ToyGeluForCausalLM"]["class"] == toy.target
    assert main(["devices"]) == 0
    assert any(line.split()[:2] == ["ToyGeluForCausalLM", "toy_model"] for line in capsys.readouterr().out.splitlines())


def test_committed_page_ignores_installed_plugins(example_plugin) -> None:
    from flashllm.models.catalog import render_page

    assert "ToyGeluForCausalLM" not in render_page()
