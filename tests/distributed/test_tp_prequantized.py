"""GPTQ / AWQ checkpoints under tensor parallelism: each rank holds its slice of the packed layers, and two
ranks give the tokens and logprobs one rank gives; splits that cannot be made are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm import LLM, SamplingParams
from flashllm.backends.reference import reference_op_table
from flashllm.models.hf_config import CheckpointQuant, ModelLoadError
from flashllm.models.layers.linear import ColumnParallelLinear, LinearBase
from flashllm.models.layers.prequantized import PrequantizedLinear
from flashllm.ops.quant_matmul import dequantize
from flashllm.quant import awq, gptq
from flashllm.testing.loading import load_flashllm
from flashllm.testing.packed_quant import quantize
from flashllm.testing.tiny_models import build_tiny_model

STEPS = 32
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(40)], [5, 17, 99, 3], [(5 * i + 1) % 250 + 1 for i in range(23)]]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")  # their input features are split over the ranks
# projections reading one input share its act order, as GPTQ's shared Hessian gives them
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _gptq(bits: int, group: int, desc_act: bool, fmt: str, sym: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": fmt}


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
# act order "ranks": a random order of the input features that keeps each rank's half of a
# row-parallel layer's inputs to itself (so its groups are whole on one rank); "any": a random order
CASES = {
    "gptq-4bit-v1-asym": (_gptq(4, 32, False, "gptq", sym=False), None),
    "gptq-8bit-act-order": (_gptq(8, 32, True, "gptq_v2", sym=True), "ranks"),
    "gptq-4bit-per-channel-act-order": (_gptq(4, -1, True, "gptq_v2", sym=False), "any"),
    "awq-4bit": (AWQ, None),
}


def _order(k: int, act_order: str | None, row_parallel: bool, gen: torch.Generator) -> torch.Tensor:
    if act_order is None:
        return torch.arange(k)
    if act_order == "ranks" and row_parallel:
        half = k // 2
        return torch.cat([torch.randperm(half, generator=gen), half + torch.randperm(half, generator=gen)])
    return torch.randperm(k, generator=gen)


def write_quantized(float_dir: Path, out: Path, qconfig: dict, act_order: str | None) -> Path:
    """A GPTQ / AWQ checkpoint of the float tiny model in float_dir, packed by flashllm.quant."""
    method, bits, group = qconfig["quant_method"], qconfig["bits"], qconfig["group_size"]
    v1 = method == "gptq" and qconfig["checkpoint_format"] == "gptq"
    gen = torch.Generator().manual_seed(0)
    tensors, orders = {}, {}
    for name, tensor in load_file(float_dir / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        module, _, proj = prefix.rpartition(".")
        if not (name.endswith(".weight") and proj in LINEARS):
            tensors[name] = tensor
            continue
        source = f"{module}.{SHARED_INPUT.get(proj, proj)}"
        if source not in orders:
            orders[source] = _order(tensor.shape[1], act_order, proj in ROW_PARALLEL, gen)
        codes, zeros, scales, g_idx = quantize(tensor.float(), bits, group, qconfig.get("sym", False), orders[source],
                                               min_zero=1 if v1 else 0)
        if method == "awq":
            packed = awq.pack_awq(codes, zeros, scales)
        else:
            packed = gptq.pack_gptq(codes, zeros, scales, g_idx, bits=bits, checkpoint_format=qconfig["checkpoint_format"])
        tensors.update({f"{prefix}.{key}": value.contiguous() for key, value in packed.items()})
    out.mkdir(parents=True)
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("float"), "llama", seed=3, tokenizer=False)


@pytest.fixture(scope="module")
def quant_dirs(float_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant")
    return {name: write_quantized(float_dir, root / name, qconfig, act_order)
            for name, (qconfig, act_order) in CASES.items()}


def _load(model_dir: Path, tp_rank: int = 0, tp_size: int = 1) -> torch.nn.Module:
    return load_flashllm(model_dir, tp_rank=tp_rank, tp_size=tp_size)


def _dense(module: LinearBase) -> torch.Tensor:
    """The (N, K) fp32 weight a packed layer multiplies by, input features in checkpoint order."""
    weight = dequantize(module.qweight).float()
    perm = module.qweight.input_perm
    if perm is None:
        return weight
    unpermuted = torch.empty_like(weight)
    unpermuted[:, perm] = weight
    return unpermuted


def _joined(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Two ranks' weights of layer `name` put back in the one-rank layout of the tiny llama."""
    if name.endswith(ROW_PARALLEL):
        return torch.cat(parts, dim=1)
    sizes = [32, 16, 16] if name.endswith("qkv_proj") else [64, 64]  # per rank: q | k | v, gate | up
    return torch.cat([torch.cat([p.split(sizes)[i] for p in parts]) for i in range(len(sizes))])


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_holds_its_slice_of_the_packed_layers(quant_dirs: dict[str, Path], case: str) -> None:
    whole = {n: m for n, m in _load(quant_dirs[case]).named_modules() if isinstance(m, LinearBase)}
    ranks = [dict(_load(quant_dirs[case], rank, 2).named_modules()) for rank in range(2)]
    assert len(whole) == 8
    for name, module in whole.items():
        parts = [_dense(rank[name]) for rank in ranks]
        assert all(rank[name].qweight.scheme == module.qweight.scheme for rank in ranks)
        torch.testing.assert_close(_joined(name, parts), _dense(module), rtol=0, atol=0)


def _run(model_dir: Path, tp: int) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp, block_size=16,
              num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    try:
        outputs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outputs]


@pytest.mark.parametrize("case", ["gptq-4bit-v1-asym", "gptq-8bit-act-order", "awq-4bit"])
def test_two_ranks_match_one(quant_dirs: dict[str, Path], case: str, monkeypatch: pytest.MonkeyPatch,
                             exact_w8_products: None) -> None:
    # exact fp32 activations (inherited by the ranks): the cpu default rounds them to int8 per block of the
    # rank's own input slice, an approximation that is not the same over one rank's K and two ranks' halves;
    # 8-bit per-channel products of 16+ tokens round them to bf16 on AVX512-BF16 CPUs, which turns the
    # all-reduce's fp32 order into rounding-sized steps (exact_w8_products keeps them fp32)
    monkeypatch.setenv("FLASHLLM_CPU_INT4_ACTIVATIONS", "fp32")
    one, two = _run(quant_dirs[case], 1), _run(quant_dirs[case], 2)
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one, two, strict=True):
        assert len(tokens1) == STEPS
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4


def test_act_order_groups_spanning_ranks_are_refused_for_row_parallel_layers(
    float_dir: Path, tmp_path: Path
) -> None:
    model_dir = write_quantized(float_dir, tmp_path / "m", _gptq(4, 32, True, "gptq_v2", sym=True), "any")
    _load(model_dir)  # one rank holds every group whole
    with pytest.raises(ModelLoadError, match=r"o_proj: .*mix input features of different tensor-parallel ranks"
                                             r".*desc_act=false") as info:
        _load(model_dir, 1, 2)
    assert "\n" not in str(info.value)


def test_groups_larger_than_a_ranks_input_features_are_refused(float_dir: Path, tmp_path: Path) -> None:
    model_dir = write_quantized(float_dir, tmp_path / "m", dict(AWQ, group_size=64), None)
    _load(model_dir)
    # o_proj: 64 input features, 32 per rank, and groups of 64
    with pytest.raises(ModelLoadError, match=r"o_proj: its 32 input features per rank .* quantization groups of 64"):
        _load(model_dir, 0, 2)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_output_features_that_cut_a_packed_word_are_refused(method: str) -> None:
    # 24 output features over two ranks: 12 per rank, not whole words of eight 4-bit codes
    layer = ColumnParallelLinear(32, 24, False, reference_op_table(), torch.float32, torch.device("cpu"), 1, 2)
    quant = CheckpointQuant(method, 4, 32, checkpoint_format="gptq" if method == "gptq" else "gemm")
    codes, zeros, scales = torch.randint(0, 16, (24, 32)), torch.full((24, 1), 8), torch.ones(24, 1)
    packed = gptq.pack_gptq(codes, zeros, scales, bits=4) if method == "gptq" else awq.pack_awq(codes, zeros, scales)
    collector = PrequantizedLinear("layer", layer, quant)
    with pytest.raises(ModelLoadError, match=r"output features \[12, 24\) of 2 ranks do not fall on whole 8-feature"):
        for suffix in ("scales", "qzeros", "qweight"):
            collector.add(suffix, None, packed[suffix])
