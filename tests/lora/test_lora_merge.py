"""`--lora_path`: a PEFT adapter merged at load gives transformers + peft's logits and greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("peft")

from flashllm.backends.reference import reference_op_table  # noqa: E402
from flashllm.llm import LLM  # noqa: E402
from flashllm.models.hf_config import ModelLoadError  # noqa: E402
from flashllm.quant.spec import weight_quant_spec  # noqa: E402
from flashllm.sampling_params import SamplingParams  # noqa: E402
from flashllm.testing.loading import load_flashllm
from flashllm.testing.parity import assert_rows_match, record_logits  # noqa: E402
from flashllm.testing.tiny_lora import build_peft_adapter, load_peft_model  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

STEPS = 32
PROMPT_LENGTHS = (1, 9, 40, 70)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    return {p: build_tiny_model(tmp_path_factory.mktemp(p), p, seed=4, tokenizer=False) for p in ("llama", "qwen2")}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):], model(input_ids=torch.tensor([ids])).logits[0]


def _check_engine_against_peft(base: Path, adapter: Path, reference=None) -> None:
    reference = reference or load_peft_model(base, adapter)
    llm = LLM(str(base), lora_path=str(adapter), dtype="float32", device="cpu", block_size=16,
              max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32)  # 32: chunked prefill too
    rows = record_logits(llm)
    prompts = _prompts(reference.config.vocab_size)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logits = _hf_greedy(reference, prompt)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(rows, prompt, tokens, logits, STEPS, atol=1e-4)


@pytest.mark.parametrize(("preset", "targets", "rslora"), [
    ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    ("qwen2", ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), True),
])
def test_merged_adapter_matches_transformers_and_peft(preset, targets, rslora, bases, tmp_path) -> None:
    adapter = build_peft_adapter(bases[preset], tmp_path / "adapter", r=8, alpha=24, targets=targets,
                                 use_rslora=rslora, seed=2)
    base_llm_tokens = None
    reference = load_peft_model(bases[preset], adapter)
    with reference.disable_adapter(), torch.no_grad():  # the adapter must change the answer, or parity proves little
        base_llm_tokens = _hf_greedy(reference, _prompts(reference.config.vocab_size)[2])[0]
    assert base_llm_tokens != _hf_greedy(reference, _prompts(reference.config.vocab_size)[2])[0]
    _check_engine_against_peft(bases[preset], adapter, reference)


def _fuse(adapter: Path, out: Path, fused: dict[str, list[str]]) -> Path:
    """Rewrite an adapter whose shards share lora_A as one adapter on flashllm's fused modules."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    result: dict[str, torch.Tensor] = {}
    for key in list(tensors):
        module, which = key.rsplit(".lora_", 1)
        head, last = module.rsplit(".", 1)
        name = next((f for f, shards in fused.items() if last in shards), None)
        if name is None:
            result[key] = tensors[key]
            continue
        shards = fused[name]
        if last != shards[0]:
            continue
        parts = [tensors[f"{head}.{s}.lora_{which}"] for s in shards]
        result[f"{head}.{name}.lora_{which}"] = parts[0] if which.startswith("A") else torch.cat(parts)
    out.mkdir()
    save_file(result, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    return out


def test_adapter_on_fused_module_names(bases, tmp_path) -> None:
    """An adapter trained on fused qkv_proj / gate_up_proj (one lora_A, stacked lora_B) is the same as
    per-projection adapters sharing that lora_A: check it against peft on the latter."""
    adapter = build_peft_adapter(bases["llama"], tmp_path / "split", r=4, alpha=8, seed=5)
    tensors = load_file(adapter / "adapter_model.safetensors")
    for key in list(tensors):  # k/v share q's A, up shares gate's A
        for shard, first in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
            if f".{shard}.lora_A" in key:
                tensors[key] = tensors[key.replace(shard, first)].clone()
    save_file(tensors, adapter / "adapter_model.safetensors")
    fused = _fuse(adapter, tmp_path / "fused", {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                 "gate_up_proj": ["gate_proj", "up_proj"]})
    assert any(".qkv_proj." in k for k in load_file(fused / "adapter_model.safetensors"))
    _check_engine_against_peft(bases["llama"], fused, load_peft_model(bases["llama"], adapter))


def test_merge_happens_before_weight_only_quantization(bases, tmp_path) -> None:
    """--lora_path with w8a16 quantizes the merged weights: the same codes as quantizing peft's merged model."""
    adapter = build_peft_adapter(bases["llama"], tmp_path / "adapter", seed=9)
    merged_dir = tmp_path / "merged"
    load_peft_model(bases["llama"], adapter).merge_and_unload().save_pretrained(merged_dir)
    ops, quant = reference_op_table(), weight_quant_spec("weight_only_int8", -1)
    ours = load_flashllm(bases["llama"], ops, quant=quant, lora_path=adapter)
    theirs = load_flashllm(merged_dir, ops, quant=quant)
    for (name, a), (_, b) in zip(ours.named_modules(), theirs.named_modules(), strict=True):
        if getattr(a, "qweight", None) is not None and a.qweight.scheme == "w8a16":
            assert (a.qweight.data.int() - b.qweight.data.int()).abs().max() <= 1, name
            torch.testing.assert_close(a.qweight.scales, b.qweight.scales, rtol=1e-5, atol=0)


def _write_config(adapter: Path, **changes) -> None:
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
    (lambda d: _write_config(d, use_dora=True), "DoRA"),
    (lambda d: _write_config(d, r=4), "do not fit the base weight"),
    (lambda d: _write_config(d, rank_pattern={"q_proj": 4}), "rank_pattern"),
    (lambda d: _write_config(d, peft_type="PREFIX_TUNING"), "only LORA"),
    (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"),
     "not a valid safetensors"),
    (lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"), "pickle files never load"),
    (lambda d: _rename_keys(d, "q_proj", "qq_proj"), "no linear weight"),
    (lambda d: _poison(d), "NaN"),
])
def test_bad_adapters_are_refused_in_one_line(damage, message, bases, tmp_path) -> None:
    adapter = build_peft_adapter(bases["llama"], tmp_path / "adapter", targets=("q_proj", "v_proj"), seed=1)
    damage(adapter)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_flashllm(bases["llama"], lora_path=adapter)
    assert "\n" not in str(info.value)


def test_adapter_for_another_model_size_is_refused_before_allocation(bases, tmp_path) -> None:
    other = build_tiny_model(tmp_path / "wide", "llama", seed=1, tokenizer=False, hidden_size=96)
    adapter = build_peft_adapter(other, tmp_path / "adapter", targets=("q_proj",), seed=1)
    with pytest.raises(ModelLoadError, match=r"lora_A \(8, 96\).*expected \(8, 64\)"):
        load_flashllm(bases["llama"], lora_path=adapter)


def _rename_keys(adapter: Path, old: str, new: str) -> None:
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k.replace(old, new): v for k, v in tensors.items()}, adapter / "adapter_model.safetensors")


def _poison(adapter: Path) -> None:
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, adapter / "adapter_model.safetensors")
