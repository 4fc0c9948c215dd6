"""The model contract: what the engine needs of an architecture, and what its parsed config must provide.

An architecture is a `CausalLM` subclass registered under the exact `architectures[0]` string of
its checkpoints' config.json, by flashllm (models/builtin.py) or by a plugin through the
`flashllm_register_models` hook; nothing under flashllm/ changes to add one. Its life in the engine:

1. `parse_config(raw, source)` (classmethod) turns config.json's dict into the architecture's own
   config type and refuses, with a one-line ModelLoadError, anything it cannot run. Every such
   config provides the generic fields of `flashllm.models.hf_config.HFModelConfig` (architecture,
   vocab_size, head_dim, max_position_embeddings, torch_dtype, quantization, bos_token_id,
   eos_token_id, tie_word_embeddings, raw, num_parameters); the shared loader checks those against
   sanity bounds before anything is allocated. The helpers in hf_config (positive_int, flag,
   token_ids, checkpoint_dtype, normalize_rope, parse_quantization_config, ...) and decoder_fields
   (decoder_sizes, checkpoint_fields: fields under transformers' names) do the field work.
2. `cls(config, ops, dtype, device, tp_rank=0, tp_size=1)` builds the layers: `ops` is the bound
   op table every layer calls (never a kernel picked inside the model), `dtype` the parameter
   dtype, and (tp_rank, tp_size) this rank's place among the tensor-parallel ranks; the layers in
   models/layers take them and shard themselves.
3. `load_weights(named tensors)` copies checkpoint tensors, named as in the checkpoint, into the
   parameters; `packed_modules_mapping` names the checkpoint projections fused into one parameter.
4. The runner sizes the paged KV cache from `kv_cache_shape()` (and, for a model whose layers keep a
   per-sequence recurrent state, one state slot per running sequence from `state_cache_shapes()`), then calls
   `forward(input_ids, positions, kv_caches, attn_metadata)` on flat token batches and
   `compute_logits(hidden)` on the rows it samples from.
5. `fusions()` declares the fused fast paths the model offers (records from
   flashllm.registry.fusions, by name); a backend consults it instead of isinstance checks on
   model classes or their private attributes, and runs the plain forward for what is not offered.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.hf_config import HFModelConfig, ModelLoadError
from flashllm.models.layers.attention import Attention
from flashllm.models.layers.linear import checkpoint_param
from flashllm.models.layers.prequantized import load_prequantized

if TYPE_CHECKING:
    from flashllm.ops.attention_metadata import AttentionMetadata


class CausalLM(nn.Module, ABC):
    """Base class of every flashllm architecture: a decoder-only LM over a paged KV cache.

    Subclasses implement parse_config, __init__ (calling super().__init__ first), forward,
    compute_logits and kv_cache_shape; load_weights and fusions have working defaults.
    """

    # flashllm parameter -> the checkpoint projections concatenated into it, in shard order; a
    # checkpoint tensor named `<prefix>.<shard>.<rest>` loads into `<prefix>.<packed>.<rest>` as
    # shard i (e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    # checkpoint tensors with no parameter, skipped on load (e.g. RoPE tables rebuilt from the config)
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ()
    # checkpoint module names -> the model's, applied to every checkpoint name before any other mapping
    renamed_modules: ClassVar[dict[str, str]] = {}
    # calibrated static int8/fp8 KV cache scales: `<module>.k_scale` / `.v_scale` load into the
    # Attention layer inside `<module>`; optional in a checkpoint
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()
    # cache tensors per layer the runner allocates, each (num_blocks, block_size, *kv_cache_shape()[1:]):
    # 2 = (k_cache, v_cache); 1 = one cache (MLA's latent + rope key per token, models/deepseek.py)
    kv_caches_per_layer: ClassVar[int] = 2
    # the LM head's checkpoint tensor, skipped when config.tie_word_embeddings (it repeats the embedding)
    lm_head_weight_name: ClassVar[str] = "lm_head.weight"

    # What the architecture declares for `flashllm devices` and docs/capabilities.md (models/catalog.py).
    # ops beyond a dense decoder's (rms_norm, rotary_embedding, silu_and_mul, write_kv_cache,
    # paged_attention, quant_matmul), e.g. ("fused_moe",)
    required_ops: ClassVar[tuple[str, ...]] = ()
    # paged_attention features beyond causal full attention, e.g. ("ALiBi (13B)",)
    attention_needs: ClassVar[tuple[str, ...]] = ()
    # --quant_type schemes its layers quantize at load; None: not declared
    weight_only_quant: ClassVar[tuple[str, ...] | None] = None
    # quant_method values of pre-quantized checkpoints parse_config accepts; (): refuses them; None: not declared
    prequantized_methods: ClassVar[tuple[str, ...] | None] = None
    # the checkpoint files its tokenizer is built from; None: not declared
    tokenizer_files: ClassVar[tuple[str, ...] | None] = None
    # the forward reads attn_metadata.prompt_lens (the runner fills it only then); set per instance
    reads_prompt_lens: bool = False

    @classmethod
    @abstractmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HFModelConfig:
        """config.json's dict -> this architecture's config (with the HFModelConfig fields), validated.

        `raw` has passed the generic checks (a JSON object whose architectures[0] is registered to
        this class); `source` names the file for error messages. Raise ModelLoadError (one line,
        saying which field is wrong and what was expected) on anything this model cannot run.
        """

    def __init__(self, config: HFModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        """Keep the config and this rank's place; subclasses build their layers after calling this."""
        super().__init__()
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank}, tp_size={tp_size}: expected tp_size >= 1 and 0 <= tp_rank < tp_size")
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size

    @abstractmethod
    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """Hidden states of a flat batch of T tokens from any number of sequences.

        input_ids (T,) int64; positions (T,) int64 (< max_position_embeddings); kv_caches: one tuple
        per layer, (k_cache, v_cache) each (num_blocks, block_size, num_kv_heads, head_dim), plus
        (k_scale, v_scale) for a quantized cache; attn_metadata: where each token's K/V goes
        (slot_mapping) and what it attends to. Writes the tokens' K/V into the caches and returns
        (T, hidden) in the model dtype.
        """

    def prefix_cache_salt(self, num_prompt_tokens: int) -> bytes:
        """Bytes that key a prompt's prefix-cache blocks beside its tokens (b"": tokens alone). A model whose
        KV for the same tokens depends on the prompt's length (QWen's dynamic NTK) returns what tells them apart."""
        return b""

    @abstractmethod
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) in the model dtype (this rank's full vocabulary)."""

    @abstractmethod
    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads on this rank, head_dim): the runner allocates one paged cache per layer."""

    def state_cache_shapes(self) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Per recurrent layer (Mamba, short convolution, linear attention), in layer order: the (shape, dtype)
        of each state tensor one sequence keeps on this rank, whatever its length. The runner allocates each as
        (num_state_slots, *shape) and passes them after the attention layers' caches: forward's kv_caches holds
        kv_cache_shape()[0] attention tuples, then one tuple per entry here; attn_metadata.state_slots says
        which slot is whose. Such a model is run without prefix caching, speculative decoding or device
        graphs (a state is not paged by position). The default: no recurrent layers."""
        return []

    def kv_cache_scales(self) -> list[tuple[Tensor | None, Tensor | None]]:
        """Each attention layer's calibrated (k_scale, v_scale) from the checkpoint, in layer order
        (None where it has none): what an int8/fp8 KV cache with --cachekv_int8_type static reads."""
        return [(m.k_scale, m.v_scale) for m in self.modules() if isinstance(m, Attention)]

    @classmethod
    def with_expert_parallel(cls, config: HFModelConfig) -> HFModelConfig:
        """--enable-expert-parallel: the config whose MoE layers hold whole experts per rank instead of every
        expert's slice of features. Architectures that implement it override this; the default refuses."""
        raise ModelLoadError(f"{config.architecture} does not implement expert parallelism; drop "
                             "--enable-expert-parallel (its MoE layers, if any, split every expert over the ranks)")

    def set_matrix_absorption(self, enabled: bool) -> None:
        """--mla_use_matrix_absorption: how a model with multi-head latent attention attends (models/deepseek.py);
        every other model has nothing to choose and ignores it."""
        return None

    def check_kv_block_size(self, block_size: int) -> None:
        """Raises ValueError (one line) where this model cannot attend over KV blocks of block_size tokens (Llama 4's
        chunked attention needs whole blocks per chunk); the engine calls it before the cache is sized. Every other
        model runs any block size."""
        return None

    def fusions(self) -> Mapping[str, Any]:
        """The fused fast paths this model offers backends: fusion name -> record (flashllm.registry.fusions).

        A backend runs a fused path only for a fusion declared here, and the model's forward for
        everything else. The default offers none, so a new architecture is always run correctly.
        """
        return {}

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy checkpoint-named tensors into the parameters through each parameter's weight_loader.

        Names map through `packed_modules_mapping`; GPTQ / AWQ tensors go to their layers. Returns
        the names of the parameters that were fully loaded (every shard of a fused one). Raises
        ModelLoadError naming the tensor on a shape mismatch, and listing the checkpoint tensors
        that match no parameter.
        """
        params = dict(self.named_parameters())
        seen: defaultdict[str, set[int | None]] = defaultdict(set)
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(self.skipped_weight_suffixes):
                continue
            if name == self.lm_head_weight_name and self.config.tie_word_embeddings:
                continue
            if name.endswith(self.kv_scale_suffixes):
                self._load_kv_scale(name, tensor)
                continue
            param_name, shard_id = self._param_target(name)
            param = params.get(param_name)
            if param is None and load_prequantized(self, param_name, tensor, shard_id):
                continue  # a GPTQ / AWQ layer's qweight / qzeros / scales / g_idx
            if param is None:  # a pre-quantized checkpoint's weight_scale / smooth_factor
                param = checkpoint_param(self, param_name)
            if param is None:
                unexpected.append(name)
                continue
            try:
                param.weight_loader(param, tensor, shard_id)
            except ValueError as exc:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {exc}") from None
            seen[param_name].add(shard_id)
        if unexpected:
            shown = ", ".join(unexpected[:5]) + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else "")
            raise ModelLoadError(
                f"checkpoint has {len(unexpected)} tensor(s) {type(self).__name__} does not know: "
                f"{shown}; the weights do not match config.json's architecture"
            )
        return {n for n, shards in seen.items() if len(shards) == self._num_shards(n)}

    def renamed(self, name: str) -> str:
        """A checkpoint tensor name with `renamed_modules` applied."""
        for old, new in self.renamed_modules.items():
            name = name.replace(old, new)
        return name

    def _param_target(self, name: str) -> tuple[str, int | None]:
        """Checkpoint tensor name -> (flashllm parameter name, shard index in its fused parameter), after
        `renamed_modules`."""
        name = self.renamed(name)
        for packed, shard_names in self.packed_modules_mapping.items():
            for shard_id, shard in enumerate(shard_names):
                if f".{shard}." in name:
                    return name.replace(f".{shard}.", f".{packed}."), shard_id
        return name, None

    def _num_shards(self, param_name: str) -> int:
        for packed, shard_names in self.packed_modules_mapping.items():
            if f".{packed}." in param_name:
                return len(shard_names)
        return 1

    def _load_kv_scale(self, name: str, tensor: Tensor) -> None:
        """`<module>.k_scale` (or v_scale) -> the one Attention layer inside `<module>`."""
        module_name, which = name.rsplit(".", 1)
        try:
            attns = [m for m in self.get_submodule(module_name).modules() if isinstance(m, Attention)]
            if len(attns) != 1:
                raise ValueError(f"{module_name} holds {len(attns)} attention layers; expected one")
            attns[0].load_kv_scale(which, tensor)
        except (AttributeError, ValueError) as exc:
            raise ModelLoadError(f"checkpoint tensor {name!r}: {exc}") from None
