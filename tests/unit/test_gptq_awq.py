"""GPTQ / AWQ packing: the library against naive packers written here from the published layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.models.hf_config import ModelLoadError, parse_quantization_config
from flashllm.ops.quant_matmul import dequantize, quant_matmul
from flashllm.quant import awq, gptq
from flashllm.quant.gptq import PrequantizedFormatError

# AutoAWQ's GEMM layout: the nibble at bits 4i..4i+3 of a word holds output column AWQ_SLOT_COLUMN[i] of its 8
AWQ_SLOT_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(value: int) -> int:
    """An unsigned 32-bit word as the signed int32 a checkpoint stores."""
    return value - (1 << 32) if value >= 1 << 31 else value


def naive_gptq(codes, zeros, scales, g_idx, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ tensors from per-element loops: qweight packs K (rows), qzeros packs N, low bits first."""
    n, k = len(codes), len(codes[0])
    groups, per = len(zeros[0]), 32 // bits
    qweight = [[_int32(sum(codes[c][row * per + j] << (bits * j) for j in range(per))) for c in range(n)]
               for row in range(k // per)]
    qzeros = [[_int32(sum((zeros[col * per + j][g] - (1 if v1 else 0)) << (bits * j) for j in range(per)))
               for col in range(n // per)] for g in range(groups)]
    return {
        "qweight": torch.tensor(qweight, dtype=torch.int32),
        "qzeros": torch.tensor(qzeros, dtype=torch.int32),
        "scales": torch.tensor(scales, dtype=torch.float16).t().contiguous(),
        "g_idx": torch.tensor(g_idx, dtype=torch.int32),
    }


def naive_awq(codes, zeros, scales) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors from loops: both packed along N, eight columns per word in AWQ's order."""
    n, k, groups = len(codes), len(codes[0]), len(zeros[0])

    def word(values_of_column, col_block: int) -> int:
        return _int32(sum(values_of_column(col_block * 8 + AWQ_SLOT_COLUMN[i]) << (4 * i) for i in range(8)))

    qweight = [[word(lambda c, r=row: codes[c][r], b) for b in range(n // 8)] for row in range(k)]
    qzeros = [[word(lambda c, g=grp: zeros[c][g], b) for b in range(n // 8)] for grp in range(groups)]
    return {
        "qweight": torch.tensor(qweight, dtype=torch.int32),
        "qzeros": torch.tensor(qzeros, dtype=torch.int32),
        "scales": torch.tensor(scales, dtype=torch.float16).t().contiguous(),
    }


def naive_dequant(codes, zeros, scales, g_idx) -> torch.Tensor:
    """W[n][k] = (q - z[g_idx[k]]) * s[g_idx[k]], element by element, scales rounded to fp16."""
    s16 = torch.tensor(scales, dtype=torch.float16).float().tolist()
    return torch.tensor([[(codes[n][k] - zeros[n][g_idx[k]]) * s16[n][g_idx[k]] for k in range(len(g_idx))]
                         for n in range(len(codes))], dtype=torch.float32)


def random_case(seed: int, n: int, k: int, group_size: int, bits: int, act_order: bool, zero_low: int = 0,
                symmetric: bool = False):
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    top = 2**bits - 1
    codes = torch.randint(0, top + 1, (n, k), generator=gen).tolist()
    if symmetric:
        zeros = [[2 ** (bits - 1)] * groups for _ in range(n)]
    else:
        zeros = torch.randint(zero_low, top + 1, (n, groups), generator=gen).tolist()
    scales = (torch.rand(n, groups, generator=gen) * 0.1 + 0.001).tolist()
    if act_order:
        perm = torch.randperm(k, generator=gen)
        g_idx = [0] * k
        for i, feature in enumerate(perm.tolist()):
            g_idx[feature] = i // (k // groups)
    else:
        g_idx = [i // (k // groups) for i in range(k)]
    return codes, zeros, scales, g_idx


GPTQ_CASES = [  # bits, group_size, act order, v1 format, symmetric
    (4, 32, False, True, False),
    (4, 32, True, False, False),
    (4, -1, False, True, True),
    (4, 16, True, True, True),
    (8, 32, True, False, True),
    (8, -1, False, True, True),
]


@pytest.mark.parametrize(("bits", "group_size", "act_order", "v1", "symmetric"), GPTQ_CASES)
def test_gptq_unpacks_naive_tensors_and_multiplies_like_the_naive_weight(bits, group_size, act_order, v1, symmetric):
    codes, zeros, scales, g_idx = random_case(1, 16, 64, group_size, bits, act_order, zero_low=1, symmetric=symmetric)
    tensors = naive_gptq(codes, zeros, scales, g_idx, bits, v1)
    fmt = "gptq" if v1 else "gptq_v2"
    weight = gptq.unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"],
                              bits=bits, group_size=group_size, checkpoint_format=fmt)
    assert weight.codes.tolist() == codes and weight.zeros.tolist() == zeros and weight.g_idx.tolist() == g_idx
    expected = naive_dequant(codes, zeros, scales, g_idx)
    assert torch.equal(weight.dequantize(), expected)
    q = gptq.to_quantized_weight(weight)
    assert q.scheme == ("w4a16" if bits == 4 else "w8a16")
    assert (q.zeros is None) == symmetric
    assert (q.input_perm is not None) == act_order
    stored_order = expected if q.input_perm is None else expected[:, q.input_perm]
    assert torch.equal(dequantize(q), stored_order)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(quant_matmul(x, q), x @ expected.t(), atol=1e-5, rtol=1e-5)
    # the writer side: the library packs to exactly the naive checkpoint tensors
    packed = gptq.pack_gptq(weight.codes, weight.zeros, weight.scales, weight.g_idx, bits=bits, checkpoint_format=fmt)
    assert all(torch.equal(packed[name], tensors[name]) for name in tensors)


@pytest.mark.parametrize("group_size", [32, -1])
def test_awq_unpacks_naive_tensors_and_multiplies_like_the_naive_weight(group_size):
    codes, zeros, scales, g_idx = random_case(3, 24, 64, group_size, 4, act_order=False)
    tensors = naive_awq(codes, zeros, scales)
    weight = awq.unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size=group_size)
    assert weight.codes.tolist() == codes and weight.zeros.tolist() == zeros
    expected = naive_dequant(codes, zeros, scales, g_idx)
    q = awq.to_quantized_weight(weight)
    assert q.scheme == "w4a16" and q.input_perm is None
    assert torch.equal(dequantize(q), expected)
    packed = awq.pack_awq(weight.codes, weight.zeros, weight.scales)
    assert all(torch.equal(packed[name], tensors[name]) for name in tensors)


@st.composite
def integer_weights(draw, awq_layout: bool = False):
    bits = 4 if awq_layout else draw(st.sampled_from([4, 8]))
    n = draw(st.integers(1, 3)) * 8
    groups = draw(st.integers(1, 3))
    k = groups * draw(st.sampled_from([8, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    v1 = draw(st.booleans())
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32)
    low = 1 if v1 and not awq_layout else 0  # v1 stores zero - 1: zero points 1..2**bits
    zeros = torch.randint(low, 2**bits + low, (n, groups), generator=gen, dtype=torch.int32)
    scales = torch.randn(n, groups, generator=gen).to(torch.float16)
    g_idx = torch.randint(0, groups, (k,), generator=gen)
    return bits, codes, zeros, scales, g_idx, "gptq" if v1 else "gptq_v2"


@settings(max_examples=40, deadline=None)
@given(integer_weights())
def test_gptq_pack_and_unpack_are_inverses(case):
    bits, codes, zeros, scales, g_idx, fmt = case
    group_size = -1 if zeros.shape[1] == 1 else codes.shape[1] // zeros.shape[1]
    packed = gptq.pack_gptq(codes, zeros, scales, g_idx, bits=bits, checkpoint_format=fmt)
    weight = gptq.unpack_gptq(**packed, bits=bits, group_size=group_size, checkpoint_format=fmt)
    assert torch.equal(weight.codes, codes) and torch.equal(weight.zeros, zeros)
    assert torch.equal(weight.scales, scales) and torch.equal(weight.g_idx, g_idx)
    again = gptq.pack_gptq(weight.codes, weight.zeros, weight.scales, weight.g_idx, bits=bits, checkpoint_format=fmt)
    assert all(torch.equal(again[name], packed[name]) for name in packed)


@settings(max_examples=40, deadline=None)
@given(integer_weights(awq_layout=True), st.integers(-(2**31), 2**31 - 1))
def test_awq_pack_and_unpack_are_inverses(case, word_seed):
    _, codes, zeros, scales, _, _ = case
    group_size = codes.shape[1] // zeros.shape[1]
    packed = awq.pack_awq(codes, zeros, scales)
    weight = awq.unpack_awq(**packed, group_size=group_size)
    assert torch.equal(weight.codes, codes) and torch.equal(weight.zeros, zeros)
    # any int32 words (sign bit included) survive unpack -> pack
    words = torch.full_like(packed["qweight"], word_seed)
    back = awq.pack_awq(awq.unpack_awq(words, packed["qzeros"], scales.t(), group_size=group_size).codes,
                        zeros, scales)
    assert torch.equal(back["qweight"], words)


def test_asymmetric_int8_and_v1_zero_16_are_refused():
    codes, zeros, scales, g_idx = random_case(4, 8, 32, 16, 8, act_order=False)
    zeros[0][0] = 127
    tensors = naive_gptq(codes, zeros, scales, g_idx, 8, v1=False)
    weight = gptq.unpack_gptq(**tensors, bits=8, group_size=16, checkpoint_format="gptq_v2")
    with pytest.raises(PrequantizedFormatError, match="asymmetric 8-bit"):
        gptq.to_quantized_weight(weight)
    codes, zeros, scales, g_idx = random_case(4, 8, 32, 16, 4, act_order=False, zero_low=1)
    tensors = naive_gptq(codes, zeros, scales, g_idx, 4, v1=True)
    tensors["qzeros"][0, 0] |= 0xF  # stored 15 = zero point 16 in v1
    weight = gptq.unpack_gptq(**tensors, bits=4, group_size=16, checkpoint_format="gptq")
    assert int(weight.zeros[0, 0]) == 16
    with pytest.raises(PrequantizedFormatError, match="0..15"):
        gptq.to_quantized_weight(weight)


def test_malformed_tensors_are_refused():
    codes, zeros, scales, g_idx = random_case(5, 8, 32, 16, 4, act_order=False)
    t = naive_gptq(codes, zeros, scales, g_idx, 4, v1=False)
    with pytest.raises(PrequantizedFormatError, match="scales has shape"):
        gptq.unpack_gptq(t["qweight"], t["qzeros"], t["scales"][:1], t["g_idx"], bits=4, group_size=16)
    with pytest.raises(PrequantizedFormatError, match="qzeros has shape"):
        gptq.unpack_gptq(t["qweight"], t["qzeros"][:, :0], t["scales"], t["g_idx"], bits=4, group_size=16)
    with pytest.raises(PrequantizedFormatError, match="bits=3"):
        gptq.unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=3, group_size=16)
    with pytest.raises(PrequantizedFormatError, match="g_idx values"):
        gptq.unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"] + 2, bits=4, group_size=16)
    with pytest.raises(PrequantizedFormatError, match="int32"):
        gptq.unpack_gptq(t["qweight"].float(), t["qzeros"], t["scales"], None, bits=4, group_size=16)
    uneven = gptq.unpack_gptq(t["qweight"], t["qzeros"], t["scales"], torch.zeros(32, dtype=torch.int32),
                              bits=4, group_size=16)
    with pytest.raises(PrequantizedFormatError, match="exactly 16"):
        gptq.to_quantized_weight(uneven)
    a = naive_awq(codes, zeros, scales)
    with pytest.raises(PrequantizedFormatError, match="must divide"):
        awq.unpack_awq(a["qweight"], a["qzeros"], a["scales"], group_size=12)
    with pytest.raises(PrequantizedFormatError, match="qzeros has shape"):
        awq.unpack_awq(a["qweight"], a["qzeros"][:, :0], a["scales"], group_size=16)


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
               "checkpoint_format": "gptq_v2"}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def test_quantization_config_parses_gptq_and_awq():
    q = parse_quantization_config(GPTQ_CONFIG, (64, 128))
    assert (q.method, q.bits, q.group_size, q.desc_act, q.sym, q.checkpoint_format, q.scheme) == (
        "gptq", 4, 32, True, False, "gptq_v2", "w4a16")
    assert parse_quantization_config({"quant_method": "gptq", "bits": 8, "group_size": -1}).scheme == "w8a16"
    a = parse_quantization_config({**AWQ_CONFIG, "version": "GEMM"}, (64,))
    assert (a.method, a.bits, a.group_size, a.scheme) == ("awq", 4, 32, "w4a16")
    assert parse_quantization_config(None) is None


@pytest.mark.parametrize(("config", "message"), [
    ({**GPTQ_CONFIG, "bits": 3}, "bits=3"),
    ({**GPTQ_CONFIG, "bits": True}, "must be an integer"),
    ({**GPTQ_CONFIG, "bits": 8}, "asymmetric 8-bit"),
    ({**GPTQ_CONFIG, "group_size": 48}, "does not divide"),
    ({**GPTQ_CONFIG, "group_size": 0}, "group_size=0"),
    ({**GPTQ_CONFIG, "group_size": 10**9}, "group_size="),
    ({**GPTQ_CONFIG, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**GPTQ_CONFIG, "desc_act": "yes"}, "desc_act"),
    ({**GPTQ_CONFIG, "lm_head": True}, "lm_head"),
    ({**AWQ_CONFIG, "version": "gemv"}, "version='gemv'"),
    ({**AWQ_CONFIG, "bits": 8}, "bits=8"),
    ({**AWQ_CONFIG, "zero_point": False}, "zero_point"),
    ({**AWQ_CONFIG, "modules_to_not_convert": ["visual"]}, "modules_to_not_convert"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ([], "must be an object"),
])
def test_quantization_config_refusals_are_one_line(config, message):
    with pytest.raises(ModelLoadError, match=message) as info:
        parse_quantization_config(config, (64, 128))
    assert "\n" not in str(info.value)
