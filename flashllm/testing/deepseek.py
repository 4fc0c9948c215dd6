"""Tiny random DeepSeek-V2 / V3 (and GLM-4.7-Flash) checkpoints written by transformers' own classes, and block-FP8
copies of them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

INIT_STD = 0.1  # routing logits of order one: experts are chosen decisively, and a wrong one shows
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
         "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
# what DeepSeek-V3 keeps in bf16 beside its e4m3 linear weights: embeddings, head, norms, routers
_KEPT_FLOAT = ("embed_tokens.weight", "lm_head.weight", "norm.weight", ".gate.weight")  # .gate: routers
BASE: dict[str, Any] = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "intermediate_size": 96,
    "moe_intermediate_size": 32, "n_routed_experts": 8, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 24,
}
# preset -> (transformers model_type, architecture, config fields)
PRESETS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # group-limited softmax routing, a q_lora_rank bottleneck, YaRN with mscale != mscale_all_dim
    "v2": ("deepseek_v2", "DeepseekV2ForCausalLM",
           {"num_hidden_layers": 3, "first_k_dense_replace": 1, "q_lora_rank": 48, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 1.5, "rope_parameters": _YARN}),
    # V2-Lite's shape: no q bottleneck, plain greedy top-k, two shared experts, default RoPE
    "v2_lite": ("deepseek_v2", "DeepseekV2ForCausalLM",
                {"num_hidden_layers": 2, "first_k_dense_replace": 1, "q_lora_rank": None, "n_shared_experts": 2,
                 "num_experts_per_tok": 3, "topk_method": "greedy", "routed_scaling_factor": 1.0}),
    # sigmoid scores with the correction bias, renormalized, interleaved RoPE, YaRN
    "v3": ("deepseek_v3", "DeepseekV3ForCausalLM",
           {"num_hidden_layers": 3, "first_k_dense_replace": 1, "q_lora_rank": 48, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "rope_interleave": True, "rope_parameters": _YARN}),
    # neox RoPE, not renormalized, every layer MoE, YaRN's attention factor from the factor alone
    "v3_neox": ("deepseek_v3", "DeepseekV3ForCausalLM",
                {"num_hidden_layers": 2, "first_k_dense_replace": 0, "q_lora_rank": 40, "n_shared_experts": 1,
                 "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1, "norm_topk_prob": False,
                 "routed_scaling_factor": 1.0, "rope_interleave": False,
                 "rope_parameters": {k: v for k, v in _YARN.items() if not k.startswith("mscale")}}),
    # GLM-4.7-Flash (transformers' Glm4MoeLite: V3's MLA, GLM-4.5's MoE): dense layers named by mlp_layer_types (two
    # here, where its default is one), ungrouped sigmoid routing scaled by 1.8, interleaved RoPE without scaling
    "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteForCausalLM",
                      {"num_hidden_layers": 4, "mlp_layer_types": ["dense", "dense", "sparse", "sparse"],
                       "q_lora_rank": 48, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
                       "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.8,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def raw_config(preset: str, **changes: Any) -> dict[str, Any]:
    """config.json of a preset as a dict (what transformers would write, before its own defaults)."""
    model_type, architecture, fields = PRESETS[preset]
    return {"architectures": [architecture], "model_type": model_type, **BASE, **fields, **changes}


def build_deepseek_model(out_dir: Path, preset: str, seed: int = 0, **changes: Any) -> Path:
    """Save a tiny random transformers DeepSeek model: weights N(0, 0.1) (norms 1 + that), the V3 correction
    bias too, so routing and every MLA projection matter. changes: config fields over the preset's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, architecture, fields = PRESETS[preset]
    config = AutoConfig.for_model(model_type, architectures=[architecture], **{**BASE, **fields, **changes})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted([*model.named_parameters(), *model.named_buffers()]):
            if not tensor.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(tensor.shape, generator=gen) * INIT_STD
            tensor.copy_(noise + 1.0 if "norm" in name else noise)
    model.save_pretrained(out_dir)
    return out_dir


def write_block_fp8_copy(source: Path, out_dir: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Rewrite a float checkpoint as DeepSeek-V3 ships: every 2-D projection weight (not embeddings, head,
    norms or routers) as float8_e4m3fn codes plus `weight_scale_inv` fp32, one scale per block, chosen so
    the block's largest magnitude maps to 448; quantization_config names the block size."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and name.endswith(".weight") and not name.endswith(_KEPT_FLOAT):
            out[name], out[name + "_scale_inv"] = quantize_block_fp8(tensor.float(), block)
        else:
            out[name] = tensor
    save_file(out, out_dir / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) fp32 -> (e4m3 codes (N, K), scales (ceil(N/rows), ceil(K/cols)) fp32): weight ~ codes * scale."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = torch.empty(grid)
    codes = torch.empty_like(weight)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale = max(float(part.abs().max()) / 448.0, 1e-12)
            scales[i, j] = scale
            codes[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = part / scale
    return codes.to(torch.float8_e4m3fn), scales


def block_fp8_values(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """code * scale of its block in fp32, written independently of the loader (a Kronecker product, cropped)."""
    rows, cols = codes.shape
    return codes.float() * torch.kron(scales, torch.ones(block))[:rows, :cols]


def write_dequantized_copy(fp8_dir: Path, out_dir: Path) -> Path:
    """The float checkpoint a block-FP8 one (write_block_fp8_copy) stands for: each e4m3 weight as block_fp8_values,
    the scales dropped, config.json without its quantization_config (what transformers then runs)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((fp8_dir / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    stored = load_file(fp8_dir / "model.safetensors")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: block_fp8_values(t, stored[name + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t
               for name, t in stored.items() if not name.endswith("_scale_inv")}, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def deepseek_tensor_shapes(config: Any) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(HF tensor name, shape, is a norm scale) of every tensor of a DeepSeek-V2/V3 checkpoint (no MTP layers)."""
    h, heads, rank, rope = config.hidden_size, config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    qk, v = config.qk_nope_head_dim + rope, config.v_head_dim
    yield "model.embed_tokens.weight", (config.vocab_size, h), False
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), True
        yield f"{p}.post_attention_layernorm.weight", (h,), True
        if config.q_lora_rank is None:
            yield f"{p}.self_attn.q_proj.weight", (heads * qk, h), False
        else:
            yield f"{p}.self_attn.q_a_proj.weight", (config.q_lora_rank, h), False
            yield f"{p}.self_attn.q_a_layernorm.weight", (config.q_lora_rank,), True
            yield f"{p}.self_attn.q_b_proj.weight", (heads * qk, config.q_lora_rank), False
        yield f"{p}.self_attn.kv_a_proj_with_mqa.weight", (rank + rope, h), False
        yield f"{p}.self_attn.kv_a_layernorm.weight", (rank,), True
        yield f"{p}.self_attn.kv_b_proj.weight", (heads * (config.qk_nope_head_dim + v), rank), False
        yield f"{p}.self_attn.o_proj.weight", (h, heads * v), False
        if i < config.first_k_dense_replace:
            inter, mlps = config.intermediate_size, ((f"{p}.mlp", config.intermediate_size),)
        else:
            inter = config.moe_intermediate_size
            yield f"{p}.mlp.gate.weight", (config.n_routed_experts, h), False
            if config.sigmoid_scoring:
                yield f"{p}.mlp.gate.e_score_correction_bias", (config.n_routed_experts,), False
            mlps = tuple((f"{p}.mlp.experts.{e}", inter) for e in range(config.n_routed_experts))
            if config.n_shared_experts:
                mlps += ((f"{p}.mlp.shared_experts", inter * config.n_shared_experts),)
        for prefix, size in mlps:
            for proj, shape in (("gate_proj", (size, h)), ("up_proj", (size, h)), ("down_proj", (h, size))):
                yield f"{prefix}.{proj}.weight", shape, False
    yield "model.norm.weight", (h,), True
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h), False


def build_deepseek_mtp_model(out_dir: Path, preset: str = "v3", seed: int = 0, predictable: float | None = None
                             ) -> Path:
    """A tiny DeepSeek-V3 checkpoint laid out as V3 ships its multi-token-prediction (MTP) layer: the decoder
    of `preset`, then model.layers.{N} (N = num_hidden_layers) holding a full decoder block (random, MoE when
    N >= first_k_dense_replace) plus enorm, hnorm, eh_proj (hidden, 2 * hidden), shared_head.norm,
    shared_head.head and its own embed_tokens; config.json says num_nextn_predict_layers = 1.

    The MTP embedding and head are random, not copies of the model's, so using the wrong ones shows.
    transformers builds the block (as layer N of an N + 1 layer model); it ignores the MTP tensors on load.

    predictable (a factor in (0, 1)): a model whose MTP layer guesses right often, for engine tests that need
    accepted drafts. Every block's output projections (o_proj, down_proj) are scaled by the factor, so the
    next token depends mostly on the current one (a bigram model, with some context), and the MTP layer
    maps the embedding of t_{i+1} through eh_proj = [I 0] to the model's own head: it predicts what the
    model would say after t_{i+1}."""
    fields = PRESETS[preset][2]
    layers = fields["num_hidden_layers"]
    grown = {"mlp_layer_types": [*fields["mlp_layer_types"], "sparse"]} if "mlp_layer_types" in fields else {}
    build_deepseek_model(out_dir, preset, seed, num_hidden_layers=layers + 1, **grown)
    return with_mtp_layer(out_dir, layers, seed, predictable)


def with_mtp_layer(out_dir: Path, layers: int, seed: int, predictable: float | None = None,
                   std: float = INIT_STD) -> Path:
    """Turn layer `layers` of the transformers checkpoint in out_dir (built with layers + 1 decoder layers) into
    the MTP layer the published checkpoints append (build_deepseek_mtp_model says how, and what `predictable`
    does): its enorm, hnorm, eh_proj, shared_head and embed_tokens added (random with `std`), config.json back
    to `layers` layers with num_nextn_predict_layers 1."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(out_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    h, vocab = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(seed + 1)
    prefix = f"model.layers.{layers}."
    extra = {"enorm.weight": 1.0 + std * torch.randn(h, generator=gen),
             "hnorm.weight": 1.0 + std * torch.randn(h, generator=gen),
             "eh_proj.weight": std * torch.randn(h, 2 * h, generator=gen),
             "shared_head.norm.weight": 1.0 + std * torch.randn(h, generator=gen),
             "shared_head.head.weight": std * torch.randn(vocab, h, generator=gen),
             "embed_tokens.weight": std * torch.randn(vocab, h, generator=gen)}
    if predictable is not None:
        for name in tensors:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = tensors[name] * predictable
        eye = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
        extra.update({"enorm.weight": torch.ones(h), "eh_proj.weight": eye,
                      "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
                      "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                      "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    tensors.update({prefix + name: tensor.to(tensors["model.norm.weight"].dtype) for name, tensor in extra.items()})
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    if isinstance(config.get("mlp_layer_types"), list):  # the list describes the decoder's layers only
        config["mlp_layer_types"] = config["mlp_layer_types"][:layers]
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
