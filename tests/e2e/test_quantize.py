"""`flashllm quantize` on a tiny Llama: each method's checkpoint loads and tracks the float model; algorithm properties.

The model is a tiny Llama (GQA, a trained tokenizer) fine-tuned to memorize a few corpus
sentences, so its next-token choices on them are confident as a trained model's are; on random
weights most top-1 choices are coin tosses. Logits are compared teacher-forced on those sentences.

Bounds (relative logit error ||L_q - L_f|| / ||L_f||; reasoning as in tests/models/test_quant_e2e.py):
round-to-nearest leaves each weight an error of RMS step/sqrt(12).
  int8 per channel (weight_only_int8): step = max|w_row| / 127 -> ~0.8% per linear, ~2.3% over the
    8 linears a token passes (in quadrature). Gate 5%, top-1 must agree everywhere.
  smoothquant (int8 weights + int8 per-token activations): two such roundings per linear -> ~3.3%.
    Gate 8%, top-1 everywhere.
  int4 group 32 (RTN, GPTQ, AWQ): step = max|w_group| / 7 (or range / 15) -> ~10% per linear, ~29%
    in all. Gate 45%; GPTQ and AWQ minimise output error, so their KL must not exceed RTN's by more
    than noise (x1.5). Top-1 >= 90%: the memorized margins are wide (training stops at loss < 0.02).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from flashllm.cli import main
from flashllm.eval.forward import ScoringConfig, load_scoring_parts, window_hidden
from flashllm.models.layers.linear import LinearBase
from flashllm.ptq.calibration import (
    CalibrationDataError,
    StatsRequest,
    collect_stats,
    linear_groups,
    pack_windows,
    read_calibration_texts,
)
from flashllm.ptq.writer import QuantizationConfig, read_checkpoint, write_checkpoint
from flashllm.testing.corpus import CORPUS
from flashllm.testing.memorize import memorize
from flashllm.testing.tiny_models import build_tiny_model

NUM_SAMPLES, SEQ_LEN, GROUP = 12, 64, 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM nibble order, as published
# method, extra flags, quant_type to load with, max relative logit error, min top-1, max KL (nats)
METHODS = [
    ("weight_only_int8", (), None, 0.05, 1.0, 1e-3),
    ("smoothquant", (), "a8w8", 0.08, 1.0, 2e-3),
    ("weight_only_int4", ("--group-size", str(GROUP)), None, 0.45, 0.9, 0.05),
    ("gptq", ("--group-size", str(GROUP)), None, 0.45, 0.9, 0.05),
    ("gptq", ("--group-size", str(GROUP), "--desc-act"), None, 0.45, 0.9, 0.05),
    ("awq", ("--group-size", str(GROUP)), None, 0.45, 0.9, 0.05),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation, which on a busy 2-core machine costs
    far more than the work (measured: 60x slower AWQ search)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quantize")


@pytest.fixture(scope="module")
def pairs(workdir: Path) -> list[tuple[list[int], list[int]]]:
    from transformers import AutoTokenizer

    model = build_tiny_model(workdir / "model", "llama", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in CORPUS[:4]]
    return [(ids[:4], ids[4:20]) for ids in encoded]


@pytest.fixture(scope="module")
def model_dir(workdir: Path, pairs) -> Path:
    assert memorize(workdir / "model", pairs, steps=300) < 0.05
    return workdir / "model"


@pytest.fixture(scope="module")
def calib(workdir: Path) -> Path:
    path = workdir / "calib.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def quantized(workdir: Path, model_dir: Path, calib: Path) -> Callable[..., Path]:
    """(method, *flags) -> output directory, quantized once per module."""
    done: dict[tuple[str, ...], Path] = {}

    def get(method: str, *flags: str) -> Path:
        key = (method, *flags)
        if key not in done:
            out = workdir / "-".join(k.strip("-") for k in key)
            argv = ["quantize", str(model_dir), "--method", method, "--calib", str(calib), "--num-samples",
                    str(NUM_SAMPLES), "--seq-len", str(SEQ_LEN), "--output", str(out), "--device", "cpu",
                    "--dtype", "float32", "--no-progress", *flags]
            assert main(argv) == 0
            done[key] = out
        return done[key]

    return get


def _parts(model: Path, quant_type: str | None = None):
    return load_scoring_parts(ScoringConfig(str(model), "float32", "cpu", None, quant_type), SEQ_LEN)


def teacher_forced_logits(parts, pairs) -> torch.Tensor:
    """Logits predicting each continuation token, (sum of continuation lengths, V)."""
    rows = []
    for prompt, continuation in pairs:
        hidden = window_hidden(parts, prompt + continuation)
        rows.append(parts.model.compute_logits(hidden[len(prompt) - 1:-1]).float())
    return torch.cat(rows)


@pytest.fixture(scope="module")
def float_logits(model_dir: Path, pairs) -> torch.Tensor:
    logits = teacher_forced_logits(_parts(model_dir), pairs)
    assert (logits.argmax(-1) == torch.tensor([t for _, c in pairs for t in c])).all(), "memorization failed"
    return logits


def _compare(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, float]:
    rel = float((logits - reference).norm() / reference.norm())
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    kl = float(torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                          reduction="batchmean"))
    return rel, top1, kl


@pytest.mark.parametrize(("method", "flags", "quant_type", "max_rel", "min_top1", "max_kl"), METHODS)
def test_quantized_checkpoint_loads_and_tracks_the_float_model(quantized, pairs, float_logits, method, flags,
                                                               quant_type, max_rel, min_top1, max_kl) -> None:
    out = quantized(method, *flags)
    parts = _parts(out, quant_type)
    expected_scheme = {"weight_only_int8": "w8a16", "smoothquant": "a8w8"}.get(method, "w4a16")
    assert {m.qweight.scheme for m in parts.model.modules() if isinstance(m, LinearBase)} == {expected_scheme}
    rel, top1, kl = _compare(teacher_forced_logits(parts, pairs), float_logits)
    assert 0 < rel <= max_rel and top1 >= min_top1 and kl <= max_kl, (rel, top1, kl)
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()


def test_gptq_and_awq_are_no_worse_than_rtn_end_to_end(quantized, pairs, float_logits) -> None:
    kls = {}
    for method in ("weight_only_int4", "gptq", "awq"):
        parts = _parts(quantized(method, "--group-size", str(GROUP)))
        kls[method] = _compare(teacher_forced_logits(parts, pairs), float_logits)[2]
    assert kls["gptq"] <= 1.5 * kls["weight_only_int4"] and kls["awq"] <= 1.5 * kls["weight_only_int4"], kls


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 (..., W) -> (..., W, 8) nibbles, slot i = bits 4i..4i+3 (naive, per the published formats)."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(u >> (4 * i)) & 0xF for i in range(8)], dim=-1)


def test_int4_rtn_written_in_gptq_layout_decodes_to_the_float_weight(quantized, model_dir) -> None:
    """Decoded independently: qweight packs 8 input rows per int32, qzeros 8 columns, v1 zeros stored minus one."""
    out = quantized("weight_only_int4", "--group-size", str(GROUP))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == {**config, "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                      "checkpoint_format": "gptq"}
    original, written = read_checkpoint(model_dir), read_checkpoint(out)
    prefix = "model.layers.1.mlp.down_proj"
    weight = original[f"{prefix}.weight"]  # (N, K)
    codes = _unpack_nibbles(written[f"{prefix}.qweight"]).permute(0, 2, 1).reshape(weight.shape[1], -1).T
    zeros = _unpack_nibbles(written[f"{prefix}.qzeros"]).reshape(-1, weight.shape[0]).T + 1
    scales = written[f"{prefix}.scales"].float().T  # (N, G)
    g = written[f"{prefix}.g_idx"].long()
    assert torch.equal(g, torch.arange(weight.shape[1]) // GROUP)
    dequantized = (codes - zeros[:, g]) * scales[:, g]
    assert prefix + ".weight" not in written
    assert ((dequantized - weight).abs() <= scales[:, g] * 0.5 + 1e-3 * weight.abs().max()).all()


def test_awq_layout_decodes_to_the_scaled_weight_and_norm_absorbs_the_scales(quantized, model_dir) -> None:
    out = quantized("awq", "--group-size", str(GROUP))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == {**config, "quant_method": "awq", "version": "gemm", "zero_point": True, "bits": 4}
    original, written = read_checkpoint(model_dir), read_checkpoint(out)
    layer = "model.layers.0"
    factors = original[f"{layer}.post_attention_layernorm.weight"] / written[f"{layer}.post_attention_layernorm.weight"]
    prefix = f"{layer}.mlp.gate_proj"
    weight = original[f"{prefix}.weight"] * factors[None, :]
    nibbles = _unpack_nibbles(written[f"{prefix}.qweight"])  # (K, N/8, 8)
    codes = torch.empty_like(nibbles)
    codes[..., list(AWQ_ORDER)] = nibbles  # slot i holds column order[i] of its eight
    codes = codes.reshape(weight.shape[1], -1).T
    zero_nibbles = _unpack_nibbles(written[f"{prefix}.qzeros"])
    zeros = torch.empty_like(zero_nibbles)
    zeros[..., list(AWQ_ORDER)] = zero_nibbles
    zeros = zeros.reshape(-1, weight.shape[0]).T
    scales = written[f"{prefix}.scales"].float().T
    g = torch.arange(weight.shape[1]) // GROUP
    dequantized = (codes - zeros[:, g]) * scales[:, g]
    assert ((dequantized - weight).abs() <= scales[:, g] * 0.5 + 1e-3 * weight.abs().max()).all()
    assert not torch.allclose(factors, torch.ones_like(factors)), "AWQ chose s = 1 everywhere: nothing was tested"


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_transformers_reads_the_checkpoint_when_its_kernels_are_installed(quantized, method) -> None:
    from transformers import AutoModelForCausalLM

    out = quantized(method, "--group-size", str(GROUP))
    try:
        model = AutoModelForCausalLM.from_pretrained(out)
    except ImportError as err:  # transformers needs optimum + gptqmodel / autoawq for these formats
        pytest.skip(f"transformers cannot load {method} here: {err}")
    assert model is not None


@pytest.fixture(scope="module")
def calibration(model_dir: Path, calib: Path):
    """(float parts, calibration windows, stats with Hessians, sampled rows and KV maxima, every linear's inputs)."""
    parts = _parts(model_dir)
    ids = [parts.tokenizer.encode(t, add_special_tokens=False) for t in read_calibration_texts(calib)]
    windows = pack_windows(ids, NUM_SAMPLES, SEQ_LEN, parts.tokenizer.eos_token_id)
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, a, name=g.module: inputs.setdefault(name, []).append(a[0].clone()))
             for g in linear_groups(parts.model) for m in [parts.model.get_submodule(g.module)]]
    stats = collect_stats(parts.model, windows, lambda w: window_hidden(parts, w),
                          StatsRequest(hessian=True, max_sample_rows=256, kv=True), progress=False)
    for hook in hooks:
        hook.remove()
    return parts, windows, stats, {name: torch.cat(xs) for name, xs in inputs.items()}


def test_hessian_and_channel_statistics_match_a_direct_computation(calibration) -> None:
    _, _, stats, inputs = calibration
    for name, x in inputs.items():
        entry = stats.linears[name]
        torch.testing.assert_close(entry.hessian, 2 * x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(entry.act_absmax, x.abs().amax(0))
        torch.testing.assert_close(entry.act_mean, x.abs().mean(0), rtol=1e-4, atol=1e-6)
        assert entry.num_tokens == NUM_SAMPLES * SEQ_LEN and entry.sample_rows().shape == (NUM_SAMPLES * math.ceil(256 / NUM_SAMPLES), x.shape[1])


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_output_error_is_lower_than_rtn_on_the_calibration_activations(calibration, model_dir, desc_act) -> None:
    from flashllm.quant.gptq_solver import gptq_quantize, rtn_quantize

    parts, _, stats, inputs = calibration
    tensors = read_checkpoint(model_dir)
    for group in linear_groups(parts.model):
        weight, x = group.fused_weight(tensors), inputs[group.module]
        reference = x @ weight.T
        gptq = gptq_quantize(weight, stats.linears[group.module].hessian, 4, GROUP, True, desc_act)
        rtn = rtn_quantize(weight, 4, GROUP, True)
        gptq_error = (x @ gptq.dequantize().T - reference).norm()
        rtn_error = (x @ rtn.dequantize().T - reference).norm()
        assert gptq_error < rtn_error, (group.module, float(gptq_error), float(rtn_error))


def test_awq_search_is_no_worse_than_no_scaling_on_its_objective(calibration, model_dir) -> None:
    from flashllm.ptq.awq_search import awq_search
    from flashllm.quant.weight_only import dequantize, quantize_weight

    def objective(weight: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> float:
        q = dequantize(quantize_weight(weight * s[None, :], "w4a16", GROUP, symmetric=False))
        return float(((x / s[None, :]) @ q.T - x @ weight.T).pow(2).mean())

    parts, _, stats, _ = calibration
    tensors = read_checkpoint(model_dir)
    improved = 0
    for group in linear_groups(parts.model):
        entry = stats.linears[group.module]
        weight, x = group.fused_weight(tensors), entry.sample_rows()
        search = awq_search(weight, x, entry.act_mean, 4, GROUP)
        chosen, identity = objective(weight, x, search.factors), objective(weight, x, torch.ones(weight.shape[1]))
        assert chosen <= identity * (1 + 1e-6), group.module
        improved += chosen < identity
    assert improved > 0, "no layer gained from scaling: the search is not being exercised"


def test_smoothquant_folding_leaves_the_float_model_unchanged(calibration, model_dir, pairs, float_logits,
                                                              tmp_path: Path) -> None:
    from flashllm.ptq.smoothquant import smoothquant_tensors

    parts, _, stats, _ = calibration
    original = read_checkpoint(model_dir)
    smoothed = smoothquant_tensors(original, linear_groups(parts.model), stats, alpha=0.5, quantize=False)
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(smoothed[norm], original[norm]), "nothing was smoothed"
    out = write_checkpoint(model_dir, tmp_path / "smoothed", smoothed, QuantizationConfig("smoothquant"))
    logits = teacher_forced_logits(_parts(out), pairs)
    torch.testing.assert_close(logits, float_logits, rtol=1e-4, atol=1e-4 * float(float_logits.abs().max()))


def test_kv_scales_are_max_abs_key_and_value_over_127(quantized, model_dir, calib) -> None:
    """Keys after RoPE and values from transformers' own cache, on windows packed here from the same text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = quantized("weight_only_int8", "--kv-scales")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stream: list[int] = []
    for line in calib.read_text(encoding="utf-8").splitlines():
        stream += tokenizer.encode(json.loads(line)["text"], add_special_tokens=False) + [tokenizer.eos_token_id]
    batch = torch.tensor(stream[:NUM_SAMPLES * SEQ_LEN]).view(NUM_SAMPLES, SEQ_LEN)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(batch, use_cache=True).past_key_values
    with safe_open(out / "model.safetensors", framework="pt") as f:
        for i, layer in enumerate(cache.layers):
            for name, values in (("k_scale", layer.keys), ("v_scale", layer.values)):  # (B, Hk, T, D)
                expected = values.abs().amax(dim=(0, 2, 3)) / 127
                got = f.get_tensor(f"model.layers.{i}.self_attn.{name}")
                assert got.dtype == torch.float32
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(("content", "message"), [
    ('{"text": "ok"}\nnot json\n', "calib.jsonl:2 is not a UTF-8 JSON object"),
    ('{"text": "ok"}\n{"txt": "x"}\n', 'calib.jsonl:2 has no string "text"'),
    ("\n\n", 'no non-empty "text"'),
])
def test_bad_calibration_files_are_refused_with_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "calib.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(CalibrationDataError, match=message):
        read_calibration_texts(path)


def test_cli_refuses_bad_flag_combinations_in_one_line(model_dir: Path, tmp_path: Path, capsys) -> None:
    base = ["quantize", str(model_dir), "--output", str(tmp_path / "out")]
    assert main([*base, "--method", "gptq"]) == 2
    assert "needs a calibration set" in capsys.readouterr().err
    assert main([*base, "--method", "awq", "--desc-act", "--calib", "x.jsonl"]) == 2
    assert "--desc-act is a gptq option" in capsys.readouterr().err
    assert main([*base, "--method", "gptq", "--calib", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@settings(deadline=None, max_examples=50)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=8), num_samples=st.integers(1, 5),
       seq_len=st.integers(2, 12))
def test_pack_windows_cuts_consecutive_windows_of_the_joined_stream(lengths, num_samples, seq_len) -> None:
    docs = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    stream = [t for doc in docs for t in [*doc, -1]]
    if len(stream) < seq_len:
        with pytest.raises(CalibrationDataError, match="fewer than one window"):
            pack_windows(docs, num_samples, seq_len, separator=-1)
        return
    windows = pack_windows(docs, num_samples, seq_len, separator=-1)
    assert len(windows) == min(num_samples, len(stream) // seq_len)
    assert [t for w in windows for t in w] == stream[:len(windows) * seq_len]
