"""The example plugin's toy architecture: its own config parsing and checkpoint names, generated through flashllm.LLM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from flashllm.models.hf_config import ModelLoadError, load_hf_config, parse_hf_config
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.registry import ModelRegistry
from flashllm.registry.plugins import make_plugin_manager

# GPT-2 field names and a GeGLU MLP: nothing Llama's parser would accept
CONFIG = {
    "architectures": ["ToyGeluForCausalLM"], "model_type": "toy_gelu", "hidden_act": "gelu",
    "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 48, "n_positions": 128,
    "norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
}
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [70, 2], [11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 30]]
MAX_TOKENS = 10


def write_checkpoint(model_dir: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """config.json + model.safetensors of random toy weights, spread wide enough that greedy picks are decisive."""
    h, inner, vocab = CONFIG["n_embd"], CONFIG["n_inner"], CONFIG["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {"transformer.wte.weight": randn(vocab, h, std=1.0), "lm_head.weight": randn(vocab, h, std=0.5),
               "transformer.ln_f.weight": 1 + randn(h, std=0.1)}
    for i in range(CONFIG["n_layer"]):
        p = f"transformer.h.{i}"
        weights |= {f"{p}.ln_1.weight": 1 + randn(h, std=0.1), f"{p}.ln_2.weight": 1 + randn(h, std=0.1),
                    f"{p}.w_gate.weight": randn(inner, h, std=0.3), f"{p}.w_up.weight": randn(inner, h, std=0.3),
                    f"{p}.w_down.weight": randn(h, inner, std=0.2)}
        weights |= {f"{p}.attn.{name}.weight": randn(h, h, std=0.3) for name in ("wq", "wk", "wv", "wo")}
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return weights


def toy_logits(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The toy model written out in float64 torch: full causal attention, no cache. Returns (T, vocab)."""
    w = {k: v.double() for k, v in w.items()}
    num_heads, eps = CONFIG["n_head"], CONFIG["norm_eps"]
    seq_len, head_dim = len(ids), CONFIG["n_embd"] // num_heads

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    inv_freq = 1.0 / CONFIG["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq).repeat(1, 2)  # (T, D)

    def rope(x: torch.Tensor) -> torch.Tensor:  # x (T, H, D), rotate-half (neox) layout
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * angles.cos()[:, None] + rotated * angles.sin()[:, None]

    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    x = w["transformer.wte.weight"][ids]
    for i in range(CONFIG["n_layer"]):
        p = f"transformer.h.{i}"
        a = rms(x, w[f"{p}.ln_1.weight"])
        q, k, v = (
            (a @ w[f"{p}.attn.{n}.weight"].T).view(seq_len, num_heads, head_dim) for n in ("wq", "wk", "wv")
        )
        q, k = rope(q), rope(k)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hts,shd->thd", probs, v).reshape(seq_len, -1) @ w[f"{p}.attn.wo.weight"].T
        m = rms(x, w[f"{p}.ln_2.weight"])
        x = x + (F.gelu(m @ w[f"{p}.w_gate.weight"].T) * (m @ w[f"{p}.w_up.weight"].T)) @ w[f"{p}.w_down.weight"].T
    return rms(x, w["transformer.ln_f.weight"]) @ w["lm_head.weight"].T


def toy_greedy(w: dict[str, torch.Tensor], prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation from toy_logits, recomputing the whole sequence each step."""
    ids = list(prompt)
    for _ in range(max_tokens):
        top2 = toy_logits(w, ids)[-1].topk(2)
        assert top2.values[0] - top2.values[1] > 1e-4, "the reference's greedy pick is a near tie; choose another seed"
        ids.append(int(top2.indices[0]))
    return ids[len(prompt):]


def plugin_registry() -> ModelRegistry:
    return ModelRegistry.from_targets(make_plugin_manager().model_targets())


def test_the_toy_config_is_parsed_by_its_own_architecture_and_refused_by_llamas(example_plugin, tmp_path) -> None:
    write_checkpoint(tmp_path)
    config = load_hf_config(tmp_path, plugin_registry())
    assert type(config).__name__ == "ToyGeluConfig"
    assert (config.architecture, config.head_dim, config.vocab_size, config.max_position_embeddings) == (
        "ToyGeluForCausalLM", 8, 96, 128)
    with pytest.raises(ModelLoadError, match="missing required field 'hidden_size'"):
        LlamaForCausalLM.parse_config(CONFIG, "config.json")
    with pytest.raises(ModelLoadError, match="missing required field 'n_layer'"):
        parse_hf_config({k: v for k, v in CONFIG.items() if k != "n_layer"}, plugin_registry())
    with pytest.raises(ModelLoadError, match=r"hidden_act='silu'.*GeGLU"):
        parse_hf_config({**CONFIG, "hidden_act": "silu"}, plugin_registry())


def test_without_the_plugin_the_toy_architecture_is_unknown(tmp_path) -> None:
    write_checkpoint(tmp_path)
    with pytest.raises(ModelLoadError, match="'ToyGeluForCausalLM' .* is not supported; supported: .*LlamaForCausalLM"):
        load_hf_config(tmp_path, ModelRegistry.from_targets(make_plugin_manager().model_targets()))


@pytest.mark.parametrize("backend", [None, "cpu", "reference"])
def test_llm_generates_the_toy_models_greedy_tokens(example_plugin, tmp_path, backend) -> None:
    import flashllm

    weights = write_checkpoint(tmp_path / "toy")
    expected = [toy_greedy(weights, prompt, MAX_TOKENS) for prompt in PROMPTS]
    llm = flashllm.LLM(str(tmp_path / "toy"), device="cpu", backend=backend, dtype="float32", block_size=16,
                       num_kv_blocks=32)
    assert type(llm.engine.parts.model).__name__ == "ToyGeluForCausalLM"
    assert llm.engine.parts.model.fusions() == {}  # nothing declared: backends run its own forward
    params = flashllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert [out.outputs[0].token_ids for out in outputs] == expected
