"""The template as users meet it: listed by `flashllm devices`, picked only by name, same greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flashllm import LLM, SamplingParams
from flashllm.registry.plugins import FlashPlugins
from flashllm.registry.resolve import select_device
from flashllm.testing.tiny_models import build_tiny_model

from flashllm_backend_template import backend as template
from flashllm_backend_template.backend import NAME


def _devices_json(**env: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "flashllm", "devices", "--json"], capture_output=True,
                            text=True, check=True, env={**os.environ, **env}, timeout=300)
    return json.loads(result.stdout)


def test_flashllm_devices_lists_the_template() -> None:
    data = _devices_json()
    rows = {b["name"]: b for b in data["backends"]}
    assert rows[NAME]["device_type"] == "cpu"
    assert rows[NAME]["proof"] == "conformance"
    assert rows[NAME]["available"], rows[NAME]["reason"]
    assert rows[NAME]["priority"] < rows["cpu"]["priority"]
    assert any(r["backend"] == NAME for r in data["matrix"])
    assert data["plugin_failures"] == []


def test_plugin_env_vars_select_the_template(entry_point_name: str) -> None:
    blocked = {b["name"] for b in _devices_json(FLASHLLM_DISABLE_PLUGINS=entry_point_name)["backends"]}
    assert NAME not in blocked and "cpu" in blocked
    none_allowed = {b["name"] for b in _devices_json(FLASHLLM_PLUGINS="")["backends"]}
    assert NAME not in none_allowed
    assert NAME in {b["name"] for b in _devices_json(FLASHLLM_PLUGINS=entry_point_name)["backends"]}


def test_picked_only_when_asked_for(plugins: FlashPlugins) -> None:
    assert select_device("cpu", plugins=plugins).backend.name == "cpu"
    assert select_device("auto", plugins=plugins).backend.name != NAME
    assert select_device("cpu", NAME, plugins=plugins).backend.name == NAME


def test_is_available_explains_a_missing_requirement(template_backend, monkeypatch) -> None:
    ok, reason = template_backend.is_available()
    assert ok and torch.__version__ in reason
    monkeypatch.setattr(template, "MIN_TORCH", (99, 0))
    ok, reason = template_backend.is_available()
    assert not ok and "torch >= 99.0" in reason and "pip install" in reason


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3, tokenizer=False)


def test_greedy_tokens_match_the_reference_backend(tiny_llama: Path) -> None:
    # float32: one rounding fewer in rms_norm is far below any logit gap. In bf16 it can flip a
    # near-tie argmax of a random model, so half precisions are proven per kernel, not per token.
    options = dict(device="cpu", dtype="float32", block_size=16, max_model_len=256, num_kv_blocks=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = LLM(str(tiny_llama), backend=NAME, **options)
    assert ours.engine.parts.ops.sources["rms_norm"] == NAME  # the kernel under test really runs
    reference = LLM(str(tiny_llama), backend="reference", **options)
    assert reference.engine.parts.ops.sources["rms_norm"] == "reference"
    got = [o.outputs[0].token_ids for o in ours.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    assert got == want
