"""The cuda backend's Triton kernels on the CPU: TRITON_INTERPRET=1 runs them against the op references.

Triton reads TRITON_INTERPRET when `triton` is imported (its own library functions are decorated
then), so the interpreted tests run in a child pytest started with the variable set:
`test_interpreter_subprocess` below (with test_triton_quant_interpret.py's: one triton import).
Run them directly with `TRITON_INTERPRET=1 python -m pytest tests/conformance/test_triton_interpret.py`.
On a GPU the same tests also run compiled, in the parent process, on cuda tensors (DEVICE).
The parent process compiles every kernel for sm80/sm90, which needs no GPU either.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends import cuda
from flashllm.backends.cuda import kernels as cuda_kernels
from flashllm.ops import op_specs
from flashllm.ops.testing import (
    case_kv_dtype,
    case_quant,
    cases,
    make_inputs,
    random_block_tables,
    run_case,
    to_device,
    unclaimed_case,
)
from flashllm.ops.tolerances import assert_close
from flashllm.registry.backend import check_signature

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SPECS = op_specs()
# the claimed caps, read without importing triton: parametrization must work where it is missing
BACKEND = cuda.make_backend()
KERNELS = {op: kernels[0] for op, kernels in BACKEND.kernels.items()}
REPO = Path(__file__).resolve().parents[2]
# interpreted tests of other modules, run by the same child process
INTERPRETED_MODULES = (Path(__file__), Path(__file__).with_name("test_triton_quant_interpret.py"))


def _triton_state() -> tuple[str | None, bool]:
    """(why triton cannot be used or None, whether this process interprets Triton kernels)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)", False
    try:
        import triton
    except Exception as error:  # a broken install must skip with its reason, not error the suite
        return f"triton does not import: {error!r}", False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return None, bool(knobs.runtime.interpret)
    return None, os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


TRITON_MISSING, INTERPRETING = _triton_state()
# where the kernels run: the interpreter takes CPU tensors; compiled kernels need a GPU's
DEVICE = "cuda" if not INTERPRETING and torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(TRITON_MISSING is not None, reason=str(TRITON_MISSING))
# kernel tests: interpreted in the child process, and compiled on DEVICE where a GPU is here
interpreted_or_gpu = pytest.mark.skipif(
    not INTERPRETING and DEVICE == "cpu",
    reason="runs in the TRITON_INTERPRET=1 child process of test_interpreter_subprocess (and compiled on a GPU)",
)
interpreter_only = pytest.mark.skipif(
    not INTERPRETING, reason="checks the interpreter itself: runs in the TRITON_INTERPRET=1 child process only"
)
compiled = pytest.mark.skipif(INTERPRETING, reason="needs Triton's compiler, not the interpreter")
pytestmark = needs_triton


def dev(value: Any) -> Any:
    """A tensor, QuantizedWeight or inputs dict built on the CPU (seeded), moved to DEVICE; slice views after."""
    return to_device(value, DEVICE)


def skip_unless_the_device_runs(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> None:
    """On a GPU, skip what its profile lacks (bf16 before sm80, an fp8 KV cache before sm89), as resolve does."""
    if DEVICE == "cpu":
        return
    profile = BACKEND.device_profile(torch.device(DEVICE))
    if dtype not in profile.dtypes or (kv_dtype is not None and kv_dtype not in profile.kv_dtypes):
        pytest.skip(f"{profile.name} cannot run {dtype} activations with a {kv_dtype} KV cache")


@compiled
def test_interpreter_subprocess() -> None:
    """Every interpreted test of INTERPRETED_MODULES, in a child pytest that imports triton interpreted."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    paths = [str(path.relative_to(REPO)) for path in INTERPRETED_MODULES]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,  # inside pytest-timeout's 600 s
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreted kernel tests failed:\n{output[-8000:]}"
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= len(_param_ids()), f"too few interpreted tests ran:\n{output[-3000:]}"


def _param_ids() -> list[Any]:
    params = []
    for op, kernel in KERNELS.items():
        for dtype in sorted(kernel.caps.dtypes, key=str):
            for case in cases(op):
                kv_dtype = case_kv_dtype(op, case)
                if case_quant(op, case) not in kernel.caps.quant or (
                    kv_dtype is not None and kv_dtype not in kernel.caps.kv_dtypes
                ) or unclaimed_case(kernel, op, case):
                    continue  # a weight format, KV cache, ALiBi or score cap the kernel does not claim: never picked
                params.append(pytest.param(op, dtype, case, id=f"{op}-{str(dtype)[6:]}-{case}"))
    return params


def check(op: str, inputs: dict[str, Any], dtype: torch.dtype, fn: Any = None) -> None:
    """The registered cuda kernel (or fn) against the op's reference body on the same inputs, all on DEVICE."""
    skip_unless_the_device_runs(dtype)
    tensors = {name: value for name, value in inputs.items() if isinstance(value, torch.Tensor)}
    elsewhere = [name for name, tensor in tensors.items() if tensor.device.type != DEVICE]
    assert not elsewhere, f"inputs {elsewhere} are not on {DEVICE}: build them with dev()"
    expected = run_case(SPECS[op].reference, op, inputs)
    actual = run_case(fn or KERNELS[op].fn, op, inputs)
    assert_close(actual, expected, dtype)


@interpreted_or_gpu
def test_every_kernel_is_a_launcher_with_the_op_signature() -> None:
    assert set(KERNELS) == set(cuda_kernels.KERNEL_MODULES)
    for op in KERNELS:
        launcher = getattr(cuda_kernels.launcher_module(op), op)
        check_signature(launcher, SPECS[op])
        assert "triton" in launcher.__module__


@compiled
def test_importing_the_backend_does_not_import_triton() -> None:
    code = "import sys, flashllm.backends.cuda as c; c.make_backend(); assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@compiled
def test_bench_refuses_to_time_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would really run")
    from flashllm.backends.cuda import bench

    assert bench.main(["--kernel", "paged_attention"]) == bench.NO_GPU
    assert "no CUDA/ROCm GPU" in capsys.readouterr().err


@interpreted_or_gpu
@pytest.mark.parametrize("argv", [[], ["--mode", "prefill"]], ids=["decode", "prefill"])
def test_bench_inputs_pass_the_bench_correctness_check(argv: list[str]) -> None:
    """The benchmark's own inputs and check, shrunk, on DEVICE (a GPU run of the benchmark times them)."""
    from flashllm.backends.cuda import bench_measure

    small = ["--dtype", "float32", "--tokens", "40", "--hidden", "96", "--intermediate", "80", "--heads", "4",
             "--kv-heads", "2", "--head-size", "64", "--block-size", "16", "--seqs", "2", "--context", "20",
             "--out-features", "48", "--group-size", "32", "--experts", "4"]
    for op in KERNELS:
        args = bench_measure.build_parser().parse_args(["--kernel", op, *small, *argv])
        inputs, nbytes = bench_measure.check(args, DEVICE)
        assert nbytes > 0 and inputs


@interpreted_or_gpu
@pytest.mark.parametrize(("op", "dtype", "case"), _param_ids())
def test_kernel_matches_reference(op: str, dtype: torch.dtype, case: str) -> None:
    caps = KERNELS[op].caps
    head_size = min(caps.head_sizes) if caps.head_sizes else 64
    block_size = min(caps.block_sizes) if caps.block_sizes else 16
    skip_unless_the_device_runs(dtype, case_kv_dtype(op, case))
    check(op, make_inputs(op, dtype, DEVICE, head_size=head_size, block_size=block_size, case=case), dtype)


# -- elementwise kernels: strided rows, chunked rows, several head sizes ------------------------


@interpreted_or_gpu
def test_rms_norm_chunked_and_strided_rows() -> None:
    mod = cuda_kernels.launcher_module("rms_norm")
    hidden = mod.MAX_BLOCK + 40  # two chunks, the second one partial
    wide = dev(torch.randn(3, hidden + 8))
    x, residual = wide[:, :hidden], dev(torch.randn(3, hidden))  # x rows are strided
    check("rms_norm", {"x": x, "weight": dev(torch.rand(hidden) + 0.5), "eps": 1e-5, "residual": residual},
          torch.float32)


@interpreted_or_gpu
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_layer_norm_chunked_and_strided_rows(with_bias: bool) -> None:
    """Rows wider than one chunk merge per-chunk statistics; chunks of different means test the merge."""
    mod = cuda_kernels.launcher_module("layer_norm")
    hidden = mod.MAX_BLOCK + 40  # two chunks, the second one partial
    wide = dev(torch.randn(3, hidden + 8) + torch.linspace(-4.0, 12.0, hidden + 8))
    x, residual = wide[:, :hidden], dev(torch.randn(3, hidden))  # x rows are strided
    inputs = {"x": x, "weight": dev(torch.rand(hidden) + 0.5), "bias": dev(torch.randn(hidden)) if with_bias else None,
              "eps": 1e-5, "residual": residual}
    check("layer_norm", inputs, torch.float32)


@interpreted_or_gpu
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp(-x) = inf: sigmoid 0, right
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_gated_activations_wide_and_strided(dtype: torch.dtype) -> None:
    inter = 1100  # more than one column program of 1024
    x = dev(torch.randn(3, 2 * inter + 6) * 3)[:, : 2 * inter].to(dtype)
    check("silu_and_mul", {"x": x}, dtype)
    check("gelu_and_mul", {"x": x, "approximate": "tanh"}, dtype)


@interpreted_or_gpu
@pytest.mark.parametrize(("head_size", "is_neox"), [(64, True), (80, False), (128, True), (128, False)])
def test_rotary_on_views_of_a_fused_qkv(head_size: int, is_neox: bool) -> None:
    heads, kv_heads, tokens = 4, 2, 9
    qkv = dev(torch.randn(tokens, (heads + 2 * kv_heads) * head_size, dtype=torch.bfloat16))
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    cache = make_inputs("rotary_embedding", torch.float32, DEVICE, head_size=head_size, case="neox_partial")
    cache = cache["cos_sin_cache"]
    inputs = {
        "positions": dev(torch.randint(0, cache.shape[0], (tokens,))),
        "q": q.view(tokens, heads, head_size),
        "k": k.view(tokens, kv_heads, head_size),
        "cos_sin_cache": cache,
        "is_neox": is_neox,
    }
    check("rotary_embedding", inputs, torch.bfloat16)


@interpreted_or_gpu
@pytest.mark.parametrize(("head_size", "block_size", "dtype"), [(128, 64, torch.float16), (80, 32, torch.float32)])
def test_write_kv_cache_shapes(head_size: int, block_size: int, dtype: torch.dtype) -> None:
    inputs = make_inputs(
        "write_kv_cache", dtype, DEVICE, head_size=head_size, block_size=block_size, case="mixed_with_padding"
    )
    check("write_kv_cache", inputs, dtype)


@interpreted_or_gpu
def test_write_kv_cache_converts_to_the_cache_dtype() -> None:
    inputs = make_inputs("write_kv_cache", torch.float32, DEVICE, case="prefill")
    inputs["k_cache"], inputs["v_cache"] = inputs["k_cache"].half(), inputs["v_cache"].half()
    check("write_kv_cache", inputs, torch.float16)


# -- paged attention: GQA ratios, head and block sizes, odd lengths, splits ------------------


def attention_inputs(
    q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_size: int, block_size: int,
    dtype: torch.dtype, kv_dtype: torch.dtype | None = None, seed: int = 0, **extra: Any,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_block_tables(gen, seq_lens, block_size)
    shape = (num_blocks, block_size, kv_heads, head_size)
    kv_dtype = kv_dtype or dtype
    return dev({
        "q": torch.randn(sum(q_lens), heads, head_size, generator=gen).to(dtype),
        "k_cache": torch.randn(shape, generator=gen).to(kv_dtype),
        "v_cache": torch.randn(shape, generator=gen).to(kv_dtype),
        "block_tables": tables,
        "cu_seqlens_q": torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "scale": head_size**-0.5,
        **extra,
    })


def attend(partition_size: int) -> Any:
    """The attention launcher with a short decode split, so short contexts use several splits."""
    launcher = cuda_kernels.launcher_module("paged_attention")
    return lambda **kw: launcher.attend(**kw, partition_size=partition_size)


# (Hq, Hk, head_size, block_size, dtype): GQA ratios 1, 4 and 8; head sizes 64 and 128; blocks 16, 64
ATTENTION_SHAPES = [
    (2, 2, 64, 16, torch.float32),
    (8, 2, 128, 64, torch.float32),
    (8, 1, 64, 64, torch.bfloat16),
    (4, 1, 128, 16, torch.float16),
]


@interpreted_or_gpu
@pytest.mark.parametrize(("heads", "kv_heads", "head_size", "block_size", "dtype"), ATTENTION_SHAPES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_attention_mixed_batch_odd_lengths_and_block_edges(
    heads: int, kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype
) -> None:
    bs = block_size
    # decode on a block edge, an odd append after a cached prefix, a prefill of exactly two blocks,
    # an empty query (allowed by the op), an odd decode spanning several splits
    q_lens, seq_lens = [1, 5, 2 * bs, 0, 1], [2 * bs, bs + 3, 2 * bs, 7, 3 * bs + 5]
    inputs = attention_inputs(q_lens, seq_lens, heads, kv_heads, head_size, block_size, dtype)
    check("paged_attention", inputs, dtype, attend(partition_size=64))


@interpreted_or_gpu
def test_attention_long_context_split_across_many_programs() -> None:
    # 700 keys in splits of 64: 11 decode programs per KV head, merged; also the default split length
    inputs = attention_inputs([1, 1, 3], [700, 130, 300], 4, 2, 64, 16, torch.float32)
    check("paged_attention", inputs, torch.float32, attend(partition_size=64))
    check("paged_attention", inputs, torch.float32)


@interpreted_or_gpu
@pytest.mark.parametrize("drafts", [1, 4, 8])
def test_attention_verify_rows_of_drafted_decodes(drafts: int) -> None:
    """Speculative decoding's verify step (core/spec): a decode with k drafts runs as k + 1 one-token rows over one
    block table, row j attending to its first L + 1 + j keys (across a block edge here), beside a plain decode and
    a prefill chunk. The kernel matches the reference on that batch, and its verify rows equal the reference's
    one causal (k + 1)-token chunk over the same keys: the two forms of the same attention agree."""
    heads, kv_heads, head_size, bs, dtype = 8, 2, 64, 16, torch.float32
    context = 2 * bs - 3
    gen = torch.Generator().manual_seed(drafts)
    tables, num_blocks = random_block_tables(gen, [context + 1 + drafts, 9, 40], bs)
    q_lens = [1] * (drafts + 1) + [1, 7]
    seq_lens = [context + 1 + j for j in range(drafts + 1)] + [9, 40]
    shape = (num_blocks, bs, kv_heads, head_size)
    inputs = dev({
        "q": torch.randn(sum(q_lens), heads, head_size, generator=gen),
        "k_cache": torch.randn(shape, generator=gen), "v_cache": torch.randn(shape, generator=gen),
        "block_tables": torch.cat((tables[:1].expand(drafts + 1, -1), tables[1:])),
        "cu_seqlens_q": torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32), "scale": head_size**-0.5,
    })
    check("paged_attention", inputs, dtype, attend(partition_size=64))
    chunk = {**inputs, "q": inputs["q"][: drafts + 1], "block_tables": inputs["block_tables"][:1],
             "cu_seqlens_q": dev(torch.tensor([0, drafts + 1], dtype=torch.int32)),
             "seq_lens": dev(torch.tensor([context + 1 + drafts], dtype=torch.int32))}
    as_chunk = run_case(SPECS["paged_attention"].reference, "paged_attention", chunk)
    as_rows = run_case(KERNELS["paged_attention"].fn, "paged_attention", inputs)[: drafts + 1]
    assert_close(as_rows, as_chunk, dtype)


@interpreted_or_gpu
def test_attention_window_and_alibi_skip_whole_splits() -> None:
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(4)])
    # window 70 over splits of 64: 197 leaves split 1 a single visible key (127), 198 starts at 128
    inputs = attention_inputs([1, 9, 1, 1], [333, 200, 197, 198], 4, 2, 64, 16, torch.float32,
                              sliding_window=70, alibi_slopes=slopes)
    check("paged_attention", inputs, torch.float32, attend(partition_size=64))


@interpreted_or_gpu
@pytest.mark.parametrize("splits", [64, None], ids=["many_splits", "default_split"])
def test_attention_sinks_and_score_caps_through_the_split_merge(splits: int | None) -> None:
    """gpt-oss's sinks (added once, in the merge, when a decode runs in splits) and Gemma 2's score cap, with a
    window that leaves some splits empty, on decodes and a prefill chunk."""
    gen = torch.Generator().manual_seed(7)
    extra = {"sliding_window": 70, "sinks": torch.randn(4, generator=gen) * 2, "logit_softcap": 1.5}
    inputs = attention_inputs([1, 9, 1, 1], [333, 200, 197, 198], 4, 2, 64, 16, torch.float32, **extra)
    fn = attend(partition_size=splits) if splits else None
    check("paged_attention", inputs, torch.float32, fn)
    for name in ("sinks", "logit_softcap"):  # each changes the result on its own
        alone = {**inputs, name: None}
        assert (run_case(SPECS["paged_attention"].reference, "paged_attention", alone)
                - run_case(SPECS["paged_attention"].reference, "paged_attention", inputs)).abs().max() > 1e-3


@interpreted_or_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_gpt_oss_experts(dtype: torch.dtype) -> None:
    """w8a16 experts with float biases and the clamped "swigluoai" activation, gate features past the clamp."""
    inputs = make_inputs("fused_moe", dtype, case="w8a16_top2")
    gen = torch.Generator().manual_seed(3)
    experts, two_inter, hidden = inputs["w13"].shape
    inputs = dev({**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
                  "w13_scale": inputs["w13_scale"].cpu() * 8, "w2_scale": inputs["w2_scale"].cpu() / 16,
                  "w13_bias": torch.randn(experts, two_inter, generator=gen).to(dtype),
                  "w2_bias": torch.randn(experts, hidden, generator=gen).to(dtype)})
    inputs["activation"] = "swigluoai"
    check("fused_moe", inputs, dtype)


@interpreted_or_gpu
@pytest.mark.parametrize("head_size", sorted(cuda_kernels.ATTENTION_HEAD_SIZES))
def test_attention_every_claimed_head_size(head_size: int) -> None:
    inputs = attention_inputs([1, 3], [40, 21], 2, 1, head_size, 16, torch.float32)
    check("paged_attention", inputs, torch.float32, attend(partition_size=16))


@interpreted_or_gpu
@pytest.mark.parametrize("block_size", sorted(cuda_kernels.ATTENTION_BLOCK_SIZES))
def test_attention_every_claimed_block_size(block_size: int) -> None:
    inputs = attention_inputs([1, 4], [block_size + 1, 2 * block_size - 1], 2, 2, 64, block_size, torch.float16)
    check("paged_attention", inputs, torch.float16, attend(partition_size=64))


@interpreted_or_gpu
def test_attention_cache_dtype_differs_from_activations() -> None:
    inputs = attention_inputs([1, 6], [37, 20], 4, 2, 64, 16, torch.float16, kv_dtype=torch.float32)
    check("paged_attention", inputs, torch.float16, attend(partition_size=16))


@interpreted_or_gpu
@settings(max_examples=8, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 3]),
)
def test_attention_any_varlen_batch(lens: list[tuple[int, int]], group: int) -> None:
    """Any mix of prefill, append, decode and empty rows matches the reference."""
    q_lens = [min(a, b) for a, b in lens]
    seq_lens = [max(a, b, 1) for a, b in lens]
    if not sum(q_lens):
        return
    inputs = attention_inputs(q_lens, seq_lens, 2 * group, 2, 64, 16, torch.float32, seed=sum(seq_lens))
    check("paged_attention", inputs, torch.float32, attend(partition_size=16))


# -- a real compile for NVIDIA GPUs, without one -------------------------------------------------


def _compile_instead_of_launch(targets: list[Any], compiled: list[str]) -> Any:
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        bound = dict(zip(self.arg_names, args, strict=False))
        options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        signature, constexprs = {}, {}
        for i, param in enumerate(self.params):
            value = bound[param.name]
            signature[param.name] = "constexpr" if param.is_constexpr else mangle_type(value)
            if param.is_constexpr:
                constexprs[(i,)] = value
        for target in targets:
            triton.compile(ASTSource(self, signature, constexprs=constexprs), target=target, options=options)
            compiled.append(f"{self.fn.__name__}@sm{target.arch}")

    return run


@compiled
def test_kernels_compile_for_ampere_and_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each launcher's real arguments, compiled to cubin for sm80 (fp16) and sm90 (bf16), no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    built: list[str] = []
    # sm80: one decode split, written straight to out; sm90: several splits and the merge kernel.
    # quant_matmul: a GEMM (9 or 5 rows) and a GEMV (1 row) launch, int8 and int4 on each target
    quant_cases = {80: ("w8a16_group64_tokens", "w4a16_group32_sym"), 90: ("w4a16_group128_asym", "w8a16_per_channel")}
    for dtype, arch, partition in ((torch.float16, 80, None), (torch.bfloat16, 90, 64)):
        monkeypatch.setattr(JITFunction, "run", _compile_instead_of_launch([GPUTarget("cuda", arch, 32)], built))
        for op in KERNELS:
            case = {"paged_attention": "alibi" if arch == 80 else "sliding_window", "gelu_and_mul": "tanh"}
            fn = attend(partition) if op == "paged_attention" and partition else KERNELS[op].fn
            for op_case in quant_cases[arch] if op == "quant_matmul" else (case.get(op),):
                fn(**make_inputs(op, dtype, case=op_case, block_size=64))
    every = {"prefill_kernel", "decode_kernel", "_write_kv_kernel", "_rotary_kernel", "_rms_norm_kernel",
             "_layer_norm_kernel", "_gated_kernel", "_stream_kernel", "_gemm_kernel", "_gate_up_kernel", "_down_kernel",
             "_store_latent_kernel", "_mla_kernel", "_shrink_kernel", "_expand_kernel"}
    # sm80's one-row int4 case splits K (its 32-row tiles leave too few programs): the summing pass
    assert {name.removesuffix("@sm80") for name in built if name.endswith("@sm80")} == every | {"_split_sum_kernel"}
    assert {name.removesuffix("@sm90") for name in built if name.endswith("@sm90")} == every | {"merge_kernel"}


@interpreter_only
def test_the_kernels_really_ran_interpreted() -> None:
    """Guards the child process: its kernels are Triton's interpreter functions, not GPU binaries."""
    from flashllm.backends.cuda.launch import interpreted as is_interpreted

    for op in KERNELS:
        cuda_kernels.launcher_module(op)
    modules = [m for name, m in sys.modules.items() if name.startswith("flashllm.backends.cuda.triton_")]
    jitted = [v for m in modules for v in vars(m).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")]
    assert len(jitted) >= len(KERNELS) and all(is_interpreted(fn) for fn in jitted)
