"""The models section of `flashllm devices` and docs/capabilities.md: one row per registered architecture."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashllm.cli import main
from flashllm.models.builtin import BUILTIN_MODELS
from flashllm.models.catalog import model_rows
from flashllm.models.hf_config import PREQUANTIZED_FORMATS
from flashllm.ops import op_specs
from flashllm.registry.hookspecs import hookimpl
from flashllm.registry.matrix import ModelRow, models_markdown
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import PRECISIONS

ROOT = Path(__file__).resolve().parents[2]
MOE = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
       "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "Ernie4_5_MoeForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM", "GptOssForCausalLM",
       "OlmoeForCausalLM", "FlexOlmoForCausalLM", "Qwen3VLMoeForConditionalGeneration", "HunYuanMoEV1ForCausalLM", "Dots1ForCausalLM", "AfmoeForCausalLM", "SolarOpenForCausalLM",
       "Glm4vMoeForConditionalGeneration",
       "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
       "PhimoeForCausalLM", "PhiMoEForCausalLM", "DbrxForCausalLM",
       "MiniMaxM2ForCausalLM", "ExaoneMoeForCausalLM", "JambaForCausalLM", "Qwen3NextForCausalLM",
       "Lfm2MoeForCausalLM"}
# pre-quantized formats a model reads without a packed-weight layer, dequantized at load: block FP8 (DeepSeek),
# MXFP4 experts (gpt-oss)
DEQUANTIZED_AT_LOAD = {"fp8", "mxfp4"}
# architectures whose config parser refuses a quantization_config (grep their parse_config refusals)
PREQUANT_REFUSED = {"ExaoneMoeForCausalLM", "PhimoeForCausalLM", "PhiMoEForCausalLM", "DbrxForCausalLM", "ChatGLMModel", "ChatGLMForConditionalGeneration", "GlmForCausalLM", "Glm4ForCausalLM", "Gemma3ForCausalLM", "Gemma2ForCausalLM", "GemmaForCausalLM", "OlmoForCausalLM", "HeliumForCausalLM", "ApertusForCausalLM",
                    "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Exaone4ForCausalLM", "HunYuanMoEV1ForCausalLM", "AfmoeForCausalLM",
                    "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "PersimmonForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM", "Mamba2ForCausalLM", "BambaForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Starcoder2ForCausalLM", "ArceeForCausalLM",
                    "NemotronForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM", "MiniCPM3ForCausalLM", "FlexOlmoForCausalLM", "CwmForCausalLM", "BloomForCausalLM", "MptForCausalLM", "MPTForCausalLM", "GPTJForCausalLM", "CodeGenForCausalLM",
                    "FalconForCausalLM", "GPTBigCodeForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM", "GPTNeoForCausalLM", "XGLMForCausalLM",
                    "StableLmForCausalLM", "Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                    "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                    "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
                    "InternVLForConditionalGeneration", "Idefics3ForConditionalGeneration",
                    "SmolVLMForConditionalGeneration", "AyaVisionForConditionalGeneration",
                    "Cohere2VisionForConditionalGeneration",
                    "Llama4ForCausalLM", "Llama4ForConditionalGeneration"}


class _BrokenModelPlugin:
    """A plugin registering one architecture whose lazy target does not import."""

    @hookimpl
    def flashllm_register_models(self, register: Callable[[str, Any], None]) -> None:
        register("BrokenForCausalLM", "flashllm_no_such_module:BrokenForCausalLM")


def _table_rows(text: str, header: str) -> dict[str, list[str]]:
    """Markdown table after `header` -> first cell (backticks stripped) -> cells."""
    lines = text.split(header, 1)[1].splitlines()
    table = {}
    for line in (ln for ln in lines if ln.startswith("| `")):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        table[cells[0].strip("`")] = cells
    return table


def test_every_builtin_architecture_is_a_row_with_its_declared_facts() -> None:
    rows = {r.architecture: r for r in model_rows(make_plugin_manager(load_entry_points=False))}
    assert set(rows) == set(BUILTIN_MODELS)
    quant_keys = {p.quant for p in PRECISIONS} - {"none"}
    for name, row in rows.items():
        assert not row.error, row.error
        assert row.target == BUILTIN_MODELS[name]
        assert set(row.required_ops) <= set(op_specs()), f"{name} needs an op flashllm does not define"
        assert row.weight_only is not None and set(row.weight_only) <= quant_keys
        assert row.prequantized is not None and set(row.prequantized) <= set(PREQUANTIZED_FORMATS) | DEQUANTIZED_AT_LOAD
        assert row.tokenizer, f"{name} declares no tokenizer file"
        assert (row.prequantized == ()) == (name in PREQUANT_REFUSED), name
        assert ("fused_moe" in row.required_ops) == (name in MOE), name
    assert rows["QWenLMHeadModel"].tokenizer == ("qwen.tiktoken",)
    assert rows["ChatGLMModel"].tokenizer == rows["BaichuanForCausalLM"].tokenizer == ("tokenizer.model",)
    assert any("alibi" in need.lower() for need in rows["BaichuanForCausalLM"].attention_needs)


def test_committed_page_has_a_models_row_per_architecture() -> None:
    page = (ROOT / "docs" / "capabilities.md").read_text(encoding="utf-8")
    table = _table_rows(page, "## Models")
    assert set(table) == set(BUILTIN_MODELS)
    # columns: architecture | family | class | needs | weight-only | pre-quantized | tokenizer
    assert "fused_moe (" in table["MixtralForCausalLM"][3] and "reference" in table["MixtralForCausalLM"][3]
    assert table["ChatGLMModel"][5] == "refused"
    assert table["Qwen2MoeForCausalLM"][5] == table["LlamaForCausalLM"][5] == "GPTQ, AWQ, FP8"
    assert table["QWenLMHeadModel"][6] == "qwen.tiktoken"


def test_rendering_says_refused_and_not_declared_apart() -> None:
    rows = [ModelRow("AForCausalLM", "pkg.a:A", "a", ("fused_moe",), ("ALiBi",), ("w8a16",), (), ("tokenizer.model",)),
            ModelRow("BForCausalLM", "pkg.b:B", "b"),
            ModelRow("CForCausalLM", "pkg.c:C", "c", error="failed to import: boom")]
    table = _table_rows(models_markdown(rows, {"fused_moe": ["cpu", "reference"]}), "| architecture")
    assert table["AForCausalLM"][3:] == ["fused_moe (cpu, reference), attention: ALiBi", "w8a16", "refused",
                                         "tokenizer.model"]
    assert table["BForCausalLM"][3:] == ["—", "not declared", "not declared", "not declared"]
    assert table["CForCausalLM"][3] == "failed to import: boom"


def test_a_model_target_that_fails_to_import_is_a_row_not_a_crash() -> None:
    plugins = make_plugin_manager(load_entry_points=False, extra_plugins=[_BrokenModelPlugin()])
    rows = {r.architecture: r for r in model_rows(plugins)}
    assert "flashllm_no_such_module" in rows["BrokenForCausalLM"].error
    assert not rows["LlamaForCausalLM"].error


def test_devices_lists_every_architecture_in_text_and_json(capsys) -> None:
    assert main(["devices", "--json"]) == 0
    models = {m["architecture"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert set(models) >= set(BUILTIN_MODELS)
    assert "reference" in models["Qwen2MoeForCausalLM"]["required_ops"]["fused_moe"]
    assert models["LlamaForCausalLM"]["prequantized"] == ["gptq", "awq", "fp8"]
    assert models["BaiChuanForCausalLM"]["prequantized"] == models["QWenLMHeadModel"]["prequantized"] == ["gptq", "awq"]
    assert models["ChatGLMModel"]["prequantized"] == []
    assert main(["devices"]) == 0
    text = capsys.readouterr().out.split("\nModels", 1)[1]
    for name in BUILTIN_MODELS:
        line = next((ln for ln in text.splitlines() if ln.split()[:1] == [name]), None)
        assert line is not None, f"{name} missing from `flashllm devices`"
    assert "qwen.tiktoken" in next(ln for ln in text.splitlines() if ln.split()[:1] == ["QWenLMHeadModel"])
