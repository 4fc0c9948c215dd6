"""Quantized KV caches end to end: LLM(kv_cache_dtype="int8" | "fp8") on a tiny Llama against the fp32 cache.

The model is a tiny Llama that has memorized a few continuations, so the float model's top-1
choices on them are confident, as a trained model's are (on random weights every top-1 is a coin
toss and agreement would measure noise). Logits are compared teacher-forced (the same tokens go
into both), through prefill over several KV blocks; greedy generation compares the decode path.

Bounds. Each key/value element's quantization error, relative to the values' RMS, with head_dim
16 (a head's max|x| ~ 2.5 sigma):
  int8 dynamic: step s = max|x| / 127, error uniform in +-s/2: RMS ~ 2.5 / 127 / sqrt(12) ~ 0.6%.
  int8 static (per-head max over the prompts): the step follows the layer's largest key, ~2x.
  fp8 e4m3: 3 mantissa bits, relative error up to 2**-4, RMS ~ 2.5%: ~4x int8's, ~16x its KL.
Attention averages these errors over the context and over head_dim, and the memorized tokens'
distributions are confident, so KL = E_p[log p / q] is far below var(delta logit) / 2: about 1e-6
(int8) and 1e-5 (fp8) on this model. Gates sit ~100x above that (2e-4 int8, 2e-3 fp8), so other
summation orders or platforms pass, while a wrong scale (KL ~ 1, see the clipped-scale case) fails;
the exact quantization rules are pinned by tests/unit/test_kv_quant.py. fp8's ~4x coarser grid
must also show as a larger KL than int8's. Every memorized greedy token keeps its wide top-1 margin
under either grid, so greedy decoding agrees everywhere for int8 and at least 90% for fp8 (one
flip early in a continuation changes the rest of it, so agreement is the noisier measure).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.core.builder import EngineConfigError
from flashllm.core.model_runner import allocate_kv_caches
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.memorize import memorize
from flashllm.testing.tiny_models import build_tiny_model

BLOCK = 16
NUM_BLOCKS = 8
# kv_cache_dtype, cachekv_int8_type, max mean KL (nats), min greedy-token agreement
SCHEMES = [("int8", "dynamic", 2e-4, 1.0), ("fp8", "dynamic", 2e-3, 0.9)]


@pytest.fixture(scope="module")
def pairs() -> list[tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (n,), generator=gen).tolist(), torch.randint(0, 256, (20,), generator=gen).tolist())
            for n in (3, 6, 11, 17)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, pairs) -> Path:
    path = build_tiny_model(tmp_path_factory.mktemp("llama-memorized"), "llama", seed=1, tokenizer=False)
    assert memorize(path, pairs, steps=300) < 0.05
    return path


def _llm(model_dir: Path, kv_cache_dtype: str = "auto", cachekv_int8_type: str = "dynamic", **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 16)
    kw.setdefault("max_model_len", 64)
    return LLM(str(model_dir), kv_cache_dtype=kv_cache_dtype, cachekv_int8_type=cachekv_int8_type, device="cpu",
               dtype="float32", block_size=BLOCK, **kw)


@pytest.fixture(scope="module")
def float_llm(model_dir: Path) -> LLM:
    return _llm(model_dir)


def teacher_forced_logits(llm: LLM, pairs, paged_driver) -> torch.Tensor:
    """Logits predicting each continuation token (sum of continuation lengths, V), one prefill per pair.

    The caches are allocated as the engine's runner allocates them for this LLM's KV settings.
    """
    parts = llm.engine.parts
    cache = parts.config.cache
    rows = []
    for prompt, continuation in pairs:
        driver = paged_driver(parts.model, BLOCK, NUM_BLOCKS)
        driver.kv_caches = allocate_kv_caches(parts.model, torch.device("cpu"), NUM_BLOCKS, BLOCK,
                                              parts.runner.kv_caches[0][0].dtype, cache.cachekv_int8_type)
        seq = driver.add_sequence()
        logits = driver.step([(seq, prompt + continuation)])[0]
        rows.append(logits[len(prompt) - 1: -1])
    return torch.cat(rows)


def _kl(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                            reduction="batchmean"))


def _greedy(llm: LLM, pairs) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in pairs], params)]


@pytest.fixture(scope="module")
def float_greedy(float_llm, pairs) -> list[list[int]]:
    return _greedy(float_llm, pairs)


def _greedy_agreement(llm: LLM, expected: list[list[int]], pairs) -> float:
    """Share of greedy tokens (decode through the engine's runner) equal to the float cache's."""
    got = _greedy(llm, pairs)
    same = sum(a == b for e, g in zip(expected, got, strict=True) for a, b in zip(e, g, strict=True))
    return same / sum(map(len, expected))


@pytest.fixture
def reference(float_llm, pairs, paged_driver) -> torch.Tensor:
    logits = teacher_forced_logits(float_llm, pairs, paged_driver)
    assert (logits.argmax(-1) == torch.tensor([t for _, c in pairs for t in c])).all(), "memorization failed"
    return logits


@pytest.mark.parametrize(("kv_cache_dtype", "mode", "max_kl", "min_agreement"), SCHEMES)
def test_quantized_kv_tracks_the_float_cache(float_greedy, model_dir, pairs, paged_driver, reference,
                                             kv_cache_dtype, mode, max_kl, min_agreement) -> None:
    llm = _llm(model_dir, kv_cache_dtype, mode)
    k_cache, _, k_scale, _ = llm.engine.parts.runner.kv_caches[0]
    assert k_cache.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert k_scale.shape == k_cache.shape[:3]  # dynamic: a scale per (slot, head)
    assert llm.engine.parts.ops.sources["paged_attention"] == "cpu"
    kl = _kl(teacher_forced_logits(llm, pairs, paged_driver), reference)
    assert 0 < kl <= max_kl, kl  # > 0: the cache really was quantized
    assert _greedy_agreement(llm, float_greedy, pairs) >= min_agreement


def test_fp8_grid_is_coarser_than_int8(model_dir, pairs, paged_driver, reference) -> None:
    """The metric tells the grids apart: e4m3's relative step (2**-3) is ~4x int8's dynamic step."""
    kls = [_kl(teacher_forced_logits(_llm(model_dir, kv), pairs, paged_driver), reference) for kv in ("int8", "fp8")]
    assert kls[0] * 4 < kls[1], kls


def _calibrated_copy(model_dir: Path, float_llm: LLM, pairs, paged_driver, dest: Path, factor: float) -> Path:
    """A copy of the checkpoint with per-head static scales factor * max|K|, max|V| / 127 over the prompts."""
    model = float_llm.engine.parts.model
    driver = paged_driver(model, BLOCK, NUM_BLOCKS * len(pairs))
    driver.step([(driver.add_sequence(), p + c) for p, c in pairs])
    shutil.copytree(model_dir, dest)
    tensors = load_file(dest / "model.safetensors")
    for layer, (k_cache, v_cache) in enumerate(driver.kv_caches):
        for name, cache in (("k_scale", k_cache), ("v_scale", v_cache)):
            # the driver's unwritten slots are NaN
            amax = torch.nan_to_num(cache, nan=0.0).abs().amax(dim=(0, 1, 3))  # (Hk,)
            tensors[f"model.layers.{layer}.self_attn.{name}"] = (amax / 127 * factor).float().contiguous()
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_static_int8_reads_the_checkpoint_scales(float_llm, float_greedy, model_dir, pairs, paged_driver,
                                                 reference, tmp_path) -> None:
    with pytest.raises(EngineConfigError, match="--kv-scales"):
        _llm(model_dir, "int8", "static")  # this checkpoint has no scales
    calibrated = _calibrated_copy(model_dir, float_llm, pairs, paged_driver, tmp_path / "calibrated", 1.0)
    llm = _llm(calibrated, "int8", "static")
    written = load_file(calibrated / "model.safetensors")["model.layers.1.self_attn.v_scale"]
    assert torch.equal(llm.engine.parts.runner.kv_caches[1][3], written)
    kl = _kl(teacher_forced_logits(llm, pairs, paged_driver), reference)
    assert 0 < kl <= 2e-4, kl
    assert _greedy_agreement(llm, float_greedy, pairs) == 1.0
    # scales 20x too small saturate nearly every key and value: the engine must get much worse
    clipped = _llm(_calibrated_copy(model_dir, float_llm, pairs, paged_driver, tmp_path / "clipped", 0.05),
                   "int8", "static")
    assert _kl(teacher_forced_logits(clipped, pairs, paged_driver), reference) > 10 * kl


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_kv_bytes_per_token_are_about_a_quarter_of_fp32(tmp_path_factory, kv_cache_dtype) -> None:
    # head_dim 64, as real models have: one fp32 scale per head adds 4 / 64 bytes per element
    model_dir = build_tiny_model(tmp_path_factory.mktemp("llama-d64"), "llama", seed=0, tokenizer=False,
                                 hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    float_runner = _llm(model_dir).engine.parts.runner
    quant_runner = _llm(model_dir, kv_cache_dtype).engine.parts.runner
    head_dim = 256 // 4
    ratio = quant_runner.kv_cache_bytes() / float_runner.kv_cache_bytes()
    assert ratio == pytest.approx((head_dim + 4) / (4 * head_dim))  # 1-byte codes + 4-byte scale per head
    assert 0.25 < ratio < 0.27
    # sizing by memory stays honest: the same budget holds 1 / ratio times the blocks
    budget = 4 * float_runner.kv_cache_bytes()  # 64 fp32 blocks
    float_llm = _llm(model_dir, num_kv_blocks=None, kv_cache_memory=budget)
    quant_llm = _llm(model_dir, kv_cache_dtype, num_kv_blocks=None, kv_cache_memory=budget)
    assert float_llm.engine.parts.num_blocks == 64
    assert quant_llm.engine.parts.num_blocks == int(64 / ratio)
    assert quant_llm.engine.parts.runner.kv_cache_bytes() <= budget
