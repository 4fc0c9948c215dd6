"""GPTQ / AWQ checkpoints load into flashllm and compute exactly what their dequantized float weights do.

Each checkpoint is made here: the tiny model's float linears are quantized by a small quantizer in
this file and packed by packers written from the published layouts (slot by slot, not through the
library), and a float twin holds the weights those integers stand for. Logits of the two must
agree to float32 rounding.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.linear import LinearBase
from flashllm.models.loader import load_model
from flashllm.quant.spec import weight_quant_spec
from flashllm.sampling_params import SamplingParams
from flashllm.testing.packed_quant import dequantized, pack_awq, pack_gptq, quantize
from flashllm.testing.tiny_models import build_tiny_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = 16
# projections fused over one input: GPTQ's act order of that input is the same for all of them
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def write_pair(float_dir: Path, out: Path, qconfig: dict, seed: int = 0) -> tuple[Path, Path]:
    """(quantized checkpoint dir, float twin dir) made from the float tiny model in float_dir."""
    method, bits, group = qconfig["quant_method"], qconfig["bits"], qconfig["group_size"]
    sym, act_order = qconfig.get("sym", method == "gptq"), qconfig.get("desc_act", False)
    v1 = qconfig.get("checkpoint_format", "gptq") == "gptq"
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(float_dir / "model.safetensors")
    quant, twin, orders = {}, {}, {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            quant[name] = twin[name] = tensor
            continue
        # projections of one input (q/k/v, gate/up) share its order, as GPTQ's shared Hessian gives them
        module, proj = prefix.rsplit(".", 1)
        source = f"{module}.{SHARED_INPUT.get(proj, proj)}"
        if source not in orders:
            k = tensor.shape[1]
            orders[source] = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        codes, zeros, scales, g_idx = quantize(tensor.float(), bits, group, sym, orders[source])
        twin[name] = dequantized(codes, zeros, scales, g_idx)
        packed = pack_awq(codes, zeros, scales) if method == "awq" else pack_gptq(codes, zeros, scales, g_idx, bits, v1)
        quant.update({f"{prefix}.{key}": value for key, value in packed.items()})
    dirs = []
    for kind, weights in (("quant", quant), ("twin", twin)):
        target = out / kind
        target.mkdir(parents=True)
        config = json.loads((float_dir / "config.json").read_text())
        if kind == "quant":
            config["quantization_config"] = qconfig
        (target / "config.json").write_text(json.dumps(config))
        save_file(weights, target / "model.safetensors")
        dirs.append(target)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory) -> dict[str, Path]:
    return {p: build_tiny_model(tmp_path_factory.mktemp(p), p, seed=3, tokenizer=False) for p in ("llama", "qwen2")}


def _gptq(bits, group, desc_act, fmt, sym=True):
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": fmt}


CASES = [
    ("llama", _gptq(4, 32, False, "gptq", sym=False)),
    ("llama", _gptq(4, 32, True, "gptq_v2", sym=False)),
    ("qwen2", _gptq(4, -1, False, "gptq")),
    ("llama", _gptq(4, 32, True, "gptq")),
    ("llama", _gptq(8, 32, True, "gptq_v2")),
    ("qwen2", _gptq(8, -1, False, "gptq")),
    ("llama", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
    ("qwen2", {"quant_method": "awq", "bits": 4, "group_size": -1, "zero_point": True, "version": "gemm"}),
]


def _load(model_dir: Path, ops, registry, quant=None):
    return load_model(model_dir, ops, torch.float32, "cpu", registry, progress=False, quant=quant)[0]


def _logits(model, paged_driver) -> list[torch.Tensor]:
    driver = paged_driver(model, BLOCK, 16)
    seqs = [driver.add_sequence() for _ in range(2)]
    gen = torch.Generator().manual_seed(7)
    first = driver.step([(seqs[0], torch.randint(0, 256, (21,), generator=gen).tolist()),
                         (seqs[1], torch.randint(0, 256, (5,), generator=gen).tolist())])
    return first + driver.step([(seqs[0], [3]), (seqs[1], [9, 11])])


@pytest.mark.parametrize(("preset", "qconfig"), CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(str(c.get(k)) for k in ("quant_method", "bits", "group_size", "desc_act",
                                                          "checkpoint_format")))
def test_prequantized_logits_match_the_dequantized_float_model(
    float_dirs, tmp_path, ops, model_registry, paged_driver, preset, qconfig
):
    quant_dir, twin_dir = write_pair(float_dirs[preset], tmp_path, qconfig)
    model = _load(quant_dir, ops, model_registry)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    scheme = "w4a16" if qconfig["bits"] == 4 else "w8a16"
    assert all(m.qweight.scheme == scheme and m.weight is None for m in linears)
    assert any(m.qweight.input_perm is not None for m in linears) == qconfig.get("desc_act", False)
    reference = _logits(_load(twin_dir, ops, model_registry), paged_driver)
    for got, want in zip(_logits(model, paged_driver), reference, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("index", [1, 6])
def test_greedy_generation_matches_the_float_twin(float_dirs, tmp_path, index, monkeypatch):
    # exact fp32 activations: the cpu default for int4 weights rounds them to int8 per block (its own
    # conformance tests hold it to the reference on the rounded inputs), which may flip a near-tie
    monkeypatch.setenv("FLASHLLM_CPU_INT4_ACTIVATIONS", "fp32")
    preset, qconfig = CASES[index]
    quant_dir, twin_dir = write_pair(float_dirs[preset], tmp_path, qconfig)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 99, 3], [200, 1, 42]]
    outputs = []
    for model_dir in (quant_dir, twin_dir):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=32)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert all(len(tokens) == 8 for tokens in outputs[0])
    assert outputs[0] == outputs[1]


def _rewrite(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file({name: t.contiguous() for name, t in tensors.items()}, path)


def _broken(float_dirs, tmp_path, qconfig, edit) -> Path:
    quant_dir, _ = write_pair(float_dirs["llama"], tmp_path, qconfig)
    _rewrite(quant_dir, edit)
    return quant_dir


ATTN = "model.layers.0.self_attn"


@pytest.mark.parametrize(("qconfig", "edit", "message"), [
    (CASES[1][1], lambda t: t.pop(f"{ATTN}.o_proj.g_idx"), "missing g_idx"),
    (CASES[0][1], lambda t: t.pop(f"{ATTN}.q_proj.qzeros"), "missing qzeros"),
    (CASES[0][1], lambda t: t.update({f"{ATTN}.k_proj.qweight": t[f"{ATTN}.k_proj.qweight"][:4]}), "scales has shape"),
    (CASES[0][1], lambda t: t.update({f"{ATTN}.k_proj.scales": t[f"{ATTN}.k_proj.scales"][:, :8],
                                      f"{ATTN}.k_proj.qzeros": t[f"{ATTN}.k_proj.qzeros"][:, :1],
                                      f"{ATTN}.k_proj.qweight": t[f"{ATTN}.k_proj.qweight"][:, :8]}),
     r"unpacks to a \(8, 64\) weight"),
    (CASES[1][1], lambda t: t.update({f"{ATTN}.v_proj.g_idx": t[f"{ATTN}.v_proj.g_idx"].flip(0)}), "g_idx"),
    (CASES[6][1], lambda t: t.update({f"{ATTN}.o_proj.weight": torch.zeros(64, 64)}), "leave some linears unquantized"),
])
def test_broken_checkpoints_are_refused(float_dirs, tmp_path, ops, model_registry, qconfig, edit, message):
    quant_dir = _broken(float_dirs, tmp_path, qconfig, edit)
    with pytest.raises(ModelLoadError, match=message) as info:
        _load(quant_dir, ops, model_registry)
    assert "\n" not in str(info.value)


def test_quant_type_must_match_the_checkpoint(float_dirs, tmp_path, ops, model_registry):
    quant_dir, _ = write_pair(float_dirs["llama"], tmp_path, CASES[0][1])
    with pytest.raises(ModelLoadError, match="already gptq 4-bit"):
        _load(quant_dir, ops, model_registry, weight_quant_spec("weight_only_int8"))
    with pytest.raises(ModelLoadError, match="group size 64"):
        _load(quant_dir, ops, model_registry, weight_quant_spec("w4a16", 64))
    model = _load(quant_dir, ops, model_registry, weight_quant_spec("w4a16_asym", 32))
    assert all(m.qweight.scheme == "w4a16" for m in model.modules() if isinstance(m, LinearBase))


def test_unknown_quant_method_is_refused(float_dirs, tmp_path, ops, model_registry):
    model_dir = tmp_path / "m"
    shutil.copytree(float_dirs["llama"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="version='gemv'"):
        _load(model_dir, ops, model_registry)


def test_the_op_table_is_resolved_for_the_checkpoint_scheme(float_dirs, tmp_path, monkeypatch):
    """Backends claim quant_matmul per scheme, so the engine must ask for the checkpoint's one, not --quant_type's."""
    import flashllm.core.builder as builder

    preset, qconfig = CASES[1]
    quant_dir, _ = write_pair(float_dirs[preset], tmp_path, qconfig)
    requests = []
    real = builder.resolve_ops

    def spy(selection, request, **kwargs):
        requests.append(request)
        return real(selection, request, **kwargs)

    monkeypatch.setattr(builder, "resolve_ops", spy)
    LLM(str(quant_dir), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=32)
    assert [r.quant for r in requests] == [load_hf_config_scheme(quant_dir)]


def load_hf_config_scheme(model_dir: Path) -> str:
    """The scheme a GPTQ/AWQ config.json implies, read independently of the loader: 4 bits -> w4a16, 8 -> w8a16."""
    import json

    bits = json.loads((model_dir / "config.json").read_text())["quantization_config"]["bits"]
    return {4: "w4a16", 8: "w8a16"}[bits]
