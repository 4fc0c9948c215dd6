"""EAGLE draft heads: one Llama decoder layer fed the target's hidden states and the next token's embedding.

EAGLE-1 (EagleHead) reads the target's final hidden state; EAGLE-3 (Eagle3Head) reads three of the target's
layers at once, fused by its fc, and predicts tokens of its own (smaller) vocabulary, mapped to the target's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import LMHead, VocabEmbedding, Vocabulary, target_vocabulary
from flashllm.models.layers.linear import QKVParallelLinear, ReplicatedLinear
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, LlamaDecoderLayer
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# checkpoint tensors of an EAGLE-1 head that load nowhere: its copy of the target's (frozen) embedding
_SHARED_WITH_TARGET = ("embed_tokens.weight",)


class EagleHead(CausalLM):
    """An EAGLE-1 head (Li et al., 2024) on its own small K/V cache.

    At position i it reads the target's final hidden state h_i (after the model's last norm: what the LM head
    reads) and the target's embedding of token t_{i+1}, and predicts the feature of position i + 1:
        x_i = fc(concat(emb(t_{i+1}), h_i))          # a (2H -> H) linear, with a bias where the checkpoint has one
        a_i = x_i + attn(x_i)                         # layer 0 has no input norm: x_i enters attention as is
        o_i = a_i + mlp(post_attention_layernorm(a_i))
        logits_i = lm_head(o_i)                       # the target's LM head, no norm in between
    o_i stands in for the target's h_{i+1} when the head drafts further. The checkpoint holds fc.* and
    layers.0.* (no input_layernorm); embedding and LM head are the target's (`vocabulary`: whole copies of
    them, where the target is split over tensor-parallel ranks). It runs whole on one rank.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, *, target: Any = None, fc_bias: bool = True,
                 vocabulary: Vocabulary | None = None) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        if tp_size != 1:
            raise ValueError("an EAGLE head runs whole on one rank (the driver, beside its shard of the target)")
        embed, head = target_vocabulary(target, vocabulary)
        if embed is None or head is None:
            raise ValueError(f"an EAGLE head needs the target's model.embed_tokens and lm_head; "
                             f"{type(target).__name__} has {'neither' if embed is head else 'only one'}")
        h = config.hidden_size
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling, ops, device)
        self.fc = ReplicatedLinear(2 * h, h, fc_bias, ops, dtype, device)
        layer = LlamaDecoderLayer(config, 0, self.rotary_emb, ops, dtype, device, config.attention_bias,
                                  config.attention_bias)
        layer.input_layernorm = None  # EAGLE-1's layer 0 feeds fc's output to attention unnormalized
        self.layers = nn.ModuleList([layer])
        # held in a tuple, so the target's modules stay out of this module's parameters (loaded once, by the target)
        self._io: tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]] = (embed, head)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """The head's config.json: a Llama config (EAGLE-1 ships one with num_hidden_layers 1)."""
        return parse_llama_config(raw, source)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata, previous_hidden: Tensor | None = None) -> Tensor:
        """input_ids (T,) the tokens t_{i+1}, positions (T,) the positions i, previous_hidden (T, hidden) h_i in
        the model dtype; kv_caches [(k_cache, v_cache)] (num_blocks, block_size, kv_heads, head_dim), written at
        slot_mapping -> o_i (T, hidden)."""
        if previous_hidden is None or previous_hidden.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(f"the EAGLE head needs previous_hidden of shape ({input_ids.shape[0]}, "
                             f"{self.config.hidden_size}): the target's final hidden state per token")
        layer = self.layers[0]
        x = self.fc(torch.cat((self._io[0](input_ids), previous_hidden), dim=-1))
        attended = layer.self_attn(positions, x, kv_caches[0], attn_metadata)
        hidden, residual = layer.post_attention_layernorm(attended, x)
        return layer.mlp(hidden) + residual

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """o (N, hidden) -> logits (N, vocab_size) through the target's LM head, in the model dtype."""
        return self._io[1](hidden)

    def drafting_head(self) -> tuple[Callable[[Tensor], Tensor] | None, LMHead]:
        """(norm, head) with compute_logits(o) = head(o) (no norm): the target's LM head."""
        return None, self._io[1]

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(1 layer, num_kv_heads, head_dim): the head's own K/V cache."""
        attn = self.layers[0].self_attn
        return 1, attn.num_kv_heads, attn.head_dim


class Eagle3Head(CausalLM):
    """An EAGLE-3 head (Li et al., 2025) on its own small K/V cache.

    The target hands over, per position i, the residual stream entering three of its layers (HiddenTaps; by
    default layers 2, L // 2 and L - 3 of L, or the head config's `eagle_aux_hidden_state_layer_ids`); fc fuses
    them into g_i = fc(concat(a_i, b_i, c_i)) (3 x target hidden -> hidden). With e = emb(t_{i+1}):
        x = concat(input_layernorm(e), hidden_norm(g_i))           # 2 x hidden: what q, k and v are made from
        r = attn(x) + g_i                                          # + hidden_norm(g_i) with norm_before_residual
        o_i = r + mlp(post_attention_layernorm(r))
        logits_i = lm_head(norm(o_i))                              # the head's own vocabulary of draft_vocab_size
    o_i (before the final norm) stands in for g_{i+1} when the head drafts further. A draft id d is the target's
    token d + d2t[d] (the checkpoint's map; the identity when the head keeps the target's vocabulary). The
    checkpoint holds fc.*, midlayer.* (or layers.0.*), norm.*, lm_head.* and d2t; embed_tokens where the head
    has its own, else the target's is used. It runs whole on one rank."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = EagleHead.packed_modules_mapping
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, *, layout: Eagle3Layout | None = None) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        if tp_size != 1 or layout is None:
            raise ValueError("an EAGLE-3 head runs on one rank, built by load_eagle_head")
        h = config.hidden_size
        self.norm_before_residual = layout.norm_before_residual
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rotary_dim, layout.max_position, config.rope_theta,
                                          config.rope_scaling, ops, device)
        self.fc = ReplicatedLinear(3 * layout.target_hidden_size, h, layout.fc_bias, ops, dtype, device)
        layer = LlamaDecoderLayer(config, 0, self.rotary_emb, ops, dtype, device, config.attention_bias,
                                  config.attention_bias)
        attn = layer.self_attn
        # q, k and v read the normed embedding and the normed fused feature side by side
        attn.qkv_proj = QKVParallelLinear(2 * h, attn.head_dim, attn.num_heads, attn.num_kv_heads,
                                          config.attention_bias, ops, dtype, device)
        layer.hidden_norm = RMSNorm(h, config.rms_norm_eps, ops, dtype, device)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, config.rms_norm_eps, ops, dtype, device)
        self.lm_head = LMHead(layout.draft_vocab_size, h, ops, dtype, device)
        self.embed_tokens = VocabEmbedding(config.vocab_size, h, dtype, device) if layout.own_embedding else None
        # draft id -> the target's token id (filled from d2t after loading)
        self.register_buffer("draft_to_target", torch.arange(layout.draft_vocab_size, device=device), persistent=False)
        # held in a tuple, so the target's modules stay out of this module's parameters
        self._target: tuple[Callable[[Tensor], Tensor], HiddenTaps] = (layout.target_embedding, layout.taps)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """The head's config.json: a Llama config of one decoder layer."""
        return parse_llama_config(raw, source)

    def target_features(self, hidden: Tensor) -> Tensor:
        """The step the target just ran (final hidden states `hidden` (T, H), unused) -> g (T, hidden): fc of its
        tapped layers' streams, what the head reads per position."""
        states = self._target[1].states
        if len(states) != 3 or states[0].shape[0] != hidden.shape[0]:
            raise RuntimeError(f"the target's forward kept {len(states)} tapped hidden states for "
                               f"{hidden.shape[0]} rows; the EAGLE-3 head needs its 3 layers' (a fused decoder "
                               "stack must keep the taps as run_decoder_stack does)")
        return self.fc(torch.cat(states, dim=-1))

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata, previous_hidden: Tensor | None = None) -> Tensor:
        """input_ids (T,) the tokens t_{i+1}, positions (T,) the positions i, previous_hidden (T, hidden) g_i
        (target_features') or the head's own previous o; kv_caches [(k_cache, v_cache)] -> o_i (T, hidden)."""
        if previous_hidden is None or previous_hidden.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(f"the EAGLE-3 head needs previous_hidden of shape ({input_ids.shape[0]}, "
                             f"{self.config.hidden_size}): the fused target features per token")
        layer = self.layers[0]
        embed = self.embed_tokens if self.embed_tokens is not None else self._target[0]
        normed = layer.hidden_norm(previous_hidden)
        x = torch.cat((layer.input_layernorm(embed(input_ids)), normed), dim=-1)
        attended = layer.self_attn(positions, x, kv_caches[0], attn_metadata)
        hidden, residual = layer.post_attention_layernorm(
            attended, normed if self.norm_before_residual else previous_hidden)
        return layer.mlp(hidden) + residual

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """o (N, hidden) -> logits (N, draft_vocab_size) over the head's vocabulary (see draft_to_target)."""
        return self.lm_head(self.norm(hidden))

    def drafting_head(self) -> tuple[Callable[[Tensor], Tensor] | None, LMHead]:
        """(norm, head) with compute_logits(o) = head(norm(o))."""
        return self.norm, self.lm_head

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(1 layer, num_kv_heads, head_dim): the head's own K/V cache."""
        attn = self.layers[0].self_attn
        return 1, attn.num_kv_heads, attn.head_dim


@dataclass(frozen=True)
class Eagle3Layout:
    """What an EAGLE-3 head's modules depend on beyond its Llama config, read from config.json, the
    checkpoint's tensor names and the target."""

    target_hidden_size: int
    draft_vocab_size: int
    max_position: int  # the longer of the head's and the target's (the head drafts at the target's positions)
    own_embedding: bool
    fc_bias: bool
    norm_before_residual: bool
    target_embedding: Callable[[Tensor], Tensor]
    taps: HiddenTaps


def is_eagle3(raw: dict[str, Any], names: set[str]) -> bool:
    """Whether a head directory (config.json's dict, its tensor names) is laid out as EAGLE-3 publishes heads."""
    return (any("Eagle3" in str(a) for a in raw.get("architectures") or ())
            or "draft_vocab_size" in raw or "eagle_aux_hidden_state_layer_ids" in raw
            or "d2t" in names or any(n.startswith("midlayer.") for n in names))


def reads_from_target(head_dir: str | Path) -> tuple[bool, bool]:
    """Which of the target's (embedding, LM head) the head in head_dir reads: an EAGLE-1 head both, an EAGLE-3
    head its embedding unless it has one of its own. Reads config.json and the safetensors headers only;
    ModelLoadError (one line) where they cannot be read."""
    from flashllm.lora.merge import checkpoint_headers
    from flashllm.models.loader import safetensors_files

    head_dir = Path(head_dir)
    raw = _read_config(head_dir)
    names = {name.removeprefix("model.") for name in checkpoint_headers(safetensors_files(head_dir))[0]}
    if is_eagle3(raw, names):
        return not has_own_embedding(names), False
    return True, True


def has_own_embedding(names: set[str] | dict[str, Any]) -> bool:
    """Whether an EAGLE-3 head's tensors (names without a "model." prefix) hold an embedding of its own; one
    without reads the target's."""
    return "embed_tokens.weight" in names


def default_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head reads when its config names none: an early, a middle and a late one."""
    return 2, num_layers // 2, num_layers - 3


def _read_config(head_dir: Path) -> dict[str, Any]:
    import json

    source = str(head_dir / "config.json")
    try:
        raw = json.loads((head_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{source}: cannot read the EAGLE head's config ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: expected a JSON object")
    return raw


def load_eagle_head(head_dir: str | Path, target: Any, target_hidden_size: int, target_vocab_size: int, ops: Any,
                    dtype: torch.dtype, device: torch.device, quant: Any = None,
                    version: int | None = None, vocabulary: Vocabulary | None = None) -> EagleHead | Eagle3Head:
    """The EAGLE head in head_dir (config.json + safetensors) beside the loaded `target`: an EAGLE-3 head when
    the directory is laid out as one (is_eagle3), else an EAGLE-1 head. version (1 or 3): the layout asked for;
    None takes either. vocabulary: the (embedding, LM head) the head shares, where not the target's own (whole
    copies of a tensor-parallel target's).

    ModelLoadError (one line) when the head does not fit the target (hidden size, vocabulary, tapped layers),
    is not of the version asked for, or its weights are not such a head's."""
    from flashllm.lora.merge import checkpoint_headers
    from flashllm.models.loader import load_selected_weights, safetensors_files

    head_dir = Path(head_dir)
    source = str(head_dir / "config.json")
    raw = _read_config(head_dir)
    files = safetensors_files(head_dir)
    shapes = checkpoint_headers(files)[0]
    names = set(shapes)
    if is_eagle3(raw, names):
        if version == 1:
            raise ModelLoadError(f"{head_dir} is an EAGLE-3 head: use --speculate_method eagle3 (or eagle)")
        return _load_eagle3(head_dir, raw, files, shapes, target, target_hidden_size, target_vocab_size, ops,
                            dtype, torch.device(device), quant, vocabulary)
    if version == 3:
        raise ModelLoadError(f"{head_dir} is an EAGLE-1 head (no d2t, midlayer.* or EAGLE-3 config fields): "
                             "use --speculate_method eagle")
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **raw}  # EAGLE configs may omit them
    config = parse_llama_config(raw, source)
    _check_fits(head_dir, config.hidden_size, target_hidden_size, "hidden_size")
    _check_fits(head_dir, config.vocab_size, target_vocab_size, "vocab_size")
    if config.num_hidden_layers != 1:
        raise ModelLoadError(f"{source}: num_hidden_layers={config.num_hidden_layers}; an EAGLE-1 head has one "
                             "decoder layer")
    if "fc.weight" not in names:
        raise ModelLoadError(f"{head_dir}: no fc.weight tensor; an EAGLE-1 head holds fc.* and layers.0.*")
    head = EagleHead(config, ops, dtype, torch.device(device), target=target, fc_bias="fc.bias" in names,
                     vocabulary=vocabulary)
    load_selected_weights(head, head_dir, lambda name: None if name in _SHARED_WITH_TARGET else name, quant)
    return head


def _check_fits(head_dir: Path, value: int, wanted: int, field: str) -> None:
    if value != wanted:
        raise ModelLoadError(f"the EAGLE head {head_dir} has {field} {value}, the target {wanted}: use a head "
                             "trained for this model")


def _load_eagle3(head_dir: Path, raw: dict[str, Any], files: Any, shapes: dict[str, tuple[int, ...]],
                 target: Any, target_hidden_size: int, target_vocab_size: int, ops: Any, dtype: torch.dtype,
                 device: torch.device, quant: Any, vocabulary: Vocabulary | None = None) -> Eagle3Head:
    """load_eagle_head for an EAGLE-3 directory (its safetensors `files` and their tensors' `shapes`); on success
    the target's stack taps the head's layers."""
    from flashllm.models.loader import load_selected_weights

    source = str(head_dir / "config.json")
    local = {name.removeprefix("model."): name for name in shapes}  # the head's own name -> the checkpoint's
    stack = getattr(target, "model", None)
    embed = target_vocabulary(target, vocabulary)[0]
    if embed is None or not hasattr(stack, "hidden_taps"):
        raise ModelLoadError(f"an EAGLE-3 head reads hidden states from inside the target's decoder stack; "
                             f"{type(target).__name__}'s stack does not hand them over")
    eagle_config = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        raise ModelLoadError(f"{source}: eagle_config.use_aux_hidden_state is false; only heads that read the "
                             "target's three tapped layers are supported")
    config = parse_llama_config({**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                 "tie_word_embeddings": False}, source)
    if config.num_hidden_layers != 1:
        raise ModelLoadError(f"{source}: num_hidden_layers={config.num_hidden_layers}; only EAGLE-3 heads of one "
                             "decoder layer are supported")
    _check_fits(head_dir, int(raw.get("target_hidden_size") or config.hidden_size), target_hidden_size,
                "target_hidden_size" if raw.get("target_hidden_size") else "hidden_size")
    _check_fits(head_dir, config.vocab_size, target_vocab_size, "vocab_size")
    own_embedding = has_own_embedding(local)
    if not own_embedding and config.hidden_size != target_hidden_size:
        raise ModelLoadError(f"the EAGLE-3 head {head_dir} has hidden_size {config.hidden_size} and no "
                             f"embed_tokens of its own; the target's embedding is {target_hidden_size} wide")
    draft_vocab = raw.get("draft_vocab_size") or config.vocab_size
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 0 < draft_vocab <= config.vocab_size:
        raise ModelLoadError(f"{source}: draft_vocab_size must be an integer in 1..vocab_size "
                             f"({config.vocab_size}), got {draft_vocab!r}")
    taps = _tap_layers(raw, len(stack.layers), source)
    layout = Eagle3Layout(target_hidden_size, draft_vocab,
                          max(config.max_position_embeddings,
                              int(getattr(getattr(target, "config", None), "max_position_embeddings", 0) or 0)),
                          own_embedding, "fc.bias" in local, bool(raw.get("norm_before_residual", False)),
                          embed, HiddenTaps(taps))
    head = Eagle3Head(config, ops, dtype, device, layout=layout)
    load_selected_weights(head, head_dir, _eagle3_name, quant)
    head.draft_to_target.copy_(_draft_to_target(head_dir, files, shapes, local.get("d2t"), draft_vocab,
                                                target_vocab_size))
    stack.hidden_taps = layout.taps
    return head


def _tap_layers(raw: dict[str, Any], num_layers: int, source: str) -> tuple[int, ...]:
    """The three target layers (config's eagle_aux_hidden_state_layer_ids, else default_tap_layers), checked."""
    given = raw.get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(given) if isinstance(given, list | tuple) and given else default_tap_layers(num_layers)
    if (len(layers) != 3 or len(set(layers)) != 3
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers)):
        where = "eagle_aux_hidden_state_layer_ids" if given else f"the default layers for {num_layers} layers"
        raise ModelLoadError(f"{source}: {where} {list(layers)} are not three different layers of the target's "
                             f"0..{num_layers - 1}; set eagle_aux_hidden_state_layer_ids in the head's config.json")
    return tuple(sorted(layers))


def _eagle3_name(name: str) -> str | None:
    """A checkpoint tensor's name in Eagle3Head (None: not a parameter; d2t is read apart, t2d unused)."""
    name = name.removeprefix("model.")
    if name in ("d2t", "t2d"):
        return None
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def _draft_to_target(head_dir: Path, files: Any, shapes: dict[str, tuple[int, ...]], name: str | None,
                     draft_vocab: int, target_vocab: int) -> Tensor:
    """The checkpoint's d2t (tensor `name` in `files`) as absolute target ids (draft id d -> d + d2t[d]); the
    identity without one, which only a head of the target's whole vocabulary may lack."""
    from safetensors import safe_open

    ids = torch.arange(draft_vocab)
    if name is None:
        if draft_vocab != target_vocab:
            raise ModelLoadError(f"{head_dir}: no d2t tensor, so the head's {draft_vocab} draft tokens cannot be "
                                 f"mapped to the target's {target_vocab}")
        return ids
    if shapes[name] != (draft_vocab,):
        raise ModelLoadError(f"{head_dir}: d2t has shape {list(shapes[name])}, expected [{draft_vocab}] "
                             "(draft_vocab_size)")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            if name in f.keys():
                offsets = f.get_tensor(name)
                break
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise ModelLoadError(f"{head_dir}: d2t holds {offsets.dtype}; expected integer offsets")
    mapped = ids + offsets.to(torch.int64)
    if int(mapped.min()) < 0 or int(mapped.max()) >= target_vocab:
        raise ModelLoadError(f"{head_dir}: d2t maps draft tokens to ids outside the target's vocabulary "
                             f"0..{target_vocab - 1}")
    return mapped
