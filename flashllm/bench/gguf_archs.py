"""How each transformers architecture maps onto a llama.cpp GGUF arch for flashllm/bench/gguf_export.py: the arch
name, the rope layout and each architecture's own names, checks, metadata and tensor transforms."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashllm.bench import (
    gguf_apertus,
    gguf_arcee,
    gguf_bloom,
    gguf_chatglm,
    gguf_cohere,
    gguf_deepseek,
    gguf_dots1,
    gguf_ernie,
    gguf_exaone4,
    gguf_falcon,
    gguf_first_generation,
    gguf_gemma3,
    gguf_glm4moe,
    gguf_gpt2,
    gguf_gpt_oss,
    gguf_gptneox,
    gguf_granite,
    gguf_hunyuan_moe,
    gguf_moe,
    gguf_nemotron,
    gguf_olmo,
    gguf_olmoe,
    gguf_phi2,
    gguf_phi3,
    gguf_qwen_vl,
    gguf_seed_oss,
    gguf_smollm3,
    gguf_stablelm,
    gguf_starcoder2,
)
from flashllm.models.gguf.olmo2 import LAYER_NAMES as OLMO2_LAYER_NAMES


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one HF architecture maps onto llama.cpp: its GGUF arch name and rope layout.

    permute_qk: llama.cpp runs this arch with interleaved ("normal") rope, while HF rotates the
    two halves of each head (neox), so Q and K rows must be reordered; qwen2 runs neox in both.
    norm_shift: added to every `*norm.weight` (Gemma's RMSNorm multiplies by 1 + w, llama.cpp's by the weight).
    layer_names: HF module -> GGUF layer part, where this arch's differ from Llama's.
    check: (config) -> None, raising ValueError for what llama.cpp would run differently; in place of the
    generic refusal of sliding windows.
    add_hparams: (GGUFWriter, config) -> None, the arch's own metadata.
    rope_types: rope types add_hparams / extra_tensors write themselves (LongRoPE's factor tensors).
    extra_tensors: (config) -> {GGUF name: F32 array} written beside the weights.
    transform: (the checkpoint's (HF name, shape, loader) entries, config) -> the entries to write, where the
    converter stacks, splits or renames tensors (MoE experts, DeepSeek's latent up-projection).
    latent_heads: add_hparams writes head_count_kv, key / value lengths and the rope dimensions (MLA's), not the
    generic ones.
    feed_forward_length: (config) -> the `feed_forward_length` the converter writes, where it is not the config's
    intermediate_size (QWen's twice the projections' width).
    checkpoint_hparams: (GGUFWriter, model directory, config) -> None, metadata the converter takes from checkpoint
    tensors (Apertus' per-layer xIELU scalars); raises ValueError for a checkpoint lacking them.
    """

    gguf_arch: str
    permute_qk: bool
    norm_shift: float = 0.0
    layer_names: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[Any], None] | None = None
    add_hparams: Callable[[Any, Any], None] | None = None
    rope_types: tuple[str, ...] = ()
    extra_tensors: Callable[[Any], dict[str, np.ndarray]] | None = None
    transform: Callable[[list[Any], Any], Iterator[Any]] | None = None
    latent_heads: bool = False
    feed_forward_length: Callable[[Any], int] | None = None
    checkpoint_hparams: Callable[[Any, Any, Any], None] | None = None


ARCHS: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("llama", permute_qk=True),
    "Qwen2ForCausalLM": ArchSpec("qwen2", permute_qk=False),
    gguf_first_generation.QWEN: ArchSpec("qwen", permute_qk=False, layer_names=gguf_first_generation.QWEN_LAYER_NAMES,
                                         check=gguf_first_generation.check_qwen,
                                         transform=gguf_first_generation.qwen_names,
                                         feed_forward_length=gguf_first_generation.qwen_feed_forward_length),
    gguf_first_generation.BAICHUAN: ArchSpec("baichuan", permute_qk=True, check=gguf_first_generation.check_baichuan,
                                             transform=gguf_first_generation.split_w_pack),
    "Qwen3ForCausalLM": ArchSpec("qwen3", permute_qk=False),
    **{architecture: ArchSpec("qwen2vl", permute_qk=False, check=gguf_qwen_vl.check_qwen2vl,
                              add_hparams=gguf_qwen_vl.add_hparams, transform=gguf_qwen_vl.language_model)
       for architecture in gguf_qwen_vl.QWEN2VL_ARCHITECTURES},
    gguf_qwen_vl.QWEN3VL_ARCHITECTURE: ArchSpec("qwen3vl", permute_qk=False, check=gguf_qwen_vl.check_qwen3vl,
                                                add_hparams=gguf_qwen_vl.add_hparams,
                                                transform=gguf_qwen_vl.language_model),
    gguf_olmo.ARCHITECTURE: ArchSpec("olmo", permute_qk=True, check=gguf_olmo.check, add_hparams=gguf_olmo.add_hparams),
    "Olmo2ForCausalLM": ArchSpec("olmo2", permute_qk=False,
                                 layer_names={module: part for part, module in OLMO2_LAYER_NAMES.items()}),
    gguf_exaone4.ARCHITECTURE: ArchSpec("exaone4", permute_qk=False, layer_names=gguf_exaone4.LAYER_NAMES,
                                        check=gguf_exaone4.check, add_hparams=gguf_exaone4.add_hparams),
    gguf_smollm3.ARCHITECTURE: ArchSpec("smollm3", permute_qk=True, check=gguf_smollm3.check),
    gguf_seed_oss.ARCHITECTURE: ArchSpec("seed_oss", permute_qk=False, layer_names=gguf_seed_oss.LAYER_NAMES,
                                         check=gguf_seed_oss.check),
    gguf_starcoder2.ARCHITECTURE: ArchSpec("starcoder2", permute_qk=False, layer_names=gguf_starcoder2.LAYER_NAMES,
                                           check=gguf_starcoder2.check, add_hparams=gguf_starcoder2.add_hparams),
    gguf_apertus.ARCHITECTURE: ArchSpec("apertus", permute_qk=False, layer_names=gguf_apertus.LAYER_NAMES,
                                        check=gguf_apertus.check, transform=gguf_apertus.transform,
                                        checkpoint_hparams=gguf_apertus.checkpoint_hparams),
    gguf_arcee.ARCHITECTURE: ArchSpec("arcee", permute_qk=True, check=gguf_arcee.check, add_hparams=gguf_arcee.add_hparams,
                                      rope_types=("yarn",)),
    # Hunyuan dense: its query / key norms under llama.cpp's names; the NTK alpha is already in rope_theta
    "HunYuanDenseV1ForCausalLM": ArchSpec("hunyuan-dense", permute_qk=False,
                                          layer_names={"self_attn.query_layernorm": "attn_q_norm",
                                                       "self_attn.key_layernorm": "attn_k_norm"}),
    gguf_hunyuan_moe.ARCHITECTURE: ArchSpec("hunyuan-moe", permute_qk=False, layer_names=gguf_hunyuan_moe.LAYER_NAMES,
                                            check=gguf_hunyuan_moe.check, add_hparams=gguf_hunyuan_moe.add_hparams,
                                            transform=gguf_moe.stack_experts),
    gguf_nemotron.ARCHITECTURE: ArchSpec("nemotron", permute_qk=False, norm_shift=gguf_nemotron.NORM_SHIFT,
                                         add_hparams=gguf_nemotron.add_hparams),
    "Qwen2MoeForCausalLM": ArchSpec("qwen2moe", permute_qk=False, transform=gguf_moe.stack_experts),
    "Qwen3MoeForCausalLM": ArchSpec("qwen3moe", permute_qk=False, transform=gguf_moe.stack_experts),
    "MixtralForCausalLM": ArchSpec("llama", permute_qk=True, transform=gguf_moe.stack_experts),
    gguf_olmoe.ARCHITECTURE: ArchSpec("olmoe", permute_qk=False, check=gguf_olmoe.check,
                                      add_hparams=gguf_olmoe.add_hparams, transform=gguf_moe.stack_experts),
    gguf_gemma3.ARCHITECTURE: ArchSpec("gemma3", permute_qk=False, norm_shift=gguf_gemma3.NORM_SHIFT,
                                       layer_names=gguf_gemma3.LAYER_NAMES),
    "GemmaForCausalLM": ArchSpec("gemma", permute_qk=False, norm_shift=gguf_gemma3.NORM_SHIFT),
    gguf_gemma3.GEMMA2_ARCHITECTURE: ArchSpec("gemma2", permute_qk=False, norm_shift=gguf_gemma3.NORM_SHIFT,
                                              layer_names=gguf_gemma3.LAYER_NAMES, check=gguf_gemma3.check_gemma2,
                                              add_hparams=gguf_gemma3.add_gemma2_hparams),
    gguf_granite.ARCHITECTURE: ArchSpec("granite", permute_qk=True, add_hparams=gguf_granite.add_hparams),
    gguf_granite.MOE_ARCHITECTURE: ArchSpec("granitemoe", permute_qk=True,
                                            add_hparams=gguf_granite.add_moe_hparams,
                                            transform=gguf_granite.split_experts),
    gguf_phi2.ARCHITECTURE: ArchSpec("phi2", permute_qk=False, layer_names=gguf_phi2.LAYER_NAMES, check=gguf_phi2.check,
                                     add_hparams=gguf_phi2.add_hparams, transform=gguf_phi2.transform),
    gguf_cohere.ARCHITECTURE: ArchSpec("command-r", permute_qk=False, check=gguf_cohere.check,
                                       add_hparams=gguf_cohere.add_hparams),
    gguf_cohere.COHERE2_ARCHITECTURE: ArchSpec("cohere2", permute_qk=False, check=gguf_cohere.check_cohere2,
                                               add_hparams=gguf_cohere.add_cohere2_hparams),
    gguf_gpt2.GPT2_ARCHITECTURE: ArchSpec("gpt2", permute_qk=False, layer_names=gguf_gpt2.LAYER_NAMES,
                                          check=gguf_gpt2.check_gpt2, add_hparams=gguf_gpt2.add_hparams,
                                          transform=gguf_gpt2.transform),
    gguf_gpt2.BIGCODE_ARCHITECTURE: ArchSpec("starcoder", permute_qk=False, layer_names=gguf_gpt2.LAYER_NAMES,
                                             check=gguf_gpt2.check_bigcode, add_hparams=gguf_gpt2.add_hparams,
                                             transform=gguf_gpt2.transform_bigcode),
    gguf_gptneox.ARCHITECTURE: ArchSpec("gptneox", permute_qk=False, layer_names=gguf_gptneox.LAYER_NAMES,
                                        check=gguf_gptneox.check, add_hparams=gguf_gptneox.add_hparams,
                                        transform=gguf_gptneox.transform),
    gguf_falcon.ARCHITECTURE: ArchSpec("falcon", permute_qk=False, layer_names=gguf_falcon.LAYER_NAMES,
                                       check=gguf_falcon.check, add_hparams=gguf_falcon.add_hparams,
                                       transform=gguf_falcon.transform),
    gguf_bloom.ARCHITECTURE: ArchSpec("bloom", permute_qk=False, layer_names=gguf_bloom.LAYER_NAMES,
                                      add_hparams=gguf_bloom.add_hparams, transform=gguf_bloom.transform),
    gguf_stablelm.ARCHITECTURE: ArchSpec("stablelm", permute_qk=False, check=gguf_stablelm.check,
                                         add_hparams=gguf_stablelm.add_hparams, transform=gguf_stablelm.transform),
    gguf_phi3.ARCHITECTURE: ArchSpec("phi3", permute_qk=False, layer_names=gguf_phi3.LAYER_NAMES,
                                     check=gguf_phi3.check, add_hparams=gguf_phi3.add_hparams,
                                     rope_types=gguf_phi3.ROPE_TYPES, extra_tensors=gguf_phi3.extra_tensors),
    gguf_chatglm.ARCHITECTURE: ArchSpec("chatglm", permute_qk=False, layer_names=gguf_chatglm.LAYER_NAMES,
                                        check=gguf_chatglm.check),
    gguf_chatglm.GLM4_ARCHITECTURE: ArchSpec("glm4", permute_qk=False, layer_names=gguf_chatglm.GLM4_LAYER_NAMES,
                                             check=gguf_chatglm.check),
    **{architecture: ArchSpec("deepseek2", permute_qk=False, layer_names=gguf_deepseek.LAYER_NAMES,
                              check=gguf_deepseek.check, add_hparams=gguf_deepseek.add_hparams, rope_types=("yarn",),
                              transform=gguf_deepseek.transform, latent_heads=True)
       for architecture in gguf_deepseek.ARCHITECTURES},
    gguf_ernie.ARCHITECTURE: ArchSpec("ernie4_5", permute_qk=False, check=gguf_ernie.check),
    gguf_ernie.MOE_ARCHITECTURE: ArchSpec("ernie4_5-moe", permute_qk=False, layer_names=gguf_ernie.MOE_LAYER_NAMES,
                                          check=gguf_ernie.check, add_hparams=gguf_ernie.add_hparams,
                                          transform=gguf_ernie.transform),
    gguf_gpt_oss.ARCHITECTURE: ArchSpec("gpt-oss", permute_qk=False, layer_names=gguf_gpt_oss.LAYER_NAMES,
                                        check=gguf_gpt_oss.check, add_hparams=gguf_gpt_oss.add_hparams,
                                        rope_types=("yarn",), transform=gguf_gpt_oss.transform),
    gguf_dots1.ARCHITECTURE: ArchSpec("dots1", permute_qk=False, layer_names=gguf_dots1.LAYER_NAMES,
                                      check=gguf_dots1.check, add_hparams=gguf_dots1.add_hparams,
                                      transform=gguf_dots1.transform),
    gguf_glm4moe.ARCHITECTURE: ArchSpec("glm4moe", permute_qk=False, layer_names=gguf_glm4moe.LAYER_NAMES,
                                        check=gguf_glm4moe.check, add_hparams=gguf_glm4moe.add_hparams,
                                        transform=gguf_glm4moe.transform),
}
