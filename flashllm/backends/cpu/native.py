"""The cpu backend's native decode kernels (csrc/decode_kernels.c, csrc/int4_int8_kernels.c,
csrc/layer_ops.c, csrc/decode_attention.c, csrc/decode_stack.c, the greedy LM head's
csrc/greedy_screen.c, csrc/greedy_screen_int8.c and csrc/screen_pick.c, a decode step's MoE layers'
csrc/moe_decode.c, MLA decode's per-head products in csrc/mla_decode.c, and the bandwidth probe's reads
in csrc/read_probe.c; the small ops' wrappers are in native_ops.py, the greedy head's in
greedy_screen.py, which activations the integer kernels meet in activation_modes.py): built with the
system C compiler on first use, loaded through ctypes; the GEMVs split their output rows over the library's own
spinning worker pool (csrc/thread_pool.h).

Why native code: for one token, torch's fp32 GEMV reads 18.5 GB/s on one core and ~26.6 GB/s
split over two threads, and it has no vectorized int8/int4-weight GEMV on AVX2 at all (see
quant.py). On `epyc3-2c` (2-core AVX2 EPYC, docs/benchmarks.md), per 4864 x 896 product with two
threads: fp32 0.53 ms (32.7 GB/s), int8 weights 0.19 ms, int4 weights 0.15 ms, against torch's
0.65 ms fp32.

The library is compiled from the packaged source into the cache directory (keyed by the source's
hash and the flags) with `cc -O3 -mavx2 -mfma`, and used only where torch itself reports AVX2 or
AVX512 on x86-64. Without a compiler, on other CPUs, or with FLASHLLM_CPU_NATIVE=0 nothing here
runs and `unavailable_reason()` says why; the torch paths take over, results unchanged up to
rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from flashllm.backends.cpu import parallel
from flashllm.backends.cpu.activation_modes import (  # noqa: F401 (native.X is how callers and tests use them)
    A8_BLOCK,
    A8_FORMATS,
    GGUF_ACTIVATIONS_ENV,
    GGUF_MODES,
    GROUP_MULTIPLE,
    INT4_ACTIVATIONS_ENV,
    PROMPT_ACTIVATIONS_ENV,
    PROMPT_TERMS,
    W8_ACTIVATIONS_ENV,
    _int8_layout,
    gguf_mode,
    int8_activations,
    int8_rounded,
    llama_format,
    prompt_terms,
)
from flashllm.ops.quant_matmul import QuantizedWeight

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "decode_kernels.c", _CSRC / "int4_int8_kernels.c", _CSRC / "layer_ops.c", _CSRC / "decode_attention.c",
           _CSRC / "decode_stack.c", _CSRC / "read_probe.c", _CSRC / "greedy_screen.c",
           _CSRC / "greedy_screen_int8.c", _CSRC / "screen_pick.c", _CSRC / "decode_lora.c", _CSRC / "moe_decode.c",
           _CSRC / "mla_decode.c", _CSRC / "w8_bf16.c")
HEADERS = (_CSRC / "decode_kernels.h", _CSRC / "parallel_for.h", _CSRC / "simd.h", _CSRC / "thread_pool.h",
           _CSRC / "amx.h", _CSRC / "decode_lora.h", _CSRC / "decode_stack.h")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-pthread")
ENV_SWITCH = "FLASHLLM_CPU_NATIVE"  # "0" turns the native kernels off (for A/B runs)
# Per-channel w8a16 products of W8_BF16_MIN_TOKENS or more tokens round their activations to bf16 and run
# VDPBF16PS (csrc/w8_bf16.c) where the CPU has AVX512-BF16; "0" keeps them on the exact fp32 tiles.
W8_BF16_ENV = "FLASHLLM_CPU_W8_BF16"
W8_BF16_MIN_TOKENS = 16  # 16-token products 1.08-1.33x the exact tiles, 8 tokens 1.01-1.02x (break-even)
MAX_TOKENS = parallel.SPLIT_MAX_TOKENS  # a decode batch; larger products are GEMMs for BLAS, except:
# on AVX-512F CPUs the 16-lane tiles take prompt-sized products too, 32 tokens at a time through each
# row share (csrc/decode_kernels.c): fp32 ones of up to F32_PROMPT_MAX_TOKENS rows, where they beat
# torch's GEMM (the 0.5b shape's 24 layers, `epyc4-2c`: 141 / 159 / 154 GFLOP/s at 32 / 128 / 256
# rows against 58 / 117 / 128), and per-channel int8 (w8a16) ones of any size, exact fp32 arithmetic
# like the dequantize-and-GEMM path they replace (176-191 GFLOP/s at 64 to 512 rows against 54-152
# for that path). The fp32 bound: at 512 and 1024 rows the tiles ran 197 and 172 GFLOP/s against
# torch's 168 and 154 on a quiet box, at 2048 153 against 172 (the weights are read once per 32
# tokens); serving's 512-token prefill steps (plus their decodes) stay below it.
F32_PROMPT_MAX_TOKENS = 1024
# The worker pool hands a share over in a few microseconds (spinning workers), not the ~20 us of
# parallel.py's Python pool, so products from 64 Ki weights split: with parallel.py's 1 Mi the 0.5b
# shape's 896 x 896 o_proj (3.2 MB, ~0.2 ms, 24 times a token) would stay on one core.
SPLIT_MIN_ELEMENTS = 1 << 16
CAPABILITIES = frozenset({"AVX2", "AVX512"})

_lock = threading.Lock()
_state: dict[str, object] = {}

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "flashllm_f32_gemv": ([_P, _P, _P, _I64, _I64, _I64, _I64, _I64], None),
    "flashllm_w8_gemv": ([_P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _I64], None),
    "flashllm_w4_gemv": ([_P, _P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64], None),
    "flashllm_f32_gemv_mt": ([_P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int], None),
    "flashllm_w8_gemv_mt": ([_P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, ctypes.c_int], None),
    "flashllm_w8_gemv_exact_mt": ([_P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, ctypes.c_int], None),
    "flashllm_w4_gemv_mt": ([_P, _P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, ctypes.c_int], None),
    "flashllm_w4a8_gemv_mt": ([_P, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _P, _INT, _INT], _INT),
    "flashllm_w8a8_gemv_mt": ([_P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _P, _INT, _INT], _INT),
    "flashllm_w4a8_prompt_mt": ([_P, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _INT, _INT, _INT], _INT),
    "flashllm_w8a8_prompt_mt": ([_P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _INT, _INT, _INT], _INT),
    "flashllm_a8_set_vnni": ([ctypes.c_int], ctypes.c_int),
    "flashllm_a8_set_table": ([ctypes.c_int], ctypes.c_int),
    "flashllm_w8_set_tiles": ([ctypes.c_int], ctypes.c_int),
    "flashllm_round_activations": ([_P, _I64, _I64, _INT], _INT),
    "flashllm_silu_and_mul_mt": ([_P, _P, _I64, _I64, ctypes.c_int], None),
    "flashllm_read_stream": ([_P, _I64, ctypes.c_int, ctypes.c_int, ctypes.c_int], ctypes.c_double),
    "flashllm_f32_set_rows": ([ctypes.c_int], ctypes.c_int),
    "flashllm_f32_set_stream_max": ([ctypes.c_int], ctypes.c_int),
    "flashllm_f32_set_stream_min": ([ctypes.c_int], ctypes.c_int),
    "flashllm_f32_set_gemv_rows": ([ctypes.c_int], ctypes.c_int),
    "flashllm_w8_set_z_min": ([ctypes.c_int], ctypes.c_int),
    "flashllm_w8_set_bf16_min": ([ctypes.c_int], ctypes.c_int),
    "flashllm_bf16_gemv_mt": ([_P, _P, _P, _I64, _I64, _I64, _I64, _P, ctypes.c_int], ctypes.c_int),
    "flashllm_screen_set_path": ([ctypes.c_int], ctypes.c_int),
    "flashllm_screen_set_avx2_tiles": ([ctypes.c_int], ctypes.c_int),
    "flashllm_i8_screen_mt": ([_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _P, ctypes.c_int], ctypes.c_int),
    "flashllm_i8_screen_set_path": ([ctypes.c_int], ctypes.c_int),
    "flashllm_i8_screen_scratch": ([_I64, _I64], _I64),
    "flashllm_screen_pick": ([_P, _I64, _I64, _P, _P, _I64, _I64, _P, ctypes.c_double, ctypes.c_double,
                              ctypes.c_double, _P, _P, ctypes.c_int], None),
    "flashllm_decode_stack": ([_P, _I64, _P, _P, _P, _P], ctypes.c_int),
    "flashllm_decode_stack_scratch": ([_P], _I64),
    "flashllm_moe_scratch": ([_P, _I64], _I64),
    "flashllm_moe_block": ([_P, _P, _P, _P], None),
    "flashllm_mla_scratch": ([_P, _I64], _I64),
    "flashllm_bf16_screen_takes": ([_I64], ctypes.c_int),
    "flashllm_i8_screen_takes": ([_I64, _I64], ctypes.c_int),
    "flashllm_decode_burst": ([_P, _I64, _P, _P, _P, _P, _P, _I64, _P, _I64, _P, _P, _P], _I64),
    "flashllm_rms_norm": ([_P, _P, _P, _P, _P, _I64, _I64, ctypes.c_float], None),
    "flashllm_rotary": ([_P, _I64, _I64, _I64, _I64, _I64, _P, _P, ctypes.c_int], None),
    "flashllm_mla_vxm_mt": ([_P, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_int], None),
    "flashllm_mla_mxv_mt": ([_P, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_int], None),
    "flashllm_decode_attention": ([_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                   ctypes.c_float, _P, ctypes.c_int], None),
    "flashllm_attention_set_run_rows": ([ctypes.c_int], ctypes.c_int),
    "flashllm_attention_runs_taken": ([], _I64),
}


def _cache_dir() -> Path:
    from flashllm.config import cache_root  # the one cache-root rule of flashllm

    return cache_root() / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str) -> Path:
    """Compile SOURCES into the cache (once per sources, headers and flags); returns the library's path."""
    text = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(text + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_kernels-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | str:
    """The loaded library, or a one-line reason it is not available."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"turned off by {ENV_SWITCH}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the native kernels are x86-64 AVX2 code; this machine is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CAPABILITIES:
        return f"the CPU reports {capability}, the native kernels need AVX2 and FMA"
    compiler = _compiler()
    if compiler is None:
        return "no C compiler (cc, gcc or clang; or $CC) to build the native kernels"
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as err:
        return f"building the native kernels failed: {err}"
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    switch = os.environ.get(W8_BF16_ENV, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{W8_BF16_ENV} must be 1 (w8a16 prompts on bf16 activations where the CPU has "
                         f"AVX512-BF16, the default) or 0 (the exact fp32 tiles), got {switch!r}")
    lib.flashllm_w8_set_bf16_min(W8_BF16_MIN_TOKENS if switch == "1" else 0)  # ignored without AVX512-BF16
    return lib


def library() -> ctypes.CDLL | None:
    """The native library, built and loaded once per process; None where unavailable."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
    lib = _state["lib"]
    return lib if isinstance(lib, ctypes.CDLL) else None


def unavailable_reason() -> str | None:
    """Why the native kernels do not run here, or None if they do."""
    return None if library() is not None else str(_state["lib"])


def reset() -> None:
    """Forget the loaded state (tests flip ENV_SWITCH)."""
    with _lock:
        _state.clear()


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def threads_for(num_tokens: int, out_features: int, in_features: int) -> int:
    """Row shares for one product: every configured core for a product of SPLIT_MIN_ELEMENTS weights."""
    split = num_tokens > 0 and out_features * in_features >= SPLIT_MIN_ELEMENTS
    return parallel.workers() if split and out_features >= 2 * parallel.ROW_ALIGN else 1


def dense_max_tokens() -> int:
    """The most rows f32_linear takes: F32_PROMPT_MAX_TOKENS where the 16-lane tiles run (AVX-512F),
    else a decode batch (MAX_TOKENS)."""
    return F32_PROMPT_MAX_TOKENS if f32_rows() == 8 else MAX_TOKENS


def supports_dense(x: Tensor, weight: Tensor) -> bool:
    """Whether f32_linear takes this product: fp32 x of at most dense_max_tokens() rows, fp32 weight."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and x.device.type == "cpu" and library() is not None and 0 < x.shape[0] <= dense_max_tokens())


def f32_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x (T, K) fp32 @ weight (N, K) fp32 .T -> (T, N) fp32, each dot product in fp32 FMA chains."""
    lib = library()
    x, weight = x.contiguous(), weight.contiguous()
    tokens, k = x.shape
    n = weight.shape[0]
    out = torch.empty(tokens, n, dtype=torch.float32)
    lib.flashllm_f32_gemv_mt(_ptr(x), _ptr(weight), _ptr(out), tokens, k, n, n, threads_for(tokens, n, k))
    return out


def supports_quantized(weight: QuantizedWeight, num_tokens: int) -> bool:
    """Whether int_linear takes this weight: w8a16/w4a16 in a decode batch, with groups of a multiple
    of 32 features (the exact fp32 kernels), or the layouts only the int8-activation kernels run
    (GGUF's: offsets, groups of 16 or 32; see int8_activations)."""
    if weight.scheme not in ("w8a16", "w4a16") or num_tokens <= 0 or library() is None:
        return False
    if num_tokens > MAX_TOKENS:
        return _z_prompt(weight)
    if int8_activations(weight):
        return True
    if llama_format(weight) is not None:  # not on the exact kernel: quant.py's dequant path rounds as llama.cpp
        return False
    return weight.offsets is None and (weight.in_features // weight.num_groups) % GROUP_MULTIPLE == 0


def _z_prompt(weight: QuantizedWeight) -> bool:
    """Whether a prompt-sized product of this weight runs the 16-lane int8 tiles (int_linear) rather than
    dequantize-and-GEMM: per-channel w8a16 against fp32 activations, K a multiple of 16, the tiles
    on (AVX-512F), and FLASHLLM_CPU_PROMPT_ACTIVATIONS at its fp32 default (exact either way)."""
    return (weight.scheme == "w8a16" and weight.num_groups == 1 and weight.offsets is None
            and weight.in_features % 16 == 0 and not int8_activations(weight) and prompt_terms(weight) == 0
            and w8_z_min() > 0)


def round_activations(x: Tensor, fmt: str) -> Tensor:
    """x (T, K) fp32 -> a copy rounded to llama.cpp's `fmt` blocks (code * scale; flashllm/quant/
    gguf_activations.py says how), natively where K is whole 64-feature blocks (256 for q8_K)."""
    from flashllm.quant.gguf_activations import BLOCK
    from flashllm.quant.gguf_activations import round_activations as rounded

    lib = library()
    out = x.float().contiguous().clone()
    if lib is None or x.dim() != 2 or x.shape[1] % max(A8_BLOCK, BLOCK[fmt]):
        return rounded(x.reshape(-1, x.shape[-1]), fmt)[0].float().reshape(x.shape)
    if lib.flashllm_round_activations(_ptr(out), out.shape[0], out.shape[1], A8_FORMATS[fmt]) != 0:
        raise ValueError(f"cannot round {tuple(x.shape)} activations to {fmt} blocks")
    return out


def supports_prompt(weight: QuantizedWeight, num_tokens: int) -> bool:
    """Whether prompt_linear takes this product: more than MAX_TOKENS rows of an int8/int4 weight
    whose layout the integer x int8 kernels run, with FLASHLLM_CPU_PROMPT_ACTIVATIONS int8x2 or int8."""
    return num_tokens > MAX_TOKENS and prompt_terms(weight) > 0 and library() is not None


def prompt_linear(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """x (T, K) float @ dequantized W.T -> (T, N) fp32 for a prompt-sized T: the activations are
    rounded as int8_rounded(x, prompt_terms(weight)) says, the rest is exact integer products and
    fp32 scaling; rows (and the activations' quantization) split over the configured cores."""
    lib = library()
    x = x.float().contiguous()
    tokens, k = x.shape
    n, groups = weight.out_features, weight.num_groups
    codes, scales, zeros = _layout(weight)
    offsets = offsets_layout(weight)
    offsets_ptr = None if offsets is None else _ptr(offsets)
    out = torch.empty(tokens, n, dtype=torch.float32)
    terms = prompt_terms(weight)
    if terms == 0:
        raise ValueError(f"prompt_linear runs with {PROMPT_ACTIVATIONS_ENV}=int8x2 or int8 on a layout the integer "
                         "kernels take; check supports_prompt first")
    split = n * k >= SPLIT_MIN_ELEMENTS and n >= 2 * parallel.ROW_ALIGN
    threads = parallel.workers() if split else 1
    afmt = A8_FORMATS[llama_format(weight)] if terms == 1 else 0  # two terms are flashllm's own rounding
    if weight.scheme == "w4a16":
        status = lib.flashllm_w4a8_prompt_mt(_ptr(x), tokens, k, _ptr(codes), _ptr(scales),
                                             None if zeros is None else _ptr(zeros), offsets_ptr, groups, _ptr(out),
                                             n, n, terms, threads, afmt)
    else:
        status = lib.flashllm_w8a8_prompt_mt(_ptr(x), tokens, k, _ptr(codes), _ptr(scales), offsets_ptr, groups,
                                             _ptr(out), n, n, terms, threads, afmt)
    if status != 0:
        raise MemoryError(f"the integer x int8 prompt kernel could not allocate its activation scratch "
                          f"({tokens} tokens x {k} features, {terms} terms)")
    return out


def _layout(weight: QuantizedWeight) -> tuple[Tensor, Tensor, Tensor | None]:
    """(codes, fp32 scales, int32 zeros or None) contiguous, built once into weight.kernel_cache."""
    key = "cpu_native"
    if key not in weight.kernel_cache:
        zeros = None if weight.zeros is None else weight.zeros.to(torch.int32).contiguous()
        weight.kernel_cache[key] = (weight.data.contiguous(), weight.scales.float().contiguous(), zeros)
    return weight.kernel_cache[key]


def offsets_layout(weight: QuantizedWeight) -> Tensor | None:
    """The weight's per-group offsets as contiguous fp32 (built once into weight.kernel_cache), or None."""
    if weight.offsets is None:
        return None
    key = "cpu_native_offsets"
    if key not in weight.kernel_cache:
        weight.kernel_cache[key] = weight.offsets.float().contiguous()
    return weight.kernel_cache[key]


def int_linear(x: Tensor, weight: QuantizedWeight, exact: bool = False) -> Tensor:
    """x (T, K) float @ dequantized W.T for a w8a16/w4a16 weight -> (T, N) fp32, computed in fp32
    (against int8-quantized activations where int8_activations(weight) says so; per-channel w8a16 against
    bf16-rounded ones from w8_bf16_min() tokens on, unless `exact`)."""
    lib = library()
    x = x.float().contiguous()
    tokens, k = x.shape
    n, groups = weight.out_features, weight.num_groups
    codes, scales, zeros = _layout(weight)
    out = torch.empty(tokens, n, dtype=torch.float32)
    threads = threads_for(tokens, n, k)
    if int8_activations(weight):
        offsets = offsets_layout(weight)
        offsets_ptr = None if offsets is None else _ptr(offsets)
        afmt = A8_FORMATS[llama_format(weight)]
        if weight.scheme == "w4a16":
            status = lib.flashllm_w4a8_gemv_mt(_ptr(x), tokens, k, _ptr(codes), _ptr(scales),
                                               None if zeros is None else _ptr(zeros), offsets_ptr, groups, _ptr(out),
                                               n, n, None, threads, afmt)
        else:
            status = lib.flashllm_w8a8_gemv_mt(_ptr(x), tokens, k, _ptr(codes), _ptr(scales), offsets_ptr, groups,
                                               _ptr(out), n, n, None, threads, afmt)
        if status != 0:
            raise MemoryError("the integer x int8 kernel could not allocate its activation scratch")
    elif weight.offsets is not None:
        raise ValueError("a weight with offsets runs only against int8 activations natively (supports_quantized)")
    elif weight.scheme == "w4a16":
        even, odd = x[:, 0::2].contiguous(), x[:, 1::2].contiguous()  # the nibbles' order
        lib.flashllm_w4_gemv_mt(_ptr(even), _ptr(odd), tokens, k, _ptr(codes), _ptr(scales),
                                None if zeros is None else _ptr(zeros), groups, _ptr(out), n, n, threads)
    else:
        product = lib.flashllm_w8_gemv_exact_mt if exact else lib.flashllm_w8_gemv_mt
        product(_ptr(x), tokens, k, _ptr(codes), _ptr(scales), groups, _ptr(out), n, n, threads)
    return out


READ_RUN_FLOATS = 64  # csrc/read_probe.c's READ_RUN: a read probe's buffer comes in runs of this many floats


def read_stream(buf: Tensor, streams: int = 2, step: int = 64) -> float:
    """The sum of the fp32 CPU buffer buf (numel a multiple of READ_RUN_FLOATS), read by the bandwidth
    probe's kernel: every thread reads `streams` streams (1-16) of its share, as the one-token fp32
    products read rows, switching streams every `step` floats (32 or 64)."""
    if not (buf.dtype == torch.float32 and buf.device.type == "cpu" and buf.is_contiguous()
            and buf.numel() % READ_RUN_FLOATS == 0):
        raise ValueError(f"read_stream needs a contiguous fp32 CPU buffer of whole {READ_RUN_FLOATS}-float runs")
    if not (1 <= streams <= 16 and step in (32, 64)):
        raise ValueError(f"read_stream reads 1 to 16 streams switching every 32 or 64 floats, not {streams} and {step}")
    return library().flashllm_read_stream(buf.data_ptr(), buf.numel() // READ_RUN_FLOATS, parallel.workers(),
                                          streams, step)


def a8_vnni(on: bool | None = None) -> bool:
    """Whether the products against int8 activations run csrc/int4_int8_kernels.c's AVX-512 VNNI
    bodies (picked at load where the CPU has it; int4 codes need K in whole 128-feature pairs of
    blocks). With `on`, sets it first (True only where the CPU has VNNI), for tests and A/B runs."""
    return bool(library().flashllm_a8_set_vnni(-1 if on is None else int(on)))


def a8_table(on: bool | None = None) -> bool:
    """Whether int4 decode products of 4+ tokens against flashllm's int8 activations with groups of 64
    run csrc/int4_int8_kernels.c's table_row (each row's scale products made 8 blocks at a time; the
    default) rather than flash_rows: the same bits either way. With `on`, sets it first, for tests and
    A/B runs."""
    return bool(library().flashllm_a8_set_table(-1 if on is None else int(on)))


def w8_tiles(on: bool | None = None) -> bool:
    """Whether prompts (more than 32 activation rows) of int8 codes on the VNNI body run 4-row tiles
    (the same bits as the one-row body, fewer instructions). With `on`, sets it first, for tests and A/B."""
    return bool(library().flashllm_w8_set_tiles(-1 if on is None else int(on)))


def f32_rows(rows: int | None = None) -> int:
    """Rows the one-token fp32 loop reads at once: 8 where the CPU has AVX-512F (its fp32 products,
    small batches' tiles too, run the AVX-512 code), else 2 (AVX2). With `rows`, sets it first (an
    unsupported count changes nothing), for tests and A/B runs."""
    return library().flashllm_f32_set_rows(0 if rows is None else rows)


def f32_stream_max(tokens: int | None = None) -> int:
    """The most tokens whose fp32 products run the AVX2 stream tiles of csrc/decode_kernels.c (a
    speculative verify step's rows; 0: none, and where the AVX-512 paths run these never do). With
    `tokens` (0, or 2 to 9), sets it first, for tests and A/B runs."""
    return library().flashllm_f32_set_stream_max(-1 if tokens is None else tokens)


def f32_stream_min(tokens: int | None = None) -> int:
    """The fewest tokens whose fp32 products run the AVX2 stream tiles: 1 (the default: one token sums
    as a batch does, so rows are batch-invariant) or 2 (one token on the pair loop). With `tokens`, sets
    it first, for tests and A/B runs."""
    return library().flashllm_f32_set_stream_min(-1 if tokens is None else tokens)


def f32_gemv_rows(rows: int | None = None) -> int:
    """Rows the one-token fp32 loop reads at once where the AVX-512 paths run (f32_rows() == 8): 8 on
    Intel CPUs, 2 on AMD ones (csrc/decode_kernels.c says why). With `rows` (2 or 8), sets it first,
    for tests and A/B runs; without AVX-512 the pair loop runs whatever this says."""
    return library().flashllm_f32_set_gemv_rows(0 if rows is None else rows)


def w8_z_min(tokens: int | None = None) -> int:
    """The fewest tokens whose products of per-row-scaled int8 weights (w8a16 per channel) run the
    AVX-512 16-lane tiles of csrc/decode_kernels.c (0: never, as on CPUs without AVX-512F). With
    `tokens`, sets it first (0 turns them off), for tests and A/B runs."""
    return library().flashllm_w8_set_z_min(-1 if tokens is None else tokens)


def w8_bf16_min(tokens: int | None = None) -> int:
    """The fewest tokens whose per-channel w8a16 products round their activations to bf16 and run
    csrc/w8_bf16.c's VDPBF16PS tiles (0: never, as on CPUs without AVX512-BF16 or with
    FLASHLLM_CPU_W8_BF16=0). With `tokens`, sets it first (0 turns them off), for tests and A/B runs."""
    return library().flashllm_w8_set_bf16_min(-1 if tokens is None else tokens)
