"""Quantized models end to end (weight-only int8/int4, A8W8, FP8) on a tiny model against the float model.

The model is a tiny Qwen2 (qkv bias, tied embeddings) that has memorized a few fixed
continuations, so the float model's next-token choices on them are confident, as a trained
model's are; on a random-weight model nearly every top-1 is a coin toss and agreement would
measure noise. Logits are compared teacher-forced (the same tokens go into both models).

Bounds (relative logit error ||L_q - L_f|| / ||L_f|| over all positions). Round-to-nearest leaves
each weight an error uniform in +-s/2, RMS s/sqrt(12):
  int8 per channel: s = max|w_row|/127, max|w_row| ~ 3.5 sigma for 64-128 inputs -> ~0.8% of
    the weights' RMS per linear; the 8 linears a token passes (4 per layer, 2 layers) add in
    quadrature -> ~2.3%. Gate at 5%.
  int4 group 32: s = max|w_group|/7, max ~ 2.5 sigma over 32 -> ~10% per linear -> ~29%
    (asymmetric: range/15, a little less). Gate at 45%.
  a8w8: the int8 weight error above plus per-token int8 activations, s = max|x_t|/127: the same
    ~0.8% per linear for Gaussian-like inputs (more for the heavier-tailed SiLU*up input of
    down_proj), so ~1.2% per linear and ~3.5% over the 8. Gate at 8%.
  fp8 (e4m3, 3 mantissa bits): rounding error up to 2**-4 relative, RMS ~2.5% on each operand ->
    ~3.5% per linear, ~10% over the 8. Gate at 20%; the memorized margins keep top-1 everywhere.
Measured on this model: w8a16 0.8%, a8w8 1.5%, fp8 4.9% (the estimates above are upper-end).
The memorized continuations keep a wide top-1 margin (training stops at loss < 0.02), so int8
must agree everywhere and int4 almost everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.cli.predict import main as predict_main
from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.linear import LinearBase
from flashllm.models.weight_bytes import weight_bytes
from flashllm.quant import quantize_weight
from flashllm.quant.spec import QuantConfigError, WeightQuantSpec
from flashllm.registry.resolve import PrecisionError
from flashllm.sampling_params import SamplingParams
from flashllm.testing.loading import load_flashllm
from flashllm.testing.memorize import memorize
from flashllm.testing.tiny_models import build_tiny_model

BLOCK = 16
# quant_type, group size, max relative logit error, min top-1 agreement, max mean KL (nats)
SCHEMES = [
    ("weight_only_int8", -1, 0.05, 1.0, 1e-3),
    ("w4a16", 32, 0.45, 0.9, 0.05),
    ("w4a16_asym", 32, 0.45, 0.9, 0.05),
    ("weight_only_int4", 64, 0.45, 0.9, 0.05),
    ("a8w8", -1, 0.08, 1.0, 2e-3),
]


@pytest.fixture(scope="module")
def pairs() -> list[tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (n,), generator=gen).tolist(), torch.randint(0, 256, (20,), generator=gen).tolist())
            for n in (3, 6, 11, 17)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, pairs) -> Path:
    path = build_tiny_model(tmp_path_factory.mktemp("qwen2-memorized"), "qwen2", seed=1, tokenizer=False)
    assert memorize(path, pairs, steps=300) < 0.05
    return path


def _llm(model_dir: Path, quant_type: str = "none", group_size: int = -1) -> LLM:
    return LLM(str(model_dir), quant_type=quant_type, group_size=group_size, device="cpu", dtype="float32",
               block_size=BLOCK, num_kv_blocks=32)


def teacher_forced_logits(llm: LLM, pairs, paged_driver) -> torch.Tensor:
    """Logits predicting each continuation token, (sum of continuation lengths, V), one prefill per pair."""
    rows = []
    for prompt, continuation in pairs:
        driver = paged_driver(llm.engine.parts.model, BLOCK, 8)
        seq = driver.add_sequence()
        logits = driver.step([(seq, prompt + continuation)])[0]
        rows.append(logits[len(prompt) - 1: -1])
    return torch.cat(rows)


@pytest.fixture(scope="module")
def float_llm(model_dir: Path) -> LLM:
    return _llm(model_dir)


@pytest.mark.parametrize(("quant_type", "group_size", "max_rel", "min_top1", "max_kl"), SCHEMES)
def test_quantized_logits_and_greedy_tokens_track_the_float_model(
    float_llm, model_dir, pairs, paged_driver, quant_type, group_size, max_rel, min_top1, max_kl
) -> None:
    reference = teacher_forced_logits(float_llm, pairs, paged_driver)
    assert (reference.argmax(-1) == torch.tensor([t for _, c in pairs for t in c])).all(), "memorization failed"
    llm = _llm(model_dir, quant_type, group_size)
    assert llm.engine.parts.ops.sources["quant_matmul"] == "cpu"
    logits = teacher_forced_logits(llm, pairs, paged_driver)
    rel = float((logits - reference).norm() / reference.norm())
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    kl = float(torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                          reduction="batchmean"))
    assert 0 < rel <= max_rel, f"relative logit error {rel:.4f}"
    assert top1 >= min_top1 and kl <= max_kl, (top1, kl)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [p for p, _ in pairs]
    expected = [o.outputs[0].token_ids for o in float_llm.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same = sum(a == b for e, g in zip(expected, got, strict=True) for a, b in zip(e, g, strict=True))
    assert same / sum(map(len, expected)) >= min_top1


def test_int8_is_closer_than_int4(float_llm, model_dir, pairs, paged_driver) -> None:
    """The metric tells schemes apart: a finer grid gives a smaller logit error, and quantizing the
    activations too (a8w8) adds to the int8 weights' error (measured ~0.8% vs ~1.5%)."""
    reference = teacher_forced_logits(float_llm, pairs, paged_driver)
    errors = [float((teacher_forced_logits(_llm(model_dir, q, g), pairs, paged_driver) - reference).norm())
              for q, g in (("w8a16", -1), ("a8w8", -1), ("w4a16", 32))]
    assert errors[0] * 4 < errors[2]
    assert errors[0] * 1.2 < errors[1] < errors[2]


def _expected_linear_bytes(model: torch.nn.Module, bytes_per_weight: float, group_size: int, asym: bool) -> int:
    """Data + fp32 scales (+ uint8 zero points) of every linear layer, from its shape alone."""
    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            n, k = module.output_size_per_partition, module.input_size_per_partition
            groups = 1 if group_size == -1 else k // group_size
            total += int(n * k * bytes_per_weight) + n * groups * (4 + (1 if asym else 0))
    return total


@pytest.mark.parametrize(("quant_type", "group_size", "bytes_per_weight", "asym", "max_ratio"), [
    ("w8a16", -1, 1, False, 0.55),      # about half of bf16
    ("w4a16", 32, 0.5, False, 0.33),    # a quarter plus a 4-byte scale per 32 weights
    ("w4a16_asym", 64, 0.5, True, 0.30),
    ("a8w8", -1, 1, False, 0.55),       # int8 weights; activations are quantized per call, not stored
])
def test_weight_bytes_per_scheme(float_llm, model_dir, quant_type, group_size, bytes_per_weight, asym, max_ratio):
    float_model = float_llm.engine.parts.model
    shapes = [(m.output_size_per_partition, m.input_size_per_partition)
              for m in float_model.modules() if isinstance(m, LinearBase)]
    float_bytes = weight_bytes(float_model)
    assert float_bytes.linear == 4 * sum(n * k for n, k in shapes)  # fp32 model
    model = _llm(model_dir, quant_type, group_size).engine.parts.model
    report = weight_bytes(model)
    assert all(m.weight is None for m in model.modules() if isinstance(m, LinearBase)), "float weights kept"
    assert report.linear == _expected_linear_bytes(model, bytes_per_weight, group_size, asym)
    assert report.other == float_bytes.other  # embeddings, norms and biases stay as they were
    ratio_to_bf16 = report.linear / (2 * sum(n * k for n, k in shapes))
    assert bytes_per_weight / 2 < ratio_to_bf16 <= max_ratio


def test_bad_quant_settings_fail_before_or_at_load(model_dir) -> None:
    with pytest.raises(QuantConfigError, match="one weight scale per output channel"):
        _llm(model_dir, "a8w8", 64)
    with pytest.raises(PrecisionError, match="sm89"):
        _llm(model_dir, "fp8")
    with pytest.raises(ValueError, match="does not divide in_features 64"):
        _llm(model_dir, "w4a16", 48)


def test_predict_cli_passes_the_quant_flags(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", "llama", seed=2)
    out = tmp_path / "out.jsonl"
    base = ["--model_name_or_path", str(model), "--benchmark", "--batch_size", "1", "--src_length", "8",
            "--max_length", "3", "--output_file", str(out), "--device", "cpu", "--num_kv_blocks", "16",
            "--block_size", "16", "--total_max_length", "64"]
    assert predict_main([*base, "--quant_type", "weight_only_int4", "--weightonly_group_size", "32"]) == 0
    assert json.loads(out.read_text().splitlines()[0])["finish_reason"] == "length"
    with pytest.raises(ValueError, match="does not divide"):  # the group size reached the layers
        predict_main([*base, "--quant_type", "weight_only_int8", "--weightonly_group_size", "48"])
    with pytest.raises(PrecisionError, match="sm89"):  # fp8 parses, and this CPU says where it runs
        predict_main([*base, "--quant_type", "fp8"])
    assert predict_main([*base, "--quant_type", "a8w8", "--weightonly_group_size", "64"]) == 2


# -- FP8 (which this CPU refuses, so the reference op table runs it) and pre-quantized checkpoints --


def _reference_model(model_dir: Path, quant: WeightQuantSpec | None) -> torch.nn.Module:
    return load_flashllm(model_dir, quant=quant)


def _logit_metrics(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, float]:
    rel = float((logits - reference).norm() / reference.norm())
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    kl = float(torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                          reduction="batchmean"))
    return rel, top1, kl


class _Holder:
    """What teacher_forced_logits needs of an LLM: .engine.parts.model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.engine = type("E", (), {"parts": type("P", (), {"model": model})()})()


def test_fp8_logits_track_the_float_model(float_llm, model_dir, pairs, paged_driver) -> None:
    """Teacher-forced top-1 everywhere = greedy decoding follows the float model's tokens."""
    reference = teacher_forced_logits(float_llm, pairs, paged_driver)
    model = _reference_model(model_dir, WeightQuantSpec("fp8"))
    rel, top1, kl = _logit_metrics(teacher_forced_logits(_Holder(model), pairs, paged_driver), reference)
    assert 0 < rel <= 0.2 and top1 == 1.0 and kl <= 0.01, (rel, top1, kl)
    shapes = [(m.output_size_per_partition, m.input_size_per_partition)
              for m in model.modules() if isinstance(m, LinearBase)]
    assert weight_bytes(model).linear == sum(n * k + 4 * n for n, k in shapes)  # e4m3 + fp32 scale per row


# linear -> the input it reads: projections that share an input share their smooth factors
_SMOOTH_GROUPS = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
                  "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}


def _write_prequantized(src: Path, dst: Path, scheme: str) -> dict[str, torch.Tensor]:
    """Copy a float checkpoint with every linear weight smoothed (random factors) and quantized to
    `scheme` in the pre-quantized layout of quant/spec.py; returns the tensors written."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    tensors = load_file(src / "model.safetensors")
    gen, factors = torch.Generator().manual_seed(5), {}
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        prefix, proj = name.removesuffix(".weight"), name.split(".")[-2]
        key = (prefix.rsplit(".", 2)[0], _SMOOTH_GROUPS[proj])
        if key not in factors:
            factors[key] = torch.exp(0.3 * torch.randn(tensors[name].shape[1], generator=gen))
        q = quantize_weight(tensors[name] * factors[key], scheme, smooth=factors[key])
        tensors[name], tensors[prefix + ".weight_scale"] = q.data, q.scales
        tensors[prefix + ".smooth_factor"] = q.smooth.clone()  # safetensors refuses shared storage
    save_file(tensors, dst / "model.safetensors")
    return tensors


@pytest.mark.parametrize("scheme", ["a8w8", "fp8"])
def test_prequantized_smoothquant_checkpoint_loads_without_requantizing(
    float_llm, model_dir, pairs, paged_driver, tmp_path, scheme
) -> None:
    written = _write_prequantized(model_dir, tmp_path / "prequantized", scheme)
    model = _reference_model(tmp_path / "prequantized", WeightQuantSpec(scheme))
    down = model.model.layers[1].mlp.down_proj
    assert torch.equal(down.qweight.data.view(torch.uint8),
                       written["model.layers.1.mlp.down_proj.weight"].view(torch.uint8))
    qkv = model.model.layers[0].self_attn.qkv_proj.qweight
    expected_qkv = torch.cat([written[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.data.view(torch.uint8), expected_qkv.view(torch.uint8))
    assert torch.equal(qkv.smooth, written["model.layers.0.self_attn.q_proj.smooth_factor"])
    reference = teacher_forced_logits(float_llm, pairs, paged_driver)
    rel, top1, kl = _logit_metrics(teacher_forced_logits(_Holder(model), pairs, paged_driver), reference)
    assert rel <= (0.08 if scheme == "a8w8" else 0.2) and top1 == 1.0, (rel, top1, kl)
    # quant_type none dequantizes and divides the factors out: only the weight rounding is left
    dense = _reference_model(tmp_path / "prequantized", None)
    rel_dense, top1_dense, _ = _logit_metrics(teacher_forced_logits(_Holder(dense), pairs, paged_driver), reference)
    assert rel_dense < rel and top1_dense == 1.0, (rel_dense, rel)


def test_prequantized_checkpoint_errors(model_dir, tmp_path) -> None:
    bad = tmp_path / "bad"
    good = _write_prequantized(model_dir, bad, "a8w8")
    k_smooth, down_scale = "model.layers.0.self_attn.k_proj.smooth_factor", "model.layers.0.mlp.down_proj.weight_scale"
    cases = [
        ({k_smooth: good[k_smooth] * 2}, ModelLoadError, "smooth_factor tensors must be identical"),
        ({k_smooth: None}, ModelLoadError, "missing 1 tensor.*k_proj.smooth_factor"),
        ({down_scale: None}, ValueError, "int8 codes but has no weight_scale"),
    ]
    for change, error, message in cases:
        tensors = {n: t for n, t in {**good, **change}.items() if t is not None}
        save_file(tensors, bad / "model.safetensors")
        with pytest.raises(error, match=message):
            _reference_model(bad, WeightQuantSpec("a8w8"))
