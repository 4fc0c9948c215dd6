"""Checks the GGUF loaders of llama.cpp's LayerNorm graphs (gptneox, stablelm, phi2, bloom, falcon, gpt2 /
starcoder) share: the tensors a graph requires or never reads, the LayerNorms' eps and the rotated fraction of a head.
Each raises ModelLoadError (one line) naming the file and the llama.cpp arch."""

from __future__ import annotations

from collections.abc import Iterable

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile


def check_tensors(gf: GGUFFile, arch: str, required: Iterable[str], unread: Iterable[str] = ()) -> None:
    """Refuse a file lacking a tensor llama.cpp's `arch` loader requires, or holding one its graph never reads (a
    file it would refuse or run differently)."""
    missing = [name for name in required if name not in gf.tensors]
    if missing:
        raise ModelLoadError(f"{gf.name} lacks {', '.join(missing)}, which llama.cpp's {arch} loader requires; "
                             "the file is not one it runs")
    ignored = [name for name in unread if name in gf.tensors]
    if ignored:
        raise ModelLoadError(f"{gf.name} holds {', '.join(ignored)}, which llama.cpp's {arch} graph never reads; "
                             "the file is not one it runs")


def layer_norm_eps(gf: GGUFFile, arch: str) -> float:
    """`<arch>.attention.layer_norm_epsilon`, the LayerNorms' eps llama.cpp's loader requires; ModelLoadError where it
    is missing or not positive."""
    eps = gf.get(f"{arch}.attention.layer_norm_epsilon")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ModelLoadError(f"{gf.name}: {arch}.attention.layer_norm_epsilon is {eps!r}; llama.cpp's {arch} graph "
                             "needs the LayerNorms' positive eps")
    return float(eps)


def rotary_factor(gf: GGUFFile, arch: str, head_dim: int) -> float:
    """The fraction of each head `<arch>.rope.dimension_count` rotates (all of it where the file says nothing, as
    llama.cpp reads it), one that int(head_dim x factor) gives back; ModelLoadError otherwise."""
    rope = gf.get(f"{arch}.rope.dimension_count", head_dim)
    if isinstance(rope, bool) or not isinstance(rope, int) or not 0 < rope <= head_dim or rope % 2:
        raise ModelLoadError(f"{gf.name}: {arch}.rope.dimension_count is {rope!r}; expected an even number of "
                             f"features in 1..{head_dim} (the head size)")
    factor = rope / head_dim
    if int(head_dim * factor) != rope:
        raise ModelLoadError(f"{gf.name}: rope over {rope} of {head_dim} head features is no rotary fraction "
                             "flashllm can express")
    return factor
