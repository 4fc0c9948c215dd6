"""GGUF architecture metadata -> the config.json dict flashllm's architectures parse (llama, qwen, qwen2, qwen3,
apertus, baichuan, smollm3, starcoder2, gpt2, starcoder, falcon, bloom, arcee, nemotron, phi2, command-r, cohere2, gptneox, stablelm, hunyuan-dense, olmo, olmo2, qwen2vl, qwen3vl, exaone4, gemma, gemma2, gemma3, granite, phi3, chatglm, glm4, ernie4_5 and the mixture-of-experts Mixtral, qwen2moe, qwen3moe,
granitemoe, deepseek2, glm4moe, dots1, hunyuan-moe, ernie4_5-moe, olmoe)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf import (
    apertus,
    arcee,
    bloom,
    chatglm,
    cohere,
    deepseek2,
    dots1,
    ernie,
    exaone4,
    falcon,
    first_generation,
    gemma3,
    glm4moe,
    gpt2,
    gpt_oss,
    gptneox,
    granite,
    hunyuan,
    hunyuan_moe,
    nemotron,
    olmo,
    olmo2,
    olmoe,
    phi2,
    phi3,
    qwen_vl,
    seed_oss,
    smollm3,
    stablelm,
    starcoder2,
)
from flashllm.models.gguf.moe import MOE_GRAPHS, has_experts, moe_config_fields
from flashllm.models.gguf.reader import GGUFFile


@dataclass(frozen=True, slots=True)
class ArchMap:
    """How one GGUF `general.architecture` maps onto a flashllm architecture.

    permute_qk: llama.cpp's converter reorders this arch's Q and K rows for its interleaved rotary
    (pairs 2i, 2i+1), while flashllm rotates half-split pairs (i, i + head_dim/2) as transformers
    does; the loader undoes the reorder. Qwen2 and Qwen3 run half-split rotary in llama.cpp too.
    norm_offset: what llama.cpp's converter added to every `*norm.weight` (Gemma's 1: the file holds 1 + w, the
    checkpoint w); the loader subtracts it, and the model's norm weight_loader adds it back.
    layer_names: GGUF layer tensor part -> checkpoint module, where this arch's differ from Llama's.
    config_fields: (file, the generic fields) -> the arch's own config.json fields (what llama.cpp derives).
    partial_rotary: the arch's config takes RoPE over fewer features than a head has (`rope.dimension_count` <
    the head size; its config_fields says how); elsewhere such a file is refused.
    fused_rows: (parsed config) -> GGUF layer part of a tensor holding several checkpoint projections stacked
    along its rows -> (checkpoint module, rows) of each, in order (Phi-3's attn_qkv and ffn_up).
    config_tensors: tensors config_fields reads (LongRoPE's factors); they are not weights.
    layer_params: GGUF layer tensor ("exp_probs_b.bias") -> checkpoint parameter (after "model.layers.L."), for
    tensors whose checkpoint name is not a module plus the GGUF suffix.
    joined: (GGUF layer parts, checkpoint module, join) of checkpoint weights a converter split into several tensors
    (DeepSeek's kv_b_proj as attn_k_b + attn_v_b); join takes the parts' float values in that order.
    latent_heads: the arch's config_fields sets the head sizes (MLA's query / key and value heads differ, and the
    file's key_length / value_length may describe the latent); the generic head-size checks are skipped.
    appended_layers: the file's blocks past the config's num_hidden_layers are next-token-prediction layers the
    graph never runs (config_fields leaves them out of the count); their tensors are skipped.
    tensor_names: GGUF non-layer tensor -> checkpoint parameter, for the arch's own beyond Llama's token_embd /
    output_norm / output (GPT-2's and StarCoder's `position_embd.weight`).
    """

    architecture: str
    model_type: str
    permute_qk: bool
    norm_offset: float = 0.0
    layer_names: Mapping[str, str] = field(default_factory=dict)
    config_fields: Callable[[GGUFFile, dict[str, Any]], dict[str, Any]] | None = None
    partial_rotary: bool = False
    fused_rows: Callable[[Any], Mapping[str, tuple[tuple[str, int], ...]]] | None = None
    config_tensors: tuple[str, ...] = ()
    layer_params: Mapping[str, str] = field(default_factory=dict)
    joined: tuple[tuple[tuple[str, ...], str, Callable[[list[Any]], Any]], ...] = ()
    latent_heads: bool = False
    appended_layers: bool = False
    tensor_names: Mapping[str, str] = field(default_factory=dict)

    def skips(self, name: str, config: Any) -> bool:
        """Whether the tensor `name` belongs to an appended layer (appended_layers) and is not loaded."""
        match = _BLOCK.match(name)
        return self.appended_layers and match is not None and int(match[1]) >= config.num_hidden_layers


# Mistral 7B files say "llama" (llama.cpp has no separate arch for it): they load as Llama, without a
# sliding window, which GGUF does not record.
ARCHITECTURES: dict[str, ArchMap] = {
    "llama": ArchMap("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": ArchMap("Qwen2ForCausalLM", "qwen2", permute_qk=False),
    # first-generation Qwen: Qwen2's decoder with one attn_qkv tensor (first_generation.py)
    "qwen": ArchMap("Qwen2ForCausalLM", "qwen2", permute_qk=False, config_fields=first_generation.qwen_config_fields,
                    fused_rows=chatglm.fused_rows),
    "baichuan": ArchMap("BaichuanForCausalLM", "baichuan", permute_qk=True,
                        config_fields=first_generation.baichuan_config_fields),
    "qwen3": ArchMap("Qwen3ForCausalLM", "qwen3", permute_qk=False),
    # Qwen-VL language models, run text-only with their multimodal RoPE read as plain RoPE (qwen_vl.py)
    qwen_vl.QWEN2VL: ArchMap("Qwen2ForCausalLM", "qwen2", permute_qk=False, config_fields=qwen_vl.qwen2vl_config_fields),
    qwen_vl.QWEN3VL: ArchMap("Qwen3ForCausalLM", "qwen3", permute_qk=False, config_fields=qwen_vl.qwen3vl_config_fields),
    "qwen2moe": ArchMap("Qwen2MoeForCausalLM", "qwen2_moe", permute_qk=False),
    "qwen3moe": ArchMap("Qwen3MoeForCausalLM", "qwen3_moe", permute_qk=False),
    "gemma3": ArchMap("Gemma3ForCausalLM", "gemma3_text", permute_qk=False, norm_offset=gemma3.NORM_OFFSET,
                      layer_names=gemma3.LAYER_NAMES, config_fields=gemma3.gemma3_config_fields),
    "gemma": ArchMap("GemmaForCausalLM", "gemma", permute_qk=False, norm_offset=gemma3.NORM_OFFSET,
                     config_fields=gemma3.gemma_config_fields),
    "gemma2": ArchMap("Gemma2ForCausalLM", "gemma2", permute_qk=False, norm_offset=gemma3.NORM_OFFSET,
                      layer_names=gemma3.LAYER_NAMES, config_fields=gemma3.gemma2_config_fields),
    olmo.ARCH: ArchMap("OlmoForCausalLM", "olmo", permute_qk=True, config_fields=olmo.olmo_config_fields),
    "olmo2": ArchMap("Olmo2ForCausalLM", "olmo2", permute_qk=False, layer_names=olmo2.LAYER_NAMES,
                     config_fields=olmo2.olmo2_config_fields),
    olmoe.ARCH: ArchMap("OlmoeForCausalLM", "olmoe", permute_qk=False, config_fields=olmoe.olmoe_config_fields),
    "exaone4": ArchMap("Exaone4ForCausalLM", "exaone4", permute_qk=False, layer_names=exaone4.LAYER_NAMES,
                       config_fields=exaone4.exaone4_config_fields),
    "smollm3": ArchMap("SmolLM3ForCausalLM", "smollm3", permute_qk=True, config_fields=smollm3.smollm3_config_fields),
    "seed_oss": ArchMap("SeedOssForCausalLM", "seed_oss", permute_qk=False, layer_names=seed_oss.LAYER_NAMES,
                        config_fields=seed_oss.seed_oss_config_fields),
    apertus.ARCH: ArchMap("ApertusForCausalLM", "apertus", permute_qk=False,
                          config_fields=apertus.apertus_config_fields),
    arcee.ARCH: ArchMap("ArceeForCausalLM", "arcee", permute_qk=True, config_fields=arcee.arcee_config_fields),
    hunyuan.ARCH: ArchMap("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense", permute_qk=False,
                          config_fields=hunyuan.hunyuan_config_fields),
    hunyuan_moe.ARCH: ArchMap("HunYuanMoEV1ForCausalLM", "hunyuan_v1_moe", permute_qk=False,
                              layer_names=hunyuan_moe.LAYER_NAMES, config_fields=hunyuan_moe.hunyuan_moe_config_fields),
    nemotron.ARCH: ArchMap("NemotronForCausalLM", "nemotron", permute_qk=False, norm_offset=nemotron.NORM_OFFSET,
                           config_fields=nemotron.nemotron_config_fields, partial_rotary=True),
    starcoder2.ARCH: ArchMap("Starcoder2ForCausalLM", "starcoder2", permute_qk=False, layer_names=starcoder2.LAYER_NAMES,
                             config_fields=starcoder2.starcoder2_config_fields),
    gpt2.GPT2: ArchMap("GPT2LMHeadModel", "gpt2", permute_qk=False, config_fields=gpt2.gpt2_config_fields,
                       fused_rows=chatglm.fused_rows, tensor_names=gpt2.TENSOR_NAMES),
    gpt2.STARCODER: ArchMap("GPTBigCodeForCausalLM", "gpt_bigcode", permute_qk=False, fused_rows=chatglm.fused_rows,
                            config_fields=gpt2.starcoder_config_fields, tensor_names=gpt2.TENSOR_NAMES),
    "granite": ArchMap("GraniteForCausalLM", "granite", permute_qk=True, config_fields=granite.granite_config_fields),
    "granitemoe": ArchMap("GraniteMoeForCausalLM", "granitemoe", permute_qk=True,
                          config_fields=granite.granitemoe_config_fields),
    phi2.ARCH: ArchMap("PhiForCausalLM", "phi", permute_qk=False, layer_names=phi2.LAYER_NAMES,
                       config_fields=phi2.phi2_config_fields, partial_rotary=True, fused_rows=chatglm.fused_rows),
    cohere.COMMAND_R: ArchMap("CohereForCausalLM", "cohere", permute_qk=False,
                              config_fields=cohere.command_r_config_fields),
    cohere.COHERE2: ArchMap("Cohere2ForCausalLM", "cohere2", permute_qk=False, config_fields=cohere.cohere2_config_fields),
    gptneox.ARCH: ArchMap("GPTNeoXForCausalLM", "gpt_neox", permute_qk=False, config_fields=gptneox.gptneox_config_fields,
                          partial_rotary=True, fused_rows=chatglm.fused_rows),
    falcon.ARCH: ArchMap("FalconForCausalLM", "falcon", permute_qk=False, config_fields=falcon.falcon_config_fields,
                         fused_rows=falcon.fused_rows),
    bloom.ARCH: ArchMap("BloomForCausalLM", "bloom", permute_qk=False, config_fields=bloom.bloom_config_fields,
                        fused_rows=chatglm.fused_rows, tensor_names=bloom.TENSOR_NAMES),
    stablelm.ARCH: ArchMap("StableLmForCausalLM", "stablelm", permute_qk=False,
                           config_fields=stablelm.stablelm_config_fields, partial_rotary=True,
                           fused_rows=chatglm.fused_rows),
    "phi3": ArchMap("Phi3ForCausalLM", "phi3", permute_qk=False, config_fields=phi3.phi3_config_fields,
                    partial_rotary=True, fused_rows=phi3.fused_rows, config_tensors=phi3.FACTOR_TENSORS),
    "chatglm": ArchMap("GlmForCausalLM", "glm", permute_qk=False, layer_names=chatglm.LAYER_NAMES,
                       config_fields=chatglm.chatglm_config_fields, partial_rotary=True, fused_rows=chatglm.fused_rows),
    "glm4": ArchMap("Glm4ForCausalLM", "glm4", permute_qk=False, layer_names=chatglm.GLM4_LAYER_NAMES,
                    config_fields=chatglm.glm4_config_fields, partial_rotary=True, fused_rows=chatglm.fused_rows),
    "deepseek2": ArchMap("DeepseekV2ForCausalLM", "deepseek_v2", permute_qk=False, layer_names=deepseek2.LAYER_NAMES,
                         config_fields=deepseek2.deepseek2_config_fields, layer_params=deepseek2.LAYER_PARAMS,
                         joined=((deepseek2.KV_B_PARTS, deepseek2.KV_B_MODULE, deepseek2.join_kv_b),),
                         latent_heads=True, appended_layers=True),
    "ernie4_5": ArchMap("Ernie4_5ForCausalLM", "ernie4_5", permute_qk=False, config_fields=ernie.ernie_config_fields),
    ernie.MOE_ARCH: ArchMap("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", permute_qk=False,
                            layer_names=ernie.MOE_LAYER_NAMES, config_fields=ernie.ernie_moe_config_fields,
                            layer_params=ernie.MOE_LAYER_PARAMS),
    gpt_oss.ARCH: ArchMap("GptOssForCausalLM", "gpt_oss", permute_qk=False, layer_names=gpt_oss.LAYER_NAMES,
                          config_fields=gpt_oss.gpt_oss_config_fields, layer_params=gpt_oss.LAYER_PARAMS),
    dots1.ARCH: ArchMap("Dots1ForCausalLM", "dots1", permute_qk=False, layer_names=dots1.LAYER_NAMES,
                        config_fields=dots1.dots1_config_fields, layer_params=dots1.LAYER_PARAMS),
    "glm4moe": ArchMap("Glm4MoeForCausalLM", "glm4_moe", permute_qk=False, layer_names=glm4moe.LAYER_NAMES,
                       config_fields=glm4moe.glm4moe_config_fields, partial_rotary=True,
                       layer_params=glm4moe.LAYER_PARAMS, appended_layers=True),
}
# llama.cpp writes Mixtral as "llama" with `llama.expert_count` experts (and llama's Q/K row order)
WITH_EXPERTS: dict[str, ArchMap] = {"llama": ArchMap("MixtralForCausalLM", "mixtral", permute_qk=True)}
_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16"}
LLAMA3_ROPE_FREQS = "rope_freqs.weight"
_BLOCK = re.compile(r"blk\.(\d{1,6})\.")


def gguf_arch(gf: GGUFFile) -> tuple[str, ArchMap]:
    """(`general.architecture`, its ArchMap: WITH_EXPERTS' for a file of that arch with experts); ModelLoadError
    naming it and listing the supported ones."""
    arch = gf.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{gf.name} has no general.architecture string; it is not a model GGUF file")
    found = ARCHITECTURES.get(arch)
    if found is None:
        raise ModelLoadError(f"{gf.name}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(sorted(ARCHITECTURES))}")
    if arch in WITH_EXPERTS and has_experts(gf, arch):
        return arch, WITH_EXPERTS[arch]
    return arch, found


def gguf_config_dict(gf: GGUFFile) -> dict[str, Any]:
    """The config.json-shaped dict of a GGUF model, for its architecture's parse_config.

    Sizes come from the `<arch>.*` metadata; vocab_size from the embedding's rows (checked
    against `<arch>.vocab_size` and the vocabulary); tie_word_embeddings from the absence of
    `output.weight`; torch_dtype from the matrices' float type (quantized files: float32).
    """
    arch, spec = gguf_arch(gf)

    def meta(key: str, default: Any = None, kind: type = int) -> Any:
        value = gf.get(f"{arch}.{key}", default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, kind)):
            if not (kind is float and isinstance(value, int) and not isinstance(value, bool)):
                raise ModelLoadError(f"{gf.name}: metadata {arch}.{key} is {value!r}; expected a single "
                                     f"{kind.__name__} (per-layer values are not supported)")
        return value

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    raw: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "max_position_embeddings": meta("context_length", 2048),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6, float),
        "rope_theta": meta("rope.freq_base", 10000.0, float),
        "vocab_size": vocab_rows(gf, meta("vocab_size")),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "hidden_act": "silu",
        "torch_dtype": _float_dtype(gf),
    }
    moe = spec.architecture in MOE_GRAPHS
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads") + (() if moe else ("intermediate_size",))
    missing = [k for k in required if raw[k] is None]
    if missing:
        raise ModelLoadError(f"{gf.name} lacks the {arch} metadata for {', '.join(missing)}; it is incomplete")
    head_dim = None if spec.latent_heads else meta("attention.key_length")
    if head_dim is not None:
        if meta("attention.value_length", head_dim) != head_dim:
            raise ModelLoadError(f"{gf.name}: key_length {head_dim} differs from value_length; not supported")
        raw["head_dim"] = head_dim
    head_dim = head_dim or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0)
    rope_dims = meta("rope.dimension_count")
    if rope_dims is not None and head_dim and rope_dims != head_dim and not (spec.partial_rotary or spec.latent_heads):
        raise ModelLoadError(f"{gf.name}: rope over {rope_dims} of {head_dim} head features (partial rotary) is "
                             "not supported for GGUF files")
    for key, value in (("bos_token_id", gf.get("tokenizer.ggml.bos_token_id")),
                       ("eos_token_id", gf.get("tokenizer.ggml.eos_token_id"))):
        if isinstance(value, int) and not isinstance(value, bool):
            raw[key] = value
    scaling = _rope_scaling(gf, arch, head_dim, raw["rope_theta"])
    if scaling is not None:
        raw["rope_scaling"] = scaling
    if arch == "llama" and "blk.0.attn_q.bias" in gf.tensors:
        raw["attention_bias"] = True
    if spec.config_fields is not None:
        raw.update(spec.config_fields(gf, raw))
    if moe:
        raw.update(moe_config_fields(gf, arch, spec.architecture, hidden, raw["num_hidden_layers"],
                                     raw["intermediate_size"]))
    return raw


def vocab_rows(gf: GGUFFile, declared: int | None) -> int:
    """Rows of `token_embd.weight`: the model's vocab_size. Refuses a vocabulary larger than the embedding."""
    embd = gf.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise ModelLoadError(f"{gf.name} has no 2-D token_embd.weight; it is not a complete model")
    rows = int(embd.shape[1])  # ggml order: (hidden, rows)
    if declared is not None and declared != rows:
        raise ModelLoadError(f"{gf.name}: vocab_size metadata {declared} differs from token_embd.weight's {rows} rows")
    tokens = gf.reader.fields.get("tokenizer.ggml.tokens")
    count = len(tokens.data) if tokens is not None else 0
    if count > rows:
        raise ModelLoadError(f"{gf.name}: the vocabulary has {count} tokens but the embedding only {rows} rows; "
                             "the file is corrupt or mismatched")
    return rows


def _float_dtype(gf: GGUFFile) -> str:
    """The checkpoint dtype --dtype auto starts from: the embedding's float type, else float32."""
    embd = gf.tensors.get("token_embd.weight")
    return _DTYPE_NAMES.get(embd.tensor_type.name, "float32") if embd is not None else "float32"


def _rope_scaling(gf: GGUFFile, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    """rope_scaling for the metadata's `<arch>.rope.scaling.*`, or llama3's from its rope_freqs tensor."""
    kind = gf.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none") and LLAMA3_ROPE_FREQS not in gf.tensors:
        return None
    if kind == "linear":
        factor = gf.get(f"{arch}.rope.scaling.factor")
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ModelLoadError(f"{gf.name}: rope scaling 'linear' needs a positive {arch}.rope.scaling.factor")
        return {"rope_type": "linear", "factor": float(factor)}
    if kind in (None, "none"):
        return _llama3_scaling(gf, head_dim, theta)
    if kind == "yarn":
        return _yarn_scaling(gf, arch)
    raise ModelLoadError(f"{gf.name}: rope scaling {kind!r} is not supported for GGUF files; supported: none, linear, "
                         "yarn, llama3 (rope_freqs)")


def _yarn_scaling(gf: GGUFFile, arch: str) -> dict[str, Any]:
    """transformers' yarn rope_scaling for `<arch>.rope.scaling.*`: factor, the original context and the ramp's
    betas (llama.cpp's defaults 32 / 1 where absent); cos and sin carry YaRN's 1 + 0.1 ln(factor) in both."""
    values = {}
    for key, field_name, default in (("factor", "factor", None),
                                     ("original_context_length", "original_max_position_embeddings", None),
                                     ("yarn_beta_fast", "beta_fast", 32.0), ("yarn_beta_slow", "beta_slow", 1.0)):
        value = gf.get(f"{arch}.rope.scaling.{key}", default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
            raise ModelLoadError(f"{gf.name}: rope scaling 'yarn' needs a positive {arch}.rope.scaling.{key} "
                                 f"(it is {value!r})")
        values[field_name] = value
    for key in ("yarn_ext_factor", "yarn_attn_factor"):
        if gf.get(f"{arch}.rope.scaling.{key}") is not None:
            raise ModelLoadError(f"{gf.name}: {arch}.rope.scaling.{key} is not supported; flashllm runs yarn with "
                                 "llama.cpp's default ramp and attention factor")
    return {"rope_type": "yarn", "factor": float(values["factor"]), "beta_fast": float(values["beta_fast"]),
            "beta_slow": float(values["beta_slow"]),
            "original_max_position_embeddings": int(values["original_max_position_embeddings"])}


# The llama3 rope settings Meta's 3.x models ship; a rope_freqs tensor is matched against these.
_LLAMA3_CANDIDATES = ({"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},)


def _llama3_scaling(gf: GGUFFile, head_dim: int, theta: float) -> dict[str, Any]:
    """llama3 rope_scaling whose per-frequency divisors equal the file's rope_freqs tensor."""
    from flashllm.ops.rope_cache import rope_inv_freq

    tensor = gf.tensors[LLAMA3_ROPE_FREQS]
    factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if tensor.tensor_type.name != "F32" or factors.size != head_dim // 2:
        raise ModelLoadError(f"{gf.name}: rope_freqs.weight must be F32 with {head_dim // 2} values")
    plain, _ = rope_inv_freq(head_dim, theta, None)
    for candidate in _LLAMA3_CANDIDATES:
        scaling = {"rope_type": "llama3", "factor": float(factors.max()), **candidate}
        scaled, _ = rope_inv_freq(head_dim, theta, scaling)
        if np.allclose((plain / scaled).numpy(), factors, rtol=1e-4, atol=1e-6):
            return scaling
    raise ModelLoadError(f"{gf.name}: its rope_freqs.weight factors match no llama3 rope setting flashllm knows "
                         f"({_LLAMA3_CANDIDATES}); not supported")
