"""Cohere GGUF files: `command-r` (Command R / R+, Aya Expanse) run as flashllm's CohereForCausalLM, `cohere2`
(Command R7B, Command A) as its Cohere2ForCausalLM.

What llama.cpp does with them (src/models/command-r.cpp and cohere2.cpp, their hparams and tensors in
src/llama-model.cpp, the converter's CommandR2Model and Cohere2Model): the parallel block, one LayerNorm without a bias
(`attn_norm`, eps `<arch>.attention.layer_norm_epsilon`, required) feeding both the attention and the gated SiLU MLP,
whose outputs add to the stream; `attn_q` / `attn_k` / `attn_v` / `attn_output` without biases (the loader creates
none), heads * head size = embedding length (its `attn_q` is square); "normal" rotary over adjacent feature pairs,
as transformers' Cohere rotates them, so the converter leaves Q/K rows as they are; the final bias-free LayerNorm and
the embedding as the LM head (the loader never reads an `output` tensor); the logits times `<arch>.logit_scale`
(required; 0 means unscaled). No rope_freqs tensor is read.

command-r: per-head LayerNorms `attn_q_norm` / `attn_k_norm` of shape (heads, head size), on the queries and keys
before RoPE, loaded exactly when the file has 64 layers or more (Command R+), and then required.
cohere2: sliding-window attention over `cohere2.attention.sliding_window` (required) on layer i when
i % N < N - 1, N the scalar `cohere2.attention.sliding_window_pattern` (4 where absent; an array is ignored, so 4;
N = 0 slides every layer), and RoPE only on those sliding layers, with `rope.freq_base` (the graph never uses a
`rope.freq_base_swa`); no q / k norms.
"""

from __future__ import annotations

import re
from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

COMMAND_R = "command-r"
COHERE2 = "cohere2"
QK_NORM_LAYERS = 64     # command-r: q / k norms from this block count on (llama.cpp's n_layer >= 64)
SLIDING_PATTERN = 4     # cohere2: llama.cpp's default set_swa_pattern(4): every 4th layer full
# tensors llama.cpp's command-r / cohere2 loaders never create: a file holding one fails its tensor count
_UNREAD = re.compile(r"output\.weight|rope_freqs\.weight|.*\.bias")
_QK_NORMS = ("attn_q_norm", "attn_k_norm")


def command_r_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The CohereForCausalLM config.json fields of a `command-r` file (module docstring)."""
    layers = raw["num_hidden_layers"]
    use_qk_norm = layers >= QK_NORM_LAYERS
    missing = [f"blk.{i}.{part}.weight" for i in range(layers) for part in _QK_NORMS
               if use_qk_norm and f"blk.{i}.{part}.weight" not in gf.tensors]
    if missing:
        raise ModelLoadError(f"{gf.name} lacks {missing[0]}, which llama.cpp's {COMMAND_R} loader requires of a file "
                             f"of {QK_NORM_LAYERS} layers or more; the file is not one it runs")
    return {**_cohere_fields(gf, COMMAND_R, raw, qk_norms=use_qk_norm), "use_qk_norm": use_qk_norm}


def cohere2_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Cohere2ForCausalLM config.json fields of a `cohere2` file (module docstring)."""
    window = gf.get(f"{COHERE2}.attention.sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{gf.name}: {COHERE2}.attention.sliding_window is {window!r}; llama.cpp's {COHERE2} "
                             "loader requires the sliding layers' positive window")
    swa_base = gf.get(f"{COHERE2}.rope.freq_base_swa")
    if swa_base is not None and swa_base != raw["rope_theta"]:
        raise ModelLoadError(f"{gf.name}: {COHERE2}.rope.freq_base_swa {swa_base!r} differs from the RoPE base "
                             f"{raw['rope_theta']!r}; llama.cpp's {COHERE2} graph rotates by the latter but shifts its "
                             "cache by the former, so the file runs two ways")
    layers = raw["num_hidden_layers"]
    return {**_cohere_fields(gf, COHERE2, raw, qk_norms=False), "sliding_window": window,
            "layer_types": layer_types(layers, _sliding_pattern(gf, layers))}


def layer_types(num_layers: int, pattern: int = SLIDING_PATTERN) -> list[str]:
    """transformers' layer_types of llama.cpp's set_swa_pattern(pattern): layer i slides when i % pattern <
    pattern - 1 (every layer slides for pattern 0)."""
    return ["sliding_attention" if pattern == 0 or i % pattern < pattern - 1 else "full_attention"
            for i in range(num_layers)]


def _sliding_pattern(gf: GGUFFile, layers: int) -> int:
    """The period llama.cpp's cohere2 loader reads: the scalar key, else 4 (an array is ignored)."""
    key = f"{COHERE2}.attention.sliding_window_pattern"
    pattern = gf.get(key)
    if pattern is None:
        return SLIDING_PATTERN
    if isinstance(pattern, list):
        if [bool(p) for p in pattern] != [t == "sliding_attention" for t in layer_types(layers)]:
            raise ModelLoadError(f"{gf.name}: {key} is a per-layer array; llama.cpp's {COHERE2} loader ignores it "
                                 f"and slides three layers of four, which the array does not say")
        return SLIDING_PATTERN
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise ModelLoadError(f"{gf.name}: {key} is {pattern!r}; expected a period (a non-negative number)")
    return pattern


def _cohere_fields(gf: GGUFFile, arch: str, raw: dict[str, Any], qk_norms: bool) -> dict[str, Any]:
    """What command-r and cohere2 share: the LayerNorms' eps, the logit scale, the tied head; refuses tensors the
    arch's loader never creates and a head size it cannot run."""
    eps = gf.get(f"{arch}.attention.layer_norm_epsilon")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ModelLoadError(f"{gf.name}: {arch}.attention.layer_norm_epsilon is {eps!r}; llama.cpp's {arch} graph "
                             "needs the LayerNorms' positive eps")
    scale = gf.get(f"{arch}.logit_scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
        raise ModelLoadError(f"{gf.name}: {arch}.logit_scale is {scale!r}; llama.cpp's {arch} loader requires it "
                             "(a non-negative number; 0 leaves the logits unscaled)")
    unread = [name for name in gf.tensors if _UNREAD.fullmatch(name)
              or (not qk_norms and name.split(".")[-2] in _QK_NORMS)]
    if unread:
        more = f" (+{len(unread) - 3} more)" if len(unread) > 3 else ""
        raise ModelLoadError(f"{gf.name} holds {', '.join(unread[:3])}{more}, which llama.cpp's {arch} loader never "
                             "reads; the file is not one it runs")
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    head_dim = raw.get("head_dim", hidden // heads)
    if head_dim * heads != hidden:
        raise ModelLoadError(f"{gf.name}: {heads} heads of {head_dim} features are not the embedding length "
                             f"{hidden}; llama.cpp's {arch} loader requires that (Cohere's head size is their quotient)")
    return {"layer_norm_eps": float(eps), "logit_scale": float(scale) or 1.0, "tie_word_embeddings": True}
