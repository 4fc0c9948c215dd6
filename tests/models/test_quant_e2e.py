"""Weight-only int8/int4 end to end: LLM(quant_type=...) on a tiny model against the float model.

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
The memorized continuations keep a wide top-1 margin (training stops at loss < 0.02), so int8
must agree everywhere and int4 almost everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashllm.cli.predict import main as predict_main
from flashllm.llm import LLM
from flashllm.models.layers.linear import LinearBase
from flashllm.quant import weight_bytes
from flashllm.quant.spec import QuantConfigError
from flashllm.sampling_params import SamplingParams
from flashllm.testing.memorize import memorize
from flashllm.testing.tiny_models import build_tiny_model

BLOCK = 16
# quant_type, group size, max relative logit error, min top-1 agreement, max mean KL (nats)
SCHEMES = [
    ("weight_only_int8", -1, 0.05, 1.0, 1e-3),
    ("w4a16", 32, 0.45, 0.9, 0.05),
    ("w4a16_asym", 32, 0.45, 0.9, 0.05),
    ("weight_only_int4", 64, 0.45, 0.9, 0.05),
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
    """The metric tells schemes apart: a finer grid gives a smaller logit error."""
    reference = teacher_forced_logits(float_llm, pairs, paged_driver)
    errors = [float((teacher_forced_logits(_llm(model_dir, q, g), pairs, paged_driver) - reference).norm())
              for q, g in (("w8a16", -1), ("w4a16", 32))]
    assert errors[0] * 4 < errors[1]


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
    with pytest.raises(QuantConfigError, match="not implemented yet"):
        _llm(model_dir, "a8w8")
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
    assert predict_main([*base, "--quant_type", "fp8"]) == 2
