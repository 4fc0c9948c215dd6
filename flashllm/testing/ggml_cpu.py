"""A Llama GGUF file run straight through ggml's CPU arithmetic (emulated in numpy): the oracle for llama.cpp numerics."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# The arithmetic lives with the backend that runs it in an engine (flashllm/backends/ggml); LlamaGGUF
# below is the independent straight-line graph the tests hold that backend to.
from flashllm.backends.ggml.numerics import (  # noqa: F401  (re-exported: the tests' names for the ops)
    F32,
    F64,
    block_dot,
    dot_chain16,
    dot_f32,
    expf,
    fma,
    hsum8,
    hsum16,
    quantize_q8,
    rms_norm,
    rope_interleaved,
    rope_pairs,
    rope_table,
    softmax,
    swiglu,
)


class LlamaGGUF:
    """A Llama GGUF file (Q4_1 / Q8_0 matrices, F32 norms; the token embedding as the head when there is
    no output.weight) run with the functions above: one sequence, fp32 KV cache, no flash attention, as
    `llama-server -ctk f32 -ctv f32 -fa off` computes it. Slow (numpy): for tests on a few prompts."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
        if arch != "llama":
            raise ValueError(f"{path}: architecture {arch!r}; this emulation runs 'llama' only")

        def meta(key: str):
            return reader.fields[f"llama.{key}"].parts[-1][0]

        self.tensors = {t.name: t for t in reader.tensors}
        self.layers, self.heads = int(meta("block_count")), int(meta("attention.head_count"))
        self.kv_heads, hidden = int(meta("attention.head_count_kv")), int(meta("embedding_length"))
        self.head_dim, self.eps = hidden // self.heads, float(meta("attention.layer_norm_rms_epsilon"))
        self.base = float(meta("rope.freq_base"))
        self.cache: list[tuple[np.ndarray, np.ndarray]] = []
        self._blocks: dict[str, tuple] = {}

    def _matrix(self, name: str) -> tuple:
        if name not in self._blocks:
            tensor = self.tensors[name]
            raw = np.asarray(tensor.data)
            kind = tensor.tensor_type.name
            if kind == "Q4_1":
                blocks = raw.reshape(raw.shape[0], -1, 20)
                qs = blocks[..., 4:20]
                codes = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)  # element order 0..31
                self._blocks[name] = (_half(blocks[..., 0:2]), codes, _half(blocks[..., 2:4]))
            elif kind == "Q8_0":
                blocks = raw.reshape(raw.shape[0], -1, 34)
                self._blocks[name] = (_half(blocks[..., 0:2]), blocks[..., 2:34].copy().view(np.int8).astype(np.int64),
                                      None)
            else:
                raise ValueError(f"{name}: {kind} matrices are not emulated (Q4_1 and Q8_0 are)")
        return self._blocks[name]

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        d, codes, minimums = self._matrix(name)
        return block_dot(x, d, codes, minimums)

    def embed(self, ids: list[int]) -> np.ndarray:
        d, codes, _ = self._matrix("token_embd.weight")
        return (d[ids][..., None] * codes[ids].astype(F32)).astype(F32).reshape(len(ids), -1)

    def forward(self, ids: list[int]) -> np.ndarray:
        """Append ids to the sequence; returns the last token's logits (vocab,) float32."""
        start = self.cache[0][0].shape[0] if self.cache else 0
        positions = list(range(start, start + len(ids)))
        n, heads, kv, dim = len(ids), self.heads, self.kv_heads, self.head_dim
        cos, sin = rope_table(positions, dim, self.base)
        group = np.arange(heads) // (heads // kv)
        x = self.embed(ids)
        for layer in range(self.layers):
            p = f"blk.{layer}."
            h = rms_norm(x, np.asarray(self.tensors[p + "attn_norm.weight"].data, F32), self.eps)
            q = rope_interleaved(self._linear(h, p + "attn_q.weight").reshape(n, heads, dim), cos, sin)
            k = rope_interleaved(self._linear(h, p + "attn_k.weight").reshape(n, kv, dim), cos, sin)
            v = self._linear(h, p + "attn_v.weight").reshape(n, kv, dim)
            if len(self.cache) <= layer:
                self.cache.append((k, v))
            else:
                self.cache[layer] = (np.concatenate([self.cache[layer][0], k]), np.concatenate([self.cache[layer][1], v]))
            keys, values = self.cache[layer]
            pad = (-keys.shape[0]) % 256  # llama.cpp's n_kv; zeros past the context add nothing to any sum
            keys = np.concatenate([keys, np.zeros((pad, kv, dim), F32)])
            values = np.concatenate([values, np.zeros((pad, kv, dim), F32)])
            scores = dot_f32(q.transpose(1, 0, 2)[:, :, None, :], keys.transpose(1, 0, 2)[group][:, None])
            visible = np.arange(keys.shape[0])[None, :] <= np.array(positions)[:, None]
            probs = softmax(scores, np.where(visible, F32(0), F32(-np.inf)).astype(F32)[None], 1.0 / np.sqrt(dim))
            # llamafile's tinyBLAS takes products of >= 2 query rows, ggml's vec_dot a single one
            dot = dot_chain16 if n >= 2 else dot_f32
            out = dot(probs[:, :, None, :], values.transpose(1, 2, 0)[group][:, None])
            x = (self._linear(out.transpose(1, 0, 2).reshape(n, heads * dim), p + "attn_output.weight") + x).astype(F32)
            h = rms_norm(x, np.asarray(self.tensors[p + "ffn_norm.weight"].data, F32), self.eps)
            act = swiglu(self._linear(h, p + "ffn_gate.weight"), self._linear(h, p + "ffn_up.weight"))
            x = (self._linear(act, p + "ffn_down.weight") + x).astype(F32)
        h = rms_norm(x[-1:], np.asarray(self.tensors["output_norm.weight"].data, F32), self.eps)
        head = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        return self._linear(h, head)[0]

    def greedy(self, prompt: list[int], max_tokens: int, stop: frozenset[int] = frozenset()) -> list[int]:
        """Greedy continuation of a fresh sequence (the cache is reset), ending with a stop token if one is met."""
        self.cache = []
        logits, out = self.forward(list(prompt)), []
        while len(out) < max_tokens:
            out.append(int(np.argmax(logits)))
            if out[-1] in stop or len(out) == max_tokens:
                break
            logits = self.forward([out[-1]])
        return out


def _half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(F32)
