"""The cpu backend's greedy LM head: the fp32 argmax without reading the fp32 head
(csrc/greedy_screen.c, csrc/greedy_screen_int8.c).

A greedy step needs each token's argmax over the vocabulary, not its logits. On the 0.5b shape the
LM head is 136 M of 494 M weights, 0.54 GB of fp32 read every decode step. This head keeps a copy
of those rows, bf16 (half the bytes) or, where the native library has an int8 path (AVX-512 VNNI,
AMX-INT8, or AVX2), int8 (a quarter; below), and
finds the fp32 argmax exactly (steps 1-3 for the bf16 copy):

1. scores: s_n = fl(sum_i x_i * bf16(w_ni)), the bf16 copy made fp32 in registers (exactly), in
   fp32 FMA chains.
2. the bound: rounding to nearest, |bf16(w) - w| <= 2^-8 |w|, and an fp32 sum of K terms in any
   order is within gamma_K = K u / (1 - K u) (u = 2^-24) of their absolute sum. The score and the
   row's fp32 logit l_n (one fixed order of sums) are thus at most
   E * sum_i |x_i| |w_ni| <= E * ||x|| * ||w_n|| apart, E = 2^-8 + 2.01 gamma_K. The margin
   m_n = c * b_n + d takes c = 1.01 E ||x|| and b_n >= ||w_n||, both rounded up: the 1% covers the
   fp32 rounding of the margin arithmetic (|s_n| is at most ~||x|| b_n, ~2^8 times the margin, so
   that rounding is ~2^-16 of the margin), and d the bf16 rounding of subnormal weights and the
   sums' underflows below 2^-126.
3. the pick: every row with s_n + m_n >= max_j (s_j - m_j) gets its fp32 logit l_n, and the token
   is the first of those with the largest l_n. If r is the argmax of l (the first of the largest),
   s_r + m_r >= l_r >= l_j >= s_j - m_j for every j, so r and every row tied with it are picked.

On a CPU with AMX-BF16, 8 or more tokens take step 1 through bf16 tile products instead
(csrc/greedy_screen.c): each token is split x = hi + lo + e, hi and lo bf16 and |e| < 2^-14 |x|,
every product of two bf16 values is exact in fp32, and the tile unit adds the 2K of them in fp32
in an order of its own. The score and l_n are then at most
(2^-8 + 2^-22 + 2^-14 + gamma_K + 1.012 gamma_2K) sum_i |x_i| |w_ni| apart: the bf16 rounding
against hi + lo, e, the logit's own sums and the tiles' (whose terms are at most
(1 + 2^-7) |x_i| (1 + 2^-8) |w_ni|). As gamma_K <= gamma_2K / 2, E = 2^-8 + 2^-13 + 2.01 gamma_2K
covers it there. The tiles take subnormal inputs as zero and flush subnormal sums, an error below
2^-126 per term or per sum, which d covers at twice its size on that path.

Where the native library has an int8 path the head is kept as int8 instead (csrc/greedy_screen_int8.c), half the
bytes again: row n as codes q_n in -127..127 and an fp32 scale s_n = max |w_n| / 127 (the w8a16
rounding of quant/weight_only.py; any codes would do), so w_n = s_n q_n + e_n with e_n known
exactly at load (float64); each token as x = (t / m) P + rho, t a
power of two >= max |x| / 127, P = m round(x / t) + round(m (x / t - round(x / t))), so
|rho_k| <= t / (2m) and ||rho|| <= sqrt(K) ||x|| / (127 m) =: r ||x||. The score is
fl(fl(fl(I) s_n) (t / m)) with I = sum q_nk P_k an exact integer (m, a power of two <= 128, keeps
127 * 127.5 m K below 2^31), so it is within 2.01 u of s_n (t / m) I = sum (s_n q_nk)(x_k - rho_k),
whose distance from the exact logit is |sum e_nk x_k + sum s_n q_nk rho_k| <= ||e_n|| ||x|| +
||s_n q_n|| r ||x||; the fp32 logit's own sums add gamma_K ||w_n|| ||x||. So the margin takes
c = 1.01 ||x|| and b_n >= ||e_n|| + ||s_n q_n|| (r + 3 u (1 + r)) + 2.01 gamma_K ||w_n|| (the 1%
as above: here the margin is at least ~2^-12 of |s_n|), and d twice its bf16 size for the scores'
underflows. The VNNI loops, the AMX-INT8 tiles and the AVX2 loops compute the same I, so the same scores.

So the token is the argmax of fp32 logits that each come from one fixed order of sums per row:
the same token whatever else is in the batch (the full fp32 product's bits depend on the batch
size; these do not). Where a score or a picked logit is not finite, that token's full logits are
computed and the adapter's argmax (torch's rules) decides. On the 0.5b shape's random weights a
token picks one to a few rows; a model whose top logits crowd within the margin picks more and
stays exact, only slower.

It takes a step only for a model that declares the lm_head fusion (flashllm/registry/fusions.py:
its logits are the head's product, nothing after it but a division by a power of two, which keeps every
order and tie of fp32 logits whose quotients stay normal) with a single-rank fp32 float head (not
--quantize_lm_head), features a multiple of 32, at most native.MAX_TOKENS rows (the bf16 copy on a CPU
without AVX-512 takes 9: 2 to 9 through the AVX2 tiles of csrc/greedy_screen.c), with the native library; otherwise
the engine computes logits as before. The copy is kept
in the head's QuantizedWeight.kernel_cache under KEPT_AS, so it lives as long as the head, a second
build finds it, and flashllm.models.weight_bytes counts it. FLASHLLM_CPU_GREEDY_SCREEN=0 turns it off,
=bf16 keeps the bf16 copy where the int8 one would run (both for A/B runs).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flashllm.backends.cpu import huge_pages, native, parallel
from flashllm.ops.quant_matmul import INT8_MAX
from flashllm.quant.weight_only import symmetric_codes
from flashllm.registry.fusions import LM_HEAD, LMHeadFusion, declared

ENV_SWITCH = "FLASHLLM_CPU_GREEDY_SCREEN"
KEPT_AS = "greedy_screen"  # the screen's key in the head's kernel_cache (flashllm.models.weight_bytes reads it)
_U = 2.0**-24  # fp32 unit roundoff
_BF16_U = 2.0**-8  # bf16's (8 significant bits)
_SPLIT_U = 2.0**-13  # a token split in two bf16 parts: 2^-14 left over, plus its product with _BF16_U
_ROUND_UP = 1 + 2.0**-20  # covers a float64 norm's own rounding (~K 2^-53); _up then rounds to fp32 upwards
_INF = torch.tensor(math.inf)
# rows converted at a time: ~6 float64 temporaries of 2048 x K (15 MB each at K = 896) add to a
# load's peak resident memory, where 8192 rows added ~0.35 GB
_CHUNK_ROWS = 2048


def error_factor(in_features: int, split: bool = False) -> float:
    """c / ||x||: the margin's factor for rows of in_features weights, with `split` for scores from
    the AMX tiles' split tokens (see the module docstring)."""
    terms = 2 * in_features if split else in_features
    gamma = terms * _U / (1 - terms * _U)
    return 1.01 * (_BF16_U + (_SPLIT_U if split else 0.0) + 2.01 * gamma)


def scratch_floats(tokens: int, in_features: int) -> int:
    """The scratch flashllm_bf16_gemv_mt needs: the tokens deinterleaved (tokens x in_features), or
    their bf16 parts as the AMX tiles' operand (16-token chunks of 16 floats' room a feature)."""
    return 16 * -(-tokens // 16) * in_features


def int8_multiplier(in_features: int) -> int:
    """m for rows of in_features weights: the largest power of two <= 128 with 127 * 127.5 m K < 2^31
    (every int32 sum of the int8 path exact), or 0 where not even m = 1 fits."""
    m = 128
    while m >= 1 and 127 * 127.5 * m * in_features >= 2**31:
        m //= 2
    return m


class GreedyScreen:
    """hidden rows (T, K) fp32 -> each row's fp32 argmax token over the head's rows, or None when
    this head does not take the call (the caller computes logits as before).

    kind: "int8" or "bf16", the copy to score from; None takes int8 where the native library has
    an int8 path on this CPU (and FLASHLLM_CPU_GREEDY_SCREEN is not "bf16"), else bf16.
    ids: None here (row n is token n); a screen over a subset of the vocabulary (draft_vocab.py) holds
    each row's token id (int64)."""

    ids: Tensor | None = None

    def __init__(self, weight: Tensor, vocab_size: int, fallback: Callable[[Tensor], Tensor],
                 kind: str | None = None) -> None:
        self.weight = weight[:vocab_size]  # rows past the vocabulary (tensor-parallel padding) never win
        self.vocab_size, self.in_features = vocab_size, weight.shape[1]
        self.multiplier = int8_multiplier(self.in_features)
        if kind is None:
            kind = "int8" if self.multiplier > 0 and int8_screen_runs() else "bf16"
        self.kind = kind
        shape = tuple(self.weight.shape)
        dtype = torch.int8 if kind == "int8" else torch.bfloat16
        big = huge_pages.enabled() and self.weight.numel() * dtype.itemsize >= huge_pages.HUGE_PAGE
        copy = huge_pages.huge_page_empty(shape, dtype) if big else torch.empty(shape, dtype=dtype)
        bounds = torch.empty(shape[0], dtype=torch.float64)
        self.scales = torch.empty(shape[0] if kind == "int8" else 0, dtype=torch.float32)
        norms = torch.empty(shape[0], dtype=torch.float64)
        with torch.no_grad():
            for start in range(0, shape[0], _CHUNK_ROWS):  # no float64 copy of the whole head at once
                rows = self.weight[start : start + _CHUNK_ROWS]
                part = slice(start, start + _CHUNK_ROWS)
                exact = rows.double()
                norms[part] = exact.norm(dim=1)
                if kind == "int8":
                    bounds[part] = self._quantize(rows, exact, copy[part], self.scales[part], norms[part])
                else:
                    copy[part] = rows  # rounded to nearest even
                    bounds[part] = norms[part]
        self.screen = copy if kind == "int8" else copy.view(torch.int16)
        self.row_bound = _up(bounds * _ROUND_UP)
        self.max_row_norm = float(norms.max()) if len(norms) else 0.0
        self._fallback = fallback  # hidden rows -> their tokens from the head's full logits
        self.picked = 0  # rows whose fp32 logit was computed, over all calls (tests and A/B runs read it)
        self.input_format: str | None = None  # llama.cpp's rounding of the input (a GGUF head), or None
        # Tensors a call only writes and reads itself, kept for the next: allocating a batch-1 step's
        # scores (600 KB), the kernels' scratch and the pick's counts costs ~0.1 ms on `intel-2c`, run cold after
        # the copy's stream. The scores of the last call's token count; scratch per count.
        self._kept: dict[object, Tensor] = {}

    def _quantize(self, rows: Tensor, exact: Tensor, codes: Tensor, scales: Tensor, norms: Tensor) -> Tensor:
        """Fill rows' int8 codes and scales (exact: rows in float64, norms: their norms); their b_n
        (the module docstring's int8 bound) in float64."""
        k, m = self.in_features, self.multiplier
        q, scale = symmetric_codes(rows[:, None, :], INT8_MAX)  # the w8a16 rounding: any codes suit the bound
        q = q[:, 0].double().nan_to_num()  # a row with a NaN or inf keeps a non-finite scale and scores
        scales.copy_(scale[:, 0])
        codes.copy_(q.to(torch.int8))
        rounded = q * scales.double()[:, None]  # s_n q_n, exact in float64
        r = math.sqrt(k) / (127 * m)
        gamma = k * _U / (1 - k * _U)
        return ((exact - rounded).norm(dim=1) + rounded.norm(dim=1) * (r + 3 * _U * (1 + r))
                + 2.01 * gamma * norms)

    @property
    def nbytes(self) -> int:
        """Bytes a greedy step reads of this head (the copy, its scales and bounds; the picked fp32
        rows are a few)."""
        return self.screen.nbytes + self.scales.nbytes + self.row_bound.nbytes

    def kept_tensor(self, key: object, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """The kept tensor under key if it has this shape, else a new one kept in its place."""
        kept = self._kept.get(key)
        if kept is None or kept.shape != shape:
            kept = self._kept[key] = torch.empty(shape, dtype=dtype)
        return kept

    def scratch(self, lib, tokens: int) -> Tensor:
        """The screen kernels' scratch for `tokens` rows, kept per token count."""
        scratch = self._kept.get(("scratch", tokens))
        if scratch is None:
            k = self.in_features
            size = lib.flashllm_i8_screen_scratch(tokens, k) if self.kind == "int8" else 4 * scratch_floats(tokens, k)
            scratch = self._kept[("scratch", tokens)] = torch.empty(size, dtype=torch.uint8)
        return scratch

    def _scores(self, lib, x: Tensor, scores: Tensor) -> int:
        """The copy's scores of x into scores; the native path that took them (0: none did)."""
        tokens, k = x.shape
        n = self.vocab_size
        threads = native.threads_for(tokens, n, k)
        scratch = self.scratch(lib, tokens)
        if self.kind == "int8":
            return lib.flashllm_i8_screen_mt(x.data_ptr(), tokens, k, self.screen.data_ptr(), self.scales.data_ptr(),
                                             scores.data_ptr(), n, n, self.multiplier, scratch.data_ptr(), threads)
        return lib.flashllm_bf16_gemv_mt(x.data_ptr(), self.screen.data_ptr(), scores.data_ptr(), tokens, k, n, n,
                                         scratch.data_ptr(), threads)

    def margins(self, split: bool) -> tuple[float, float, float]:
        """The pick's margin factor and its two floor terms for scores from this copy (`split`: from
        the bf16 AMX tiles' split tokens)."""
        k = self.in_features
        factor = 1.01 if self.kind == "int8" else error_factor(k, split)
        # each token's margin factor c = factor ||x|| _ROUND_UP and floor d, both rounded up to fp32
        # by the pick (its ||x|| in float64); d covers subnormal weights' rounding and underflowed
        # sums (and the tiles' flushes), far below any fp32 logit that matters:
        # d = (2 on the AMX tiles and the int8 copy, else 1) (4 K + sqrt(K) (||x|| + max_n ||w_n||)) 2^-125
        floor_scale = (2 if split or self.kind == "int8" else 1) * 2.0**-125
        return factor * _ROUND_UP, floor_scale * (4 * k + math.sqrt(k) * self.max_row_norm), floor_scale * math.sqrt(k)

    def settle(self, x: Tensor, out: Tensor) -> None:
        """Tokens the pick left at -1 (a non-finite score or logit) from their rows' full logits."""
        rows = (out < 0).nonzero().flatten()
        out[rows] = self._fallback(x[rows])

    def __call__(self, hidden: Tensor) -> Tensor | None:
        lib = native.library()
        tokens, k = hidden.shape
        if lib is None or hidden.dtype != torch.float32 or not 0 < tokens <= native.MAX_TOKENS:
            return None
        x = hidden.contiguous()
        if self.input_format is not None:  # a GGUF head: its input as llama.cpp's integer product sees it
            x = native.round_activations(x, self.input_format)
        n = self.vocab_size
        scores = self.kept_tensor("scores", (tokens, n), torch.float32)
        path = self._scores(lib, x, scores)
        if not path:
            return None  # more tokens than an AVX2 CPU's screen takes: the fp32 tiles are faster there
        factor, floor0, floor1 = self.margins(path == 2 and self.kind == "bf16")  # the bf16 AMX tiles split
        out, counts = torch.empty(tokens, dtype=torch.int64), self.kept_tensor("counts", (2,), torch.int64)
        lib.flashllm_screen_pick(x.data_ptr(), tokens, k, self.weight.data_ptr(), scores.data_ptr(), n, n,
                                 self.row_bound.data_ptr(), factor, floor0, floor1, out.data_ptr(), counts.data_ptr(),
                                 parallel.workers())
        picked, unsure = counts.tolist()
        self.picked += picked
        if self.ids is not None:  # picked rows of a subset: their token ids (-1, a row left unsure, stays)
            sure = out >= 0
            out[sure] = self.ids[out[sure]]
        if unsure:
            self.settle(x, out)
        return out


def int8_screen_runs() -> bool:
    """Whether a head's screen takes its int8 copy on this CPU (a native int8 path, and FLASHLLM_CPU_GREEDY_SCREEN
    not "bf16"), given features the int8 bound allows; else the bf16 copy."""
    lib = native.library()
    return os.environ.get(ENV_SWITCH) != "bf16" and lib is not None and lib.flashllm_i8_screen_set_path(-1) > 0


def _up(values: Tensor) -> Tensor:
    """float64 values as fp32 no smaller than them."""
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, _INF), rounded)


def build(model: torch.nn.Module, argmax: Callable[[Tensor], Tensor]) -> GreedyScreen | None:
    """The screened head of a loaded model (built once, then kept with the head: see kept), or None
    where it does not apply: switched off, no lm_head fusion declared, no native library, not an
    fp32 float single-rank head, features not a multiple of 32, or a logits_scale that is not a power of
    two (the screen finds the argmax of the product, which only such a division keeps, ties included).
    Tokens it cannot settle come from argmax over the model's compute_logits, which the declaration says
    is the head's product divided by logits_scale."""
    head = declared(model, LM_HEAD, LMHeadFusion)
    if head is None or math.frexp(head.logits_scale)[0] != 0.5:
        return None
    logits = model.compute_logits
    return _screen_of(head, lambda rows: argmax(logits(rows).float()))


def for_head(head: Any, argmax: Callable[[Tensor], Tensor]) -> GreedyScreen | None:
    """The screen of an LM head module (models/layers/embedding.py LMHead: a speculative head's, which reads its
    input after the head's own norm), under build's conditions, kept with the head the same way (a head shared
    with the model, as an EAGLE-1 head shares it, shares the screen). Tokens it cannot settle come from argmax
    over head(rows)."""
    if not hasattr(head, "qweight"):
        return None
    fusion = LMHeadFusion(head.weight.data, head.qweight, head.num_embeddings, head.tp_size, tied=False)
    return _screen_of(fusion, lambda rows: argmax(head(rows).float()))


def _screen_of(head: LMHeadFusion, fallback: Callable[[Tensor], Tensor]) -> GreedyScreen | None:
    """The head's kept screen, else a new one kept with it, or None where the head does not qualify or the screen is
    switched off."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or head.qweight is None:
        return None
    existing = head.qweight.kernel_cache.get(KEPT_AS)
    if existing is not None:
        return existing
    weight = head.weight
    lib = native.library()
    if (lib is None or head.tp_size != 1 or head.qweight.scheme != "none"
            or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
            or weight.shape[1] % 32 != 0 or not weight.is_contiguous()):
        return None
    screen = GreedyScreen(weight, head.vocab_size, fallback)
    screen.input_format = native.llama_format(head.qweight)  # the logits' own rounding (quant.dense_matmul)
    head.qweight.kernel_cache[KEPT_AS] = screen
    return screen


def kept(model: torch.nn.Module) -> GreedyScreen | None:
    """The screen an earlier build kept for `model`'s head, or None (tests and benchmarks read it)."""
    head = declared(model, LM_HEAD, LMHeadFusion)
    return None if head is None or head.qweight is None else head.qweight.kernel_cache.get(KEPT_AS)
