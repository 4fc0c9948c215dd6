"""What a model declares through fusions() (flashllm/registry/fusions.py), and the cpu fast paths that
read only that: a model declaring a fusion gets its fast path, one declaring none gets none and
generates the same tokens through its own forward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flashllm import hookimpl
from flashllm.backends.cpu import decode_burst, decode_stack, greedy_screen, native
from flashllm.core.engine import Engine
from flashllm.llm import engine_config
from flashllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from flashllm.models.qwen2 import Qwen2ForCausalLM
from flashllm.models.qwen3 import Qwen3ForCausalLM
from flashllm.registry.fusions import DECODER_STACK, LM_HEAD, DecoderStackFusion, LMHeadFusion, declared
from flashllm.registry.plugins import make_plugin_manager
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2]]
MAX_TOKENS = [20, 9, 14]
needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")


class NoFusionsLlama(LlamaForCausalLM):
    """Llama's layers and weights, declaring no fused fast path."""

    def fusions(self) -> dict[str, object]:
        return {}


class NoFusionsQwen2(Qwen2ForCausalLM):
    """Qwen2's layers and weights, declaring no fused fast path."""

    def fusions(self) -> dict[str, object]:
        return {}


class NoFusionsQwen3(Qwen3ForCausalLM):
    """Qwen3's layers and weights, declaring no fused fast path."""

    def fusions(self) -> dict[str, object]:
        return {}


# by the architecture they copy
NO_FUSIONS = {"LlamaForCausalLM": NoFusionsLlama, "Qwen2ForCausalLM": NoFusionsQwen2,
              "Qwen3ForCausalLM": NoFusionsQwen3}


class _Models:
    @hookimpl
    def flashllm_register_models(self, register) -> None:
        for architecture, model_class in NO_FUSIONS.items():
            register(f"NoFusions{architecture}", model_class)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])  # GQA untied; qkv bias, tied; q / k norms
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=3, tokenizer=False)


def _engine(model_dir: Path, backend: str | None = None, plugins=None) -> Engine:
    config = engine_config(str(model_dir), dtype="float32", device="cpu", backend=backend, block_size=16,
                           num_kv_blocks=32, max_model_len=128, num_scheduler_steps=8)
    return Engine(config, plugins)


def _argmax(rows: torch.Tensor) -> torch.Tensor:
    return rows.argmax(dim=-1)


def _tokens(engine: Engine) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    ids = [engine.add_request(prompt, p) for prompt, p in zip(PROMPTS, params, strict=True)]
    outputs = engine.run_until_done(ids)
    return [outputs[i].outputs[0].token_ids for i in ids]


def test_llama_and_qwen2_declare_their_stack_and_head_as_config_json_says(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    model = _engine(model_dir).parts.model
    fusions = model.fusions()
    assert set(fusions) == {DECODER_STACK, LM_HEAD}
    stack, head = fusions[DECODER_STACK], fusions[LM_HEAD]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    assert (stack.num_heads, stack.num_kv_heads, stack.head_dim) == (heads, config["num_key_value_heads"], head_dim)
    assert stack.intermediate_size == config["intermediate_size"] and stack.activation == "silu"
    assert len(stack.layers) == config["num_hidden_layers"] and stack.scale == pytest.approx(head_dim**-0.5)
    assert all(layer.input_layernorm.eps == config["rms_norm_eps"] for layer in stack.layers)
    assert tuple(stack.embed_tokens.shape) == (config["vocab_size"], config["hidden_size"])
    assert stack.ops.sources["paged_attention"] == "cpu"
    assert (stack.layers[0].qkv_proj.bias is not None) == (config["model_type"] == "qwen2")
    assert head.tied == bool(config.get("tie_word_embeddings")) and head.vocab_size == config["vocab_size"]
    assert head.tied == (head.weight.data_ptr() == stack.embed_tokens.data_ptr())
    # LM_HEAD's promise: the logits are the head's product and nothing after it
    hidden = torch.randn(3, config["hidden_size"])
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden), hidden @ head.weight[: head.vocab_size].T)


def test_the_reference_backend_declares_its_own_kernels_and_gets_no_fused_step(model_dir: Path) -> None:
    model = _engine(model_dir, backend="reference").parts.model
    stack = declared(model, DECODER_STACK, DecoderStackFusion)
    assert stack is not None and set(stack.ops.sources.values()) == {"reference"}
    assert decode_stack.build(model) is None


@needs_native
def test_a_model_declaring_no_fusions_gets_no_fast_path_and_the_same_tokens(model_dir: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _engine(model_dir)
    expected = _tokens(plain)
    assert decode_stack.build(plain.parts.model) is not None  # the fast paths take this model as Llama declares it
    assert greedy_screen.kept(plain.parts.model) is not None
    fused_steps: list[bool] = []
    real = decode_stack.FusedDecode.__call__
    monkeypatch.setattr(decode_stack.FusedDecode, "__call__", lambda self, *a: fused_steps.append(True) or real(self, *a))
    copy = shutil.copytree(model_dir, tmp_path / "no-fusions")
    config = json.loads((copy / "config.json").read_text())
    (architecture,) = config["architectures"]
    (copy / "config.json").write_text(json.dumps({**config, "architectures": [f"NoFusions{architecture}"]}))
    engine = _engine(copy, plugins=make_plugin_manager(load_entry_points=False, extra_plugins=[_Models()]))
    model = engine.parts.model
    assert type(model) is NO_FUSIONS[architecture]
    assert decode_stack.build(model) is None and greedy_screen.build(model, _argmax) is None
    assert decode_burst.build(model, _argmax) is None
    assert _tokens(engine) == expected
    assert fused_steps == [] and greedy_screen.KEPT_AS not in model.lm_head.qweight.kernel_cache


@needs_native
def test_a_block_that_is_not_the_standard_one_is_not_declared(model_dir: Path) -> None:
    model = _engine(model_dir).parts.model

    class ScaledResidual(LlamaDecoderLayer):
        def forward(self, *args, **kwargs):
            hidden, residual = super().forward(*args, **kwargs)
            return 2 * hidden, residual

    assert decode_stack.build(model) is not None and greedy_screen.build(model, _argmax) is not None
    model.model.layers[1].__class__ = ScaledResidual
    assert set(model.fusions()) == {LM_HEAD}
    assert decode_stack.build(model) is None

    class SoftCapped(type(model)):
        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return 30 * torch.tanh(super().compute_logits(hidden) / 30)

    model.__class__ = SoftCapped
    assert model.fusions() == {}
    assert greedy_screen.build(model, _argmax) is None


def test_a_wrong_record_under_a_fusions_name_is_an_error() -> None:
    class Confused:
        def fusions(self) -> dict[str, object]:
            return {LM_HEAD: "the head"}

    with pytest.raises(TypeError, match="expected a LMHeadFusion"):
        declared(Confused(), LM_HEAD, LMHeadFusion)
    assert declared(object(), LM_HEAD, LMHeadFusion) is None  # no fusions(): declares none
