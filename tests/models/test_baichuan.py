"""Baichuan / Baichuan2: the RoPE 7B against transformers' Llama with W_pack split into q, k and v; the ALiBi
13B and Baichuan2's normalized LM head against a naive model written here (full causal attention, no
cache); paged KV across blocks, chunked prefill and prefix-cache hits (the config rules, chat format and tokenizer:
test_baichuan_config.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.loader import load_model
from flashllm.registry.fusions import DECODER_STACK, LM_HEAD
from flashllm.sampling_params import SamplingParams
from flashllm.testing.first_generation import baichuan_from_llama, write_baichuan
from flashllm.testing.parity import LogitRecorder, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

BLOCK, STEPS, ATOL = 16, 32, 1e-4
PROMPT_LENGTHS = (1, 7, 63, 64, 65, 200)
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
VOCAB = 256
# the ALiBi models: 6 heads (not a power of two, so the interleaved slopes are used), head_dim 16
ALIBI = {"vocab_size": VOCAB, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2,
         "num_attention_heads": 6, "rms_norm_eps": 1e-6, "hidden_act": "silu", "model_max_length": 512}


def build_alibi(out_dir: Path, seed: int, **config) -> Path:
    """Random Baichuan-13B-shaped tensors (norm scales ~1) under the checkpoint's names; LM head rows of
    norms spread over 4x, so normalizing them changes which token wins."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, v = ALIBI["hidden_size"], ALIBI["intermediate_size"], ALIBI["vocab_size"]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.1

    tensors = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": 1 + rnd(h),
               "lm_head.weight": rnd(v, h) * (0.5 + 1.5 * torch.rand(v, 1, generator=gen))}
    for i in range(ALIBI["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + rnd(h), p + "post_attention_layernorm.weight": 1 + rnd(h),
            p + "self_attn.W_pack.weight": rnd(3 * h, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
        })
    return write_baichuan(out_dir, tensors, {**ALIBI, **config})


class NaiveBaichuan:
    """Baichuan-13B / Baichuan2-13B as their published modeling code computes them, in float64 on whole
    sequences: scores q.k / sqrt(d) plus slope_h * key_pos (the 13B code's form of the ALiBi bias) with
    -inf above the diagonal, RMSNorm, SwiGLU, and for Baichuan2 logits against row-normalized LM head
    weights. Slopes: the ALiBi paper's, written out for 6 heads."""

    SLOPES_6 = [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]  # 4 heads' 2^(-8h/4), then 8 heads' odd ones

    def __init__(self, model_dir: Path, alibi: bool = True, norm_head: bool = False) -> None:
        self.w = {k: t.double() for k, t in load_file(model_dir / "model.safetensors").items()}
        self.alibi, self.norm_head = alibi, norm_head

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ALIBI["rms_norm_eps"]) * self.w[name]

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), vocab) float64 logits of every position."""
        n, heads, d = len(ids), ALIBI["num_attention_heads"], ALIBI["hidden_size"] // ALIBI["num_attention_heads"]
        key_pos = torch.arange(n, dtype=torch.float64)
        bias = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
        if self.alibi:
            bias = bias + torch.tensor(self.SLOPES_6, dtype=torch.float64)[:, None, None] * key_pos  # (H, n, n)
        x = self.w["model.embed_tokens.weight"][ids]
        for i in range(ALIBI["num_hidden_layers"]):
            p = f"model.layers.{i}."
            q, k, v = (self._rms(x, p + "input_layernorm.weight") @ self.w[p + "self_attn.W_pack.weight"].T).chunk(3, -1)
            q, k, v = (t.view(n, heads, d).transpose(0, 1) for t in (q, k, v))  # (H, n, d)
            probs = torch.softmax(q @ k.transpose(1, 2) / d**0.5 + bias, dim=-1)
            x = x + (probs @ v).transpose(0, 1).reshape(n, heads * d) @ self.w[p + "self_attn.o_proj.weight"].T
            h = self._rms(x, p + "post_attention_layernorm.weight")
            gate, up = h @ self.w[p + "mlp.gate_proj.weight"].T, h @ self.w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        head = self.w["lm_head.weight"]
        if self.norm_head:
            head = head / head.pow(2).sum(-1, keepdim=True).sqrt()
        return self._rms(x, "model.norm.weight") @ head.T

    def greedy(self, prompt: list[int], steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
        """Greedy continuation by full forwards: the tokens, and the logits of every position after them."""
        ids = list(prompt)
        for _ in range(steps):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):], self.logits(ids)


class HFReference:
    """transformers' Llama behind NaiveBaichuan's interface (full forwards, no cache code)."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0].double()

    def greedy(self, prompt: list[int], steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
        ids = list(prompt)
        for _ in range(steps):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):], self.logits(ids)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """name -> (Baichuan model directory, the reference it must match)."""
    from transformers import AutoModelForCausalLM

    llama_dir = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3, tokenizer=False,
                                 num_key_value_heads=4, vocab_size=VOCAB)
    llama = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    normed = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # Baichuan2-7B's head: every row divided by its L2 norm
        normed.lm_head.weight /= normed.lm_head.weight.norm(dim=-1, keepdim=True)
    root = tmp_path_factory.mktemp("baichuan")
    alibi, alibi2 = build_alibi(root / "13b", seed=4), build_alibi(root / "2-13b", seed=5, z_loss_weight=0)
    return {
        "7b": (baichuan_from_llama(llama_dir, root / "7b"), HFReference(llama)),
        "2-7b": (baichuan_from_llama(llama_dir, root / "2-7b", z_loss_weight=0), HFReference(normed)),
        "13b": (alibi, NaiveBaichuan(alibi)),
        "2-13b": (alibi2, NaiveBaichuan(alibi2, norm_head=True)),
    }


_GREEDY_CACHE: dict[tuple[str, tuple[int, ...]], tuple[list[int], torch.Tensor]] = {}


def reference_greedy(models, name: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    key = (name, tuple(prompt))
    if key not in _GREEDY_CACHE:
        _GREEDY_CACHE[key] = models[name][1].greedy(prompt)
    return _GREEDY_CACHE[key]


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, max_model_len=512, num_kv_blocks=128)
    return LLM(str(model_dir), **{**options, **kw})


def _check(models, name: str, prompts, outputs, recorder: LogitRecorder | None) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, final = reference_greedy(models, name, prompt)
        assert output.outputs[0].token_ids == tokens, f"{name}: prompt of {len(prompt)} tokens diverged"
        if recorder is None:
            continue
        full = prompt + tokens
        rows = [(ctx, row) for ctx, row in recorder.rows if ctx == full[: len(ctx)] and len(ctx) >= len(prompt)]
        assert len(rows) >= STEPS, f"{name}: prompt of {len(prompt)} tokens: only {len(rows)} logits rows recorded"
        for ctx, row in rows:
            torch.testing.assert_close(row.double(), final[len(ctx) - 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["7b", "2-7b", "13b", "2-13b"])
def test_engine_greedy_tokens_and_logits_match_the_reference(name, models) -> None:
    """The engine on the cpu backend, prompts across block boundaries, prefills in chunks of 48 tokens:
    32 greedy tokens identical to the reference and every sampled logits row within 1e-4."""
    llm = _llm(models[name][0], max_num_batched_tokens=48)
    recorder = LogitRecorder(llm)
    prompts = [random_tokens(n, VOCAB, seed=20 + n) for n in PROMPT_LENGTHS]
    _check(models, name, prompts, llm.generate(prompts, GREEDY), recorder)
    assert llm.engine.parts.ops.sources["paged_attention"] == "cpu"


@pytest.mark.parametrize("name", ["13b", "2-13b"])
def test_alibi_on_the_reference_backend_matches(name, models) -> None:
    llm = _llm(models[name][0], backend="reference")
    recorder = LogitRecorder(llm)
    prompts = [random_tokens(n, VOCAB, seed=40 + n) for n in (5, 64, 130)]
    _check(models, name, prompts, llm.generate(prompts, GREEDY), recorder)


@pytest.mark.parametrize("name", ["7b", "13b", "2-13b"])
def test_prefix_cache_hits_give_the_reference_tokens(name, models) -> None:
    llm = _llm(models[name][0])
    shared = random_tokens(100, VOCAB, seed=30)
    prompts = [shared + random_tokens(n, VOCAB, seed=31 + n) for n in (3, 40)]
    llm.generate(prompts[:1], GREEDY)  # fills the cache with the shared blocks
    recorder = LogitRecorder(llm)
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.metrics.num_cached_tokens >= 96 for o in outputs)  # 6 full blocks of 16 hit
    _check(models, name, prompts, outputs, recorder)


def test_alibi_chunks_after_a_cached_prefix_beside_a_decode(models, ops, model_registry, paged_driver) -> None:
    """The reference kernels by hand: a prompt in three chunks sharing steps with another sequence's decodes."""
    model_dir, naive = models["2-13b"]
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=64, seed=5)
    long_prompt, short = random_tokens(150, VOCAB, seed=6), random_tokens(30, VOCAB, seed=7)
    a, b = driver.add_sequence(), driver.add_sequence()
    driver.step([(b, short)])
    for lo, hi in ((0, 37), (37, 100), (100, 150)):
        short.append(random_tokens(1, VOCAB, seed=hi)[0])
        chunk_logits, decode_logits = driver.step([(a, long_prompt[lo:hi]), (b, short[-1:])])
        torch.testing.assert_close(chunk_logits.double(), naive.logits(long_prompt[:hi])[lo:hi], atol=ATOL, rtol=0)
        torch.testing.assert_close(decode_logits.double(), naive.logits(short)[-1:], atol=ATOL, rtol=0)


def test_alibi_and_the_normalized_head_change_the_logits(models) -> None:
    """Guards the parity tests: without the bias, or without normalizing the head, the logits differ."""
    model_dir, naive = models["2-13b"]
    tokens = random_tokens(64, VOCAB, seed=1)
    for other in (NaiveBaichuan(model_dir, alibi=False, norm_head=True), NaiveBaichuan(model_dir)):
        difference = (other.logits(tokens) - naive.logits(tokens)).abs().max()
        assert difference > 1e-2
        assert not torch.equal(other.logits(tokens).argmax(-1), naive.logits(tokens).argmax(-1))


def test_what_each_variant_declares(models, ops, model_registry) -> None:
    """RoPE Baichuan is Llama's stack, so it offers the fused decoder stack; the ALiBi one must not (that
    fused decode applies RoPE and no bias). Both offer the LM head, normalized at load for Baichuan2."""
    rope, config = load_model(models["2-7b"][0], ops, torch.float32, "cpu", model_registry, progress=False)
    assert config.norm_head and not config.alibi and set(rope.fusions()) == {DECODER_STACK, LM_HEAD}
    norms = rope.fusions()[LM_HEAD].weight.norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    alibi, config = load_model(models["13b"][0], ops, torch.float32, "cpu", model_registry, progress=False)
    assert config.alibi and not config.norm_head and set(alibi.fusions()) == {LM_HEAD}


def test_each_tensor_parallel_rank_takes_its_heads_slopes(ops) -> None:
    """Rank r of 2 holds query heads 3r..3r+2 of 6 (qkv_proj's split), so it must hold their slopes."""
    from flashllm.models.baichuan import BaichuanAlibiAttention
    from flashllm.ops.alibi_slopes import alibi_slopes

    config = parse_hf_config({**ALIBI, "architectures": ["BaichuanForCausalLM"]})
    for rank in (0, 1):
        attn = BaichuanAlibiAttention(config, ops, torch.float32, torch.device("cpu"), tp_rank=rank, tp_size=2)
        assert attn.num_heads == 3 and torch.equal(attn.attn.alibi_slopes, alibi_slopes(6)[3 * rank : 3 * rank + 3])
        assert torch.equal(attn.attn.alibi_slopes, torch.tensor(NaiveBaichuan.SLOPES_6[3 * rank : 3 * rank + 3]))


def test_weight_only_int8_alibi_computes_with_its_dequantized_weights(models, ops, model_registry,
                                                                      paged_driver) -> None:
    """--quant_type weight_only_int8 on Baichuan: W_pack's shards quantized as one matrix, and the logits are
    the naive model's on the dequantized weights (not merely near the float ones)."""
    from flashllm.ops.quant_matmul import dequantize
    from flashllm.quant.spec import weight_quant_spec

    model_dir, _ = models["2-13b"]
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False,
                         quant=weight_quant_spec("weight_only_int8"))
    naive = NaiveBaichuan(model_dir, norm_head=True)
    for i, layer in enumerate(ours.model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
        assert attn.qkv_proj.qweight.scheme == "w8a16"
        gate, up = dequantize(mlp.gate_up_proj.qweight).double().chunk(2)
        naive.w.update({p + "self_attn.W_pack.weight": dequantize(attn.qkv_proj.qweight).double(),
                        p + "self_attn.o_proj.weight": dequantize(attn.o_proj.qweight).double(),
                        p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                        p + "mlp.down_proj.weight": dequantize(mlp.down_proj.qweight).double()})
    assert not torch.equal(naive.w["model.layers.0.self_attn.W_pack.weight"], models["2-13b"][1].w[
        "model.layers.0.self_attn.W_pack.weight"])  # the weights really were rounded
    prompt = random_tokens(65, VOCAB, seed=8)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=16)
    (logits,) = driver.step([(driver.add_sequence(), prompt)])
    torch.testing.assert_close(logits.double(), naive.logits(prompt), atol=ATOL, rtol=0)


QUANTIZED = {
    "gptq-int4": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    "gptq-int8-act-order": {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": True, "sym": True},
    "awq-int4": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
}
BAICHUAN_LINEARS = ("self_attn.W_pack", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_a_quantized_baichuan2_13b_computes_its_dequantized_weights(case, models, tmp_path, ops, model_registry,
                                                                    paged_driver) -> None:
    """A GPTQ / AWQ Baichuan2-13B (W_pack quantized whole, the normalized head left in float, as quantizers
    leave lm_head): W_pack's packed tensors are cut into q, k and v along their output features, and the
    logits of a prompt across blocks and of decode steps are the naive model's on the dequantized weights."""
    from flashllm.testing.packed_quant import quantize_linear

    tensors = load_file(models["2-13b"][0] / "model.safetensors")
    gen = torch.Generator().manual_seed(31)
    packed, twin = dict(tensors), dict(tensors)
    for i in range(ALIBI["num_hidden_layers"]):
        orders = {}
        for linear in BAICHUAN_LINEARS:
            name = f"model.layers.{i}.{linear}"
            weight = packed.pop(f"{name}.weight")
            source = "mlp.gate_up" if linear in ("mlp.gate_proj", "mlp.up_proj") else linear  # one input: one order
            k = weight.shape[1]
            orders.setdefault(source, torch.randperm(k, generator=gen) if QUANTIZED[case].get("desc_act")
                              else torch.arange(k))
            layer, twin[f"{name}.weight"] = quantize_linear(weight, QUANTIZED[case], orders[source])
            packed.update({f"{name}.{suffix}": t for suffix, t in layer.items()})
    config = {**ALIBI, "z_loss_weight": 0}
    quant_dir = write_baichuan(tmp_path / "quant", packed, {**config, "quantization_config": QUANTIZED[case]})
    naive = NaiveBaichuan(write_baichuan(tmp_path / "twin", twin, config), norm_head=True)
    ours, _ = load_model(quant_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert ours.model.layers[0].self_attn.qkv_proj.weight is None
    prompt = random_tokens(40, VOCAB, seed=32)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=16)
    seq, new = driver.add_sequence(), list(prompt)
    for _ in range(4):  # the prompt, then three decode steps
        (logits,) = driver.step([(seq, new)])
        torch.testing.assert_close(logits.double(), naive.logits(prompt)[-len(new):], atol=ATOL, rtol=0)
        prompt.append(int(logits[-1].argmax()))
        new = prompt[-1:]


def test_a_w_pack_of_the_wrong_shape_is_refused(models, tmp_path, ops, model_registry) -> None:
    tensors = load_file(models["13b"][0] / "model.safetensors")
    tensors["model.layers.1.self_attn.W_pack.weight"] = tensors["model.layers.1.self_attn.W_pack.weight"][:-16]
    broken = write_baichuan(tmp_path / "broken", tensors, ALIBI)
    with pytest.raises(ModelLoadError, match=r"W_pack.weight.*\(272, 96\); expected \(288, 96\)"):
        load_model(broken, ops, torch.float32, "cpu", model_registry, progress=False)


def test_an_op_table_without_alibi_attention_is_refused(models, model_registry) -> None:
    from flashllm.backends.reference import make_backend
    from flashllm.registry.backend import Kernel
    from flashllm.registry.resolve import OpTable

    kernels = {op: ks[0] for op, ks in make_backend().kernels.items()}
    plain = kernels["paged_attention"]
    kernels["paged_attention"] = Kernel(plain.op, plain.fn, type(plain.caps)(dtypes=plain.caps.dtypes), "plain")
    with pytest.raises(ValueError, match="binds paged_attention to the plain kernel, which does not implement it"):
        load_model(models["13b"][0], OpTable(kernels, []), torch.float32, "cpu", model_registry, progress=False)
