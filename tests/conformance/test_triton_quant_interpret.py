"""The cuda backend's quant_matmul and fused_moe Triton kernels, and a tiny model on cuda kernels, interpreted.

The interpreted tests run in the TRITON_INTERPRET=1 child pytest that
tests/conformance/test_triton_interpret.py::test_interpreter_subprocess starts; run them alone with
`TRITON_INTERPRET=1 python -m pytest tests/conformance/test_triton_quant_interpret.py`.
On a GPU they also run compiled, in the parent process, on cuda tensors (DEVICE).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flashllm.backends import cuda
from flashllm.ops import op_specs
from flashllm.ops.quant_matmul import QuantizedWeight, pack_int4
from flashllm.ops.testing import make_inputs, to_device
from flashllm.ops.testing_moe import add_shared_expert
from flashllm.ops.tolerances import assert_close, tolerance

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SPECS = op_specs()
BACKEND = cuda.make_backend()
KERNELS = {op: kernels[0] for op, kernels in BACKEND.kernels.items()}


def _interpreting() -> bool | None:
    """None without a usable triton; else whether this process runs Triton kernels interpreted."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


INTERPRETING = _interpreting()
# where the kernels run: the interpreter takes CPU tensors; compiled kernels need a GPU's
DEVICE = "cuda" if not INTERPRETING and torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(INTERPRETING is None, reason="triton is not installed (pip install triton)")
# kernel tests: interpreted in the child process, and compiled on DEVICE where a GPU is here
interpreted_or_gpu = pytest.mark.skipif(
    not INTERPRETING and DEVICE == "cpu",
    reason="runs in the TRITON_INTERPRET=1 child process of test_interpreter_subprocess (and compiled on a GPU)",
)


def dev(value: Any) -> Any:
    """A tensor, QuantizedWeight or inputs dict built on the CPU (seeded), moved to DEVICE; slice views after."""
    return to_device(value, DEVICE)


def skip_unless_the_device_runs(dtype: torch.dtype) -> None:
    """On a GPU, skip an activation dtype its profile lacks (bf16 before sm80), as resolve does."""
    if DEVICE != "cpu" and dtype not in (profile := BACKEND.device_profile(torch.device(DEVICE))).dtypes:
        pytest.skip(f"{profile.name} cannot run {dtype}")


def _launcher(op: str) -> Any:
    from flashllm.backends.cuda import kernels

    return kernels.launcher_module(op)


def random_weight(gen: torch.Generator, n: int, k: int, scheme: str, group_size: int, asym: bool) -> QuantizedWeight:
    """Random codes and scales (every code value appears), not a quantized float matrix."""
    groups = 1 if group_size == -1 else k // group_size
    if scheme == "w8a16":
        data, std = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), k**-0.5 / 64
    else:
        data, std = pack_int4(torch.randint(0, 16, (n, k), generator=gen)), k**-0.5 / 4
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8) if asym else None
    return QuantizedWeight(scheme, data, (torch.rand(n, groups, generator=gen) + 0.5) * std, zeros, group_size)


# -- quant_matmul ------------------------------------------------------------------------------


@interpreted_or_gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 20),
    n=st.integers(1, 70),
    layout=st.sampled_from([
        ("w8a16", -1, 96), ("w8a16", 32, 64), ("w8a16", 128, 256), ("w8a16", 48, 144),  # 48: 16-wide tiles
        ("w4a16", -1, 40), ("w4a16", 64, 192), ("w4a16", 128, 128), ("w4a16", 8, 48), ("w4a16", 40, 80),
    ]),
    asym=st.booleans(),
    dtype=st.sampled_from(FLOATS),
    path=st.sampled_from([None, "gemv", "gemm"]),
    split_k=st.integers(1, 4),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quant_matmul_any_layout_path_and_split(
    rows: int, n: int, layout: tuple[str, int, int], asym: bool, dtype: torch.dtype, path: str | None,
    split_k: int, bias: bool, seed: int,
) -> None:
    """Every scheme, per-channel, tile-aligned and unaligned groups (8, 40: scales read per element),
    through the GEMV (with K split 1-4 ways) and GEMM kernels, matches the reference op."""
    scheme, group_size, k = layout
    gen = torch.Generator().manual_seed(seed)
    skip_unless_the_device_runs(dtype)
    weight = dev(random_weight(gen, n, k, scheme, group_size, asym and scheme == "w4a16"))
    x = dev(torch.randn(rows, k, generator=gen).to(dtype))
    b = dev(torch.randn(n, generator=gen).to(dtype)) if bias else None
    actual = _launcher("quant_matmul").matmul(x, weight, b, path=path, split_k=split_k)
    assert_close(actual, SPECS["quant_matmul"].reference(x, weight, b), dtype)


@interpreted_or_gpu
def test_quant_matmul_keeps_leading_dims_and_reads_strided_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = dev(random_weight(gen, 24, 64, "w4a16", 32, True))
    wide = dev(torch.randn(2, 3, 80, generator=gen).half())
    x = wide[..., :64]  # rows strided by 80
    actual = KERNELS["quant_matmul"].fn(x, weight)
    assert actual.shape == (2, 3, 24)
    assert_close(actual, SPECS["quant_matmul"].reference(x.reshape(6, 64), weight).view(2, 3, 24), torch.float16)


@interpreted_or_gpu
@pytest.mark.parametrize(("scheme", "rows"), [("w4a16", 3), ("w8a16", 7), ("none", 2)])
def test_quant_matmul_applies_input_perm_before_the_kernel(scheme: str, rows: int) -> None:
    """Act-order weights: y = x[:, perm] @ W.T, W stored in permuted column order."""
    gen = torch.Generator().manual_seed(2)
    weight = dev(QuantizedWeight.dense(torch.randn(40, 128, generator=gen)) if scheme == "none"
                 else random_weight(gen, 40, 128, scheme, 32, False))
    perm = dev(torch.randperm(128, generator=gen))
    x = dev(torch.randn(rows, 128, generator=gen))
    actual = KERNELS["quant_matmul"].fn(x, dataclasses.replace(weight, input_perm=perm))
    assert_close(actual, SPECS["quant_matmul"].reference(x[:, perm], weight), torch.float32)


# -- fused_moe ---------------------------------------------------------------------------------


def moe_inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
               seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k]  # k distinct experts per token
    return dev({
        "x": torch.randn(tokens, hidden, generator=gen).to(dtype),
        "w13": (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype),
        "w2": (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype),
        "topk_weights": torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1),
        "topk_ids": ids,
    })


@pytest.mark.skipif(INTERPRETING is None, reason="triton is not installed")
@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(0, 40), experts=st.integers(1, 9), top_k=st.integers(1, 3),
       block_m=st.sampled_from([16, 32, 64]), seed=st.integers(0, 2**16))
def test_align_by_expert_tiles_hold_one_expert_and_every_pair_once(
    tokens: int, experts: int, top_k: int, block_m: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = dev(torch.randint(0, experts, (tokens, top_k), generator=gen))
    sorted_pairs, block_expert = _launcher("fused_moe").align_by_expert(ids, experts, block_m)
    num_pairs = tokens * top_k
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair exactly once, padding marked T*k
    flat = ids.reshape(-1).tolist()
    for block, expert in enumerate(block_expert.tolist()):
        tile = [p for p in sorted_pairs[block * block_m:(block + 1) * block_m].tolist() if p < num_pairs]
        assert all(flat[p] == expert for p in tile)  # a tile never mixes experts
        if expert < 0:
            assert not tile
    # tiles with pairs come first and in expert order; the ones after are all unused
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used) and block_expert.tolist()[len(used):] == [-1] * (len(block_expert) - len(used))


def assert_moe_close(actual: torch.Tensor, inputs: dict[str, Any], dtype: torch.dtype) -> None:
    """actual against the fp32 fused_moe reference within dtype's tolerances plus what the spec lets a
    kernel add: rounding the (pairs, I) activation to x.dtype moves output h of token t by at most
    sum over its experts of weight x sum_i |act_i| |w2[h, i]| x the dtype's unit roundoff (an fp16
    case from hypothesis: 0.00195 off the fp32 reference, exactly the reference with that rounding)."""
    x, w13, w2, weights, ids = (inputs[k].cpu().float() for k in ("x", "w13", "w2", "topk_weights", "topk_ids"))
    if inputs.get("w13_scale") is not None:  # w8a16: the bound is over the weights the codes stand for
        w13, w2 = (w * inputs[f"{k}_scale"].cpu().float()[..., None] for k, w in (("w13", w13), ("w2", w2)))
    expected = SPECS["fused_moe"].reference(**inputs).cpu().float()
    bound = torch.zeros_like(expected)
    for t, j in torch.cartesian_prod(torch.arange(ids.shape[0]), torch.arange(ids.shape[1])).tolist():
        gate, up = (x[t] @ w13[int(ids[t, j])].T).chunk(2)
        act = torch.nn.functional.silu(gate) * up
        bound[t] += weights[t, j] * (act.abs() @ w2[int(ids[t, j])].abs().T) * torch.finfo(dtype).eps / 2
    atol, rtol = tolerance(dtype)
    diff = (actual.cpu().float() - expected).abs()
    assert (diff <= atol + rtol * expected.abs() + bound).all(), f"max excess {(diff - atol - rtol * expected.abs() - bound).max()}"


@interpreted_or_gpu
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 24), hidden=st.sampled_from([16, 40, 96]), inter=st.sampled_from([16, 24, 80]),
       experts=st.integers(1, 9), top_k=st.integers(1, 3), dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**16))
@example(tokens=17, hidden=16, inter=16, experts=6, top_k=1, dtype=torch.float16, seed=12356)  # the rounding case
def test_fused_moe_any_routing(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int
) -> None:
    skip_unless_the_device_runs(dtype)
    inputs = moe_inputs(tokens, hidden, inter, experts, min(top_k, experts), dtype, seed)
    assert_moe_close(KERNELS["fused_moe"].fn(**inputs), inputs, dtype)


@interpreted_or_gpu
def test_fused_moe_many_tokens_use_wide_tiles_and_no_tokens_give_empty() -> None:
    inputs = moe_inputs(200, 32, 48, 4, 2, torch.float16, seed=5)  # 100 pairs per expert: 64-row tiles
    assert_moe_close(KERNELS["fused_moe"].fn(**inputs), inputs, torch.float16)
    int32_ids = {**inputs, "topk_ids": inputs["topk_ids"].int()}  # some routers hand int32 ids
    assert_moe_close(KERNELS["fused_moe"].fn(**int32_ids), inputs, torch.float16)
    empty = moe_inputs(0, 32, 48, 4, 2, torch.float32, seed=5)
    assert KERNELS["fused_moe"].fn(**empty).shape == (0, 32)


def w8a16_moe_inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
                     seed: int) -> dict[str, Any]:
    """moe_inputs with int8 experts over the whole code range and fp32 per-channel scales of unit-sized outputs."""
    inputs = moe_inputs(tokens, hidden, inter, experts, top_k, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, n, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        inputs[name] = dev(torch.randint(-127, 128, (experts, n, k), generator=gen, dtype=torch.int8))
        inputs[f"{name}_scale"] = dev(torch.rand(experts, n, generator=gen) * 2 / (127 * k**0.5) + 1e-4)
    return inputs


@interpreted_or_gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_fused_moe_w8a16_experts_in_wide_tiles_never_read_unchosen_ones(dtype: torch.dtype) -> None:
    """int8 experts (codes times per-channel scales, factored out of the K loop) against the reference;
    NaN scales on the experts no token chose leave the output finite."""
    skip_unless_the_device_runs(dtype)
    inputs = w8a16_moe_inputs(80, 32, 48, 6, 2, dtype, seed=7)
    inputs["topk_ids"] = inputs["topk_ids"] % 4  # experts 4 and 5 unchosen; 40 pairs an expert: 32-row tiles
    for name in ("w13_scale", "w2_scale"):
        inputs[name][4:] = float("nan")
    actual = KERNELS["fused_moe"].fn(**inputs)
    assert torch.isfinite(actual).all()
    assert_moe_close(actual, {**inputs, **{k: inputs[k][:4] for k in ("w13", "w2", "w13_scale", "w2_scale")}},
                     dtype)


@interpreted_or_gpu
@pytest.mark.parametrize("case", ["spread", "top8_renormalized", "w8a16_top2"])
def test_fused_moe_takes_a_shared_expert_as_experts_every_token_routes_to(case: str) -> None:
    """A shared expert four routed experts wide and its sigmoid gate (tests/conformance/test_fused_moe.py),
    against the dense float64 sum."""
    inputs, expected = add_shared_expert(make_inputs("fused_moe", torch.float32, case=case), parts=4, seed=3)
    assert_close(KERNELS["fused_moe"].fn(**dev(inputs)).cpu(), expected.float(), torch.float32)


@interpreted_or_gpu
def test_fused_moe_refuses_int4_experts_it_does_not_claim() -> None:
    inputs = w8a16_moe_inputs(2, 16, 16, 2, 1, torch.float32, seed=0)
    inputs["w13"] = inputs["w13"][..., :8].view(torch.uint8).contiguous()  # packed int4: (E, N, K/2)
    inputs["w2"] = inputs["w2"][..., :8].view(torch.uint8).contiguous()
    inputs["w13_scale"], inputs["w2_scale"] = inputs["w13_scale"][..., None], inputs["w2_scale"][..., None]
    with pytest.raises(ValueError, match="'none' and 'w8a16' only"):
        KERNELS["fused_moe"].fn(**inputs)


@interpreted_or_gpu
def test_fused_moe_rejects_expert_ids_out_of_range() -> None:
    inputs = moe_inputs(3, 16, 16, 4, 2, torch.float32, seed=0)
    inputs["topk_ids"][1, 0] = 4
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        KERNELS["fused_moe"].fn(**inputs)


# -- a tiny model whose every op is a cuda kernel ------------------------------------------------


def _forward(model: torch.nn.Module, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits of a prefill of tokens[:-1] then a decode of tokens[-1], over a shuffled paged cache."""
    from flashllm.models.layers.attention_metadata import AttentionMetadata

    num_layers, kv_heads, head_dim = model.kv_cache_shape()
    num_blocks = len(tokens) // block_size + 2
    caches = [tuple(dev(torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))) for _ in range(2))
              for _ in range(num_layers)]
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    slots = [int(table[i // block_size]) * block_size + i % block_size for i in range(len(tokens))]
    logits = []
    for start, end in ((0, len(tokens) - 1), (len(tokens) - 1, len(tokens))):
        metadata = AttentionMetadata(
            slot_mapping=dev(torch.tensor(slots[start:end])),
            cu_seqlens_q=dev(torch.tensor([0, end - start], dtype=torch.int32)),
            seq_lens=dev(torch.tensor([end], dtype=torch.int32)), block_tables=dev(table[None]),
            max_seqlen_q=end - start, max_seqlen_k=end,
        )
        with torch.inference_mode():
            hidden = model(dev(torch.tensor(tokens[start:end])), dev(torch.arange(start, end)), caches, metadata)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


@interpreted_or_gpu
@pytest.mark.parametrize(("quant_type", "group_size"), [("none", -1), ("w4a16", 32)])
def test_tiny_model_on_cuda_kernels_matches_the_reference_table(
    tmp_path: Path, quant_type: str, group_size: int
) -> None:
    """A tiny Llama (GQA) on an op table of cuda kernels against the same weights on the reference ops.

    The kernels differ from the reference only in fp32 summation order, so the logits must agree
    to fp32 rounding amplified through two layers: 1e-4.
    """
    from flashllm.backends.reference import make_backend
    from flashllm.models.builtin import flashllm_register_models
    from flashllm.models.loader import load_model
    from flashllm.models.registry import ModelRegistry
    from flashllm.quant.spec import weight_quant_spec
    from flashllm.registry.resolve import OpTable
    from flashllm.testing.tiny_models import build_tiny_model

    # head size 64: compiled on a GPU, attention runs a head size the cuda backend claims (16 is not)
    model_dir = build_tiny_model(tmp_path, "llama", seed=2, tokenizer=False, hidden_size=256)
    registry = ModelRegistry()
    flashllm_register_models(registry.register)
    reference_kernels = {op: kernels[0] for op, kernels in make_backend().kernels.items()}
    reference = OpTable(reference_kernels, [])
    cuda_table = OpTable({op: KERNELS.get(op, kernel) for op, kernel in reference_kernels.items()}, [])
    assert cuda_table.sources["quant_matmul"] == "cuda" and cuda_table.sources["paged_attention"] == "cuda"
    quant = weight_quant_spec(quant_type, group_size)
    tokens = torch.randint(0, 200, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = [_forward(load_model(model_dir, table, torch.float32, DEVICE, registry, progress=False, quant=quant)[0],
                       tokens) for table in (cuda_table, reference)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
