"""GPT-J (`GPTJForCausalLM`: EleutherAI's GPT-J-6B and fine-tunes such as GPT4All-J and Pygmalion-6B), as
transformers' GPTJConfig / GPTJForCausalLM read and run it: Phi's parallel block, x + attn(ln_1(x)) + mlp(ln_1(x)),
one biased LayerNorm (`layer_norm_epsilon`) feeding both branches; separate q / k / v projections and an output
projection `attn.out_proj`, none with a bias; RoPE over the first `rotary_dim` (default 64) features of each head
turning adjacent pairs (2i, 2i + 1), the GPT-J layout, always with base 10000 (transformers' GPT-J reads no rope
fields: a config.json's rope_theta / rope_scaling change nothing there, so nothing here); the ungated MLP
`fc_out(activation_function(fc_in(x)))` (default gelu_new) with biases, `n_inner` features wide (default 4 x n_embd);
a final LayerNorm `ln_f` and an LM head with a bias, untied unless config.json says otherwise.

config.json uses GPT-2's names (n_embd, n_layer, n_head, n_positions), or transformers' aliases of them (hidden_size,
num_hidden_layers, num_attention_heads, max_position_embeddings), an alias winning where both are given as in
GPTJConfig. There is no grouped-query attention. Dropouts are training-only. The block and the head's bias are not
Llama's, so the model takes the per-op path.

CodeGen (`CodeGenForCausalLM`: Salesforce's codegen-350M..16B mono / multi / nl) is the same model, with the same
config fields and defaults, except that q, k and v come from one fused `attn.qkv_proj` whose rows are laid out for
the 4 model-parallel shards CodeGen was trained on: 4 blocks, each [q | v | k] of n_embd / 4 rows (see
split_codegen_qkv). CodeGen 2 checkpoints whose config.json names their own modeling code (`auto_map`) run as
transformers' built-in CodeGen runs them (4 shards), which is what flashllm is checked against, not that code."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from torch import Tensor

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.phi import PhiForCausalLM

# transformers' GPTJConfig defaults (GPT-J-6B's shape) where config.json leaves a field out
GPTJ_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16, "rotary_dim": 64,
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "bos_token_id": 50256, "eos_token_id": 50256,
    "tie_word_embeddings": False,
}
# GPTJConfig.attribute_map: transformers' generic name -> GPT-J's own
GPTJ_ALIASES: dict[str, str] = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                                "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}
GPTJ_THETA = 10000.0  # create_sinusoidal_positions' fixed base
# fields other families read that transformers' GPT-J ignores: dropped so that parse_llama_config does not read them
_IGNORED = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor", "head_dim",
            "num_key_value_heads", "intermediate_size", "rms_norm_eps", "hidden_act", "use_sliding_window",
            "sliding_window", "layer_types", "max_window_layers", "qk_layernorm", "attention_bias", "mlp_bias")


def parse_gptj_config(raw: dict[str, Any], source: str = "config.json", family: str = "GPT-J") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig: the GPT-2 names (or their aliases) as Llama's sizes, `n_inner` (default
    4 x n_embd) as intermediate_size, `layer_norm_epsilon` as the norms' eps, `activation_function` as an ungated
    activation (PLAIN_ACTIVATIONS), no attention biases, MLP biases, as many key / value heads as query heads,
    RoPE of base 10000 turning adjacent pairs of the first `rotary_dim` features, full attention. A pre-quantized
    checkpoint is refused (quantize at load with --quant_type). Raises ModelLoadError (one line) naming `family`."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: {family} loads float checkpoints only (quantize them at load with "
                             "--quant_type); drop quantization_config or use a float checkpoint")
    if "rotary_dim" in raw and raw["rotary_dim"] is None:
        raise ModelLoadError(f"{source}: rotary_dim=null; transformers' {family} config needs an int (64 by default)")
    fields = {**GPTJ_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    for alias, name in GPTJ_ALIASES.items():
        if alias in fields:
            fields[name] = fields.pop(alias)
    hidden = fields["n_embd"]
    view = {key: value for key, value in fields.items() if key not in _IGNORED}
    view |= {"hidden_size": hidden, "num_hidden_layers": fields["n_layer"], "num_attention_heads": fields["n_head"],
             "max_position_embeddings": fields["n_positions"], "rms_norm_eps": fields["layer_norm_epsilon"],
             "intermediate_size": fields.get("n_inner", 4 * hidden if isinstance(hidden, int) else hidden),
             "hidden_act": fields["activation_function"], "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": GPTJ_THETA},
             "attention_bias": False, "mlp_bias": True}
    rotary_dim = fields["rotary_dim"]
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ModelLoadError(f"{source}: rotary_dim={rotary_dim!r}; expected a positive even int")
    config = parse_llama_config(view, source, activations=tuple(PLAIN_ACTIVATIONS), rotary_dim=rotary_dim)
    if rotary_dim > config.head_dim:
        raise ModelLoadError(f"{source}: rotary_dim={rotary_dim} is larger than the head_dim of n_embd / n_head = "
                             f"{config.head_dim}; expected at most {config.head_dim}")
    return dataclasses.replace(config, rope_interleaved=True)


class GPTJForCausalLM(PhiForCausalLM):
    """GPT-J (module docstring): Phi's stack and biased LM head, the attention without biases. `transformer.wte`,
    `transformer.h.<i>.ln_1`, `attn.q_proj` / `k_proj` / `v_proj` (fused at load), `attn.out_proj`, `mlp.fc_in` /
    `fc_out` and `transformer.ln_f` load as the embedding, the block's norm, qkv_proj, o_proj, the plain MLP's up /
    down projections and the final norm; `lm_head.weight` and `lm_head.bias` into the biased head."""

    renamed_modules: ClassVar[dict[str, str]] = {
        "transformer.wte.": "model.embed_tokens.", "transformer.ln_f.": "model.norm.",
        "transformer.h.": "model.layers.", ".ln_1.": ".input_layernorm.", ".attn.out_proj.": ".self_attn.o_proj.",
        ".attn.": ".self_attn.", ".mlp.fc_in.": ".mlp.up_proj.", ".mlp.fc_out.": ".mlp.down_proj.",
    }
    # older checkpoints (GPT-J-6B's own) keep the causal-mask buffers, which transformers ignores too
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = (".attn.bias", ".attn.masked_bias")

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_gptj_config)."""
        return parse_gptj_config(raw, source)


CODEGEN_MP_NUM = 4  # the model-parallel shards CodeGen's qkv_proj rows are laid out for (CodeGenAttention.mp_num)


def parse_codegen_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig as parse_gptj_config reads it (CodeGenConfig has GPTJConfig's fields and
    defaults; its `n_ctx` is unused), refusing an n_embd that the 4 shards of qkv_proj cannot split evenly."""
    config = parse_gptj_config(raw, source, family="CodeGen")
    if config.hidden_size % CODEGEN_MP_NUM:
        raise ModelLoadError(f"{source}: n_embd={config.hidden_size} is not a multiple of {CODEGEN_MP_NUM}; CodeGen's "
                             f"qkv_proj holds {CODEGEN_MP_NUM} equal shards of q, v and k (transformers cannot run it)")
    return config


def split_codegen_qkv(weights: Iterable[tuple[str, Tensor]], hidden: int) -> Iterator[tuple[str, Tensor]]:
    """`<layer>.attn.qkv_proj.weight` (3 x hidden, hidden), its rows (CODEGEN_MP_NUM, [q | v | k], hidden /
    CODEGEN_MP_NUM) as transformers views them, -> `<layer>.attn.{q,k,v}_proj.weight` of (hidden, hidden) each, every
    shard's part in shard order (which is head order); other tensors pass through. Raises ModelLoadError naming a
    fused tensor of another shape."""
    for name, tensor in weights:
        if not name.endswith(".attn.qkv_proj.weight"):
            yield name, tensor
            continue
        if tuple(tensor.shape) != (3 * hidden, hidden):
            raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; config.json's "
                                 f"n_embd={hidden} needs {(3 * hidden, hidden)}")
        shards = materialize(tensor).reshape(CODEGEN_MP_NUM, 3, hidden // CODEGEN_MP_NUM, hidden)
        layer = name.removesuffix("qkv_proj.weight")
        for index, part in enumerate(("q_proj", "v_proj", "k_proj")):
            yield f"{layer}{part}.weight", shards[:, index].reshape(hidden, hidden)


class CodeGenForCausalLM(GPTJForCausalLM):
    """CodeGen (module docstring): GPT-J's model and names, each fused `attn.qkv_proj` cut into q / k / v as it loads
    (split_codegen_qkv) and fused again, q then k then v, into qkv_proj, each tensor-parallel rank taking its heads'
    rows."""

    # the causal-mask buffer older checkpoints keep (transformers ignores it too)
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = (".attn.causal_mask",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_codegen_config)."""
        return parse_codegen_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights with each fused qkv_proj cut into q / k / v (split_codegen_qkv)."""
        return super().load_weights(split_codegen_qkv(weights, self.config.hidden_size))
