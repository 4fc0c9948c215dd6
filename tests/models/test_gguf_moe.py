"""Mixture-of-experts GGUF files (Mixtral as llama.cpp's "llama" with experts, qwen2moe, qwen3moe), written by
flashllm's llama.cpp exporter from tiny directories, load into the directory's model: F32 exactly, Q8_0 and
K-quant experts kept as stored blocks that compute what the gguf package's dequantized values do; inconsistent
expert metadata is refused in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")


from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.models.layers.moe import FusedMoE  # noqa: E402
from flashllm.models.weight_bytes import weight_bytes  # noqa: E402
from flashllm.ops.quant_matmul import dequantize  # noqa: E402
from flashllm.quant.spec import weight_quant_spec  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_q8_0_logits,
    exports,
    greedy_tokens,
    load_float_model,
    patched_metadata,
    prompt_logits,
    q8_0_round_trip_copy,
    retyped_copy,
    round_trip_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_moe import build_moe_model  # noqa: E402
from flashllm.testing.tokenizer import train_tokenizer  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
# The tiny presets as llama.cpp's graphs run them (the exporter refuses anything else): every layer sparse,
# qwen2moe not renormalized with a shared expert, qwen3moe renormalized without one. Every matrix's rows are
# whole Q8_0 blocks of 32, so the exporter stores each 2-D weight but the routers as Q8_0.
PRESETS = {
    "mixtral": {},
    "qwen2_moe": {"num_hidden_layers": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 96},
    "qwen3_moe": {"num_hidden_layers": 2, "mlp_only_layers": [], "moe_intermediate_size": 64},
}
ROUTERS = (".gate.weight", ".shared_expert_gate.weight")  # the exporter writes these F32, as llama.cpp's does


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    built = {}
    for preset, overrides in PRESETS.items():
        out = tmp_path_factory.mktemp(preset)
        tokenizer = train_tokenizer(out, vocab_size=300)  # the exporter writes the vocabulary
        built[preset] = build_moe_model(out, preset, seed=3, vocab_size=len(tokenizer), **overrides)
    return built


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    """(preset, "f32" | "q8_0") -> the exported GGUF file, written once."""
    return exports(tmp_path_factory.mktemp("gguf"), sources)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_f32_gguf_equals_its_source_directory_and_transformers(preset, sources, files, ops, model_registry,
                                                                paged_driver):
    from transformers import AutoModelForCausalLM

    ours = load_float_model(files(preset, "f32"), ops, model_registry)
    reference = load_float_model(sources[preset], ops, model_registry)
    expected = prompt_logits(reference, paged_driver, PROMPT)
    torch.testing.assert_close(prompt_logits(ours, paged_driver, PROMPT), expected, rtol=0, atol=1e-6)
    hf = AutoModelForCausalLM.from_pretrained(sources[preset], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert greedy_tokens(ours, paged_driver, PROMPT, 10) == expected[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("preset", list(PRESETS))
def test_q8_0_gguf_equals_the_dequantized_float_model(preset, sources, files, ops, model_registry, paged_driver,
                                                      tmp_path):
    ours = load_float_model(files(preset, "q8_0"), ops, model_registry)
    experts = ours.model.layers[0].mlp.experts
    assert experts.w13_weight is None and len(experts.expert_blocks) == experts.num_experts  # kept as stored
    assert {w.gguf_type for pair in experts.expert_blocks for w in pair} == {"Q8_0"}
    assert ours.model.layers[0].self_attn.o_proj.qweight.gguf_type == "Q8_0"  # dense layers keep their blocks
    check_q8_0_logits(ours, sources[preset], ops, model_registry, paged_driver, PROMPT, tmp_path / "float", ROUTERS)


K_QUANTS = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"}  # as a Q4_K_M file mixes them


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """(source directory, GGUF file with Q4_K gate / up and Q6_K down experts, the rest F32): rows of 256 features,
    the K-quants' super-block, and 768 intermediate features (Qwen3-30B-A3B's), three blocks of the down projection."""
    out = tmp_path_factory.mktemp("kquant")
    tokenizer = train_tokenizer(out, vocab_size=300)
    source = build_moe_model(out, "qwen3_moe", seed=5, vocab_size=len(tokenizer), hidden_size=256,
                             num_hidden_layers=2, mlp_only_layers=[], moe_intermediate_size=768)
    f32 = exports(out / "gguf", {"m": source})("m", "f32")
    return source, retyped_copy(f32, out / "kquant.gguf", K_QUANTS)


def test_k_quant_experts_stay_as_stored_and_compute_their_dequantized_values(k_quant_file, ops, model_registry,
                                                                             paged_driver, tmp_path):
    source, path = k_quant_file
    ours = load_float_model(path, ops, model_registry)
    experts = ours.model.layers[0].mlp.experts
    w13, w2 = experts.expert_blocks[0]
    assert (w13.gguf_type, w13.scheme, w2.gguf_type, w2.scheme) == ("Q4_K", "w4a16", "Q6_K", "w8a16")
    rounded = load_float_model(round_trip_copy(source, tmp_path / "rounded", {
        "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}), ops, model_registry)
    expected = prompt_logits(rounded, paged_driver, PROMPT)
    torch.testing.assert_close(prompt_logits(ours, paged_driver, PROMPT), expected, rtol=0, atol=1e-5)
    unquantized = prompt_logits(load_float_model(source, ops, model_registry), paged_driver, PROMPT)
    assert (unquantized - expected).abs().max() > 1e-3, "the K-quant rounding did not change the logits"
    assert greedy_tokens(ours, paged_driver, PROMPT, 6) == greedy_tokens(rounded, paged_driver, PROMPT, 6)
    # 4.5 + 6.5625 bits a weight as stored, unpacked to int4 / int8 codes with fp32 scales: well under fp32's 32
    # (the experts are most of this model; its attention, embeddings and head are F32 in the file)
    stored = weight_bytes(ours)
    assert stored.total < weight_bytes(rounded).total / 3
    streamed = stored.total - stored.streamed  # the 8 - 2 experts of each layer a decode token does not read
    assert streamed >= 2 * 6 * experts.expert_nbytes() > 0


def test_k_quant_experts_split_over_ranks_at_whole_super_blocks(k_quant_file, ops, model_registry, tmp_path):
    """Ranks keep blocks by holding whole 256-feature blocks of the down projection: 768 features over 2 ranks as
    512 and 256; over 4 some rank would hold none, and the layer loads float (192 each, the same values). Each rank's blocks dequantize to its slice of the rounded directory's experts, and the ranks'
    slices tile every feature once."""
    source, path = k_quant_file
    rounded_dir = round_trip_copy(source, tmp_path / "rounded", {
        "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"})
    whole = next(m for m in load_float_model(rounded_dir, ops, model_registry).modules() if isinstance(m, FusedMoE))
    inter = whole.intermediate_size
    for tp_size, slices in ((2, [(0, 512), (512, 256)]), (4, None)):
        for rank in range(tp_size):
            kwargs = {"tp_rank": rank, "tp_size": tp_size}
            ours = next(m for m in load_float_model(path, ops, model_registry, **kwargs).modules()
                        if isinstance(m, FusedMoE))
            if slices is None:  # float fallback: the directory's own even split
                assert ours.expert_blocks is None
                reference = next(m for m in load_float_model(rounded_dir, ops, model_registry, **kwargs).modules()
                                 if isinstance(m, FusedMoE))
                assert torch.equal(ours.w13_weight, reference.w13_weight) and torch.equal(ours.w2_weight,
                                                                                          reference.w2_weight)
                continue
            first, count = ours.rank_features()
            assert (first, count) == slices[rank], (tp_size, rank)
            for expert in range(ours.num_experts):
                w13, w2 = (dequantize(w) for w in ours.expert_blocks[expert])
                gate_up = whole.w13_weight[expert]
                expected = torch.cat([gate_up[first:first + count], gate_up[inter + first:inter + first + count]])
                assert torch.equal(w13, expected), (tp_size, rank, expert)
                assert torch.equal(w2, whole.w2_weight[expert][:, first:first + count]), (tp_size, rank, expert)


@pytest.mark.parametrize("flag", ["quant", "moe_quant"])
def test_quant_type_quantizes_the_dequantized_experts_as_a_directory_s(flag, sources, files, ops, model_registry,
                                                                        paged_driver, tmp_path):
    """--quant_type (every layer, the blocks dequantized first) or --moe_quant_type (the experts only)."""
    quant = {flag: weight_quant_spec("w8a16")}
    ours = load_float_model(files("qwen2_moe", "q8_0"), ops, model_registry, **quant)
    experts = ours.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.int8 and experts.w13_scale is not None
    o_proj = ours.model.layers[1].self_attn.o_proj.qweight
    assert (o_proj.gguf_type, o_proj.group_size) == ((None, -1) if flag == "quant" else ("Q8_0", 32))
    rounded = q8_0_round_trip_copy(sources["qwen2_moe"], tmp_path / "float", ROUTERS)
    reference = load_float_model(rounded, ops, model_registry, **quant)
    expected = prompt_logits(reference, paged_driver, PROMPT)
    torch.testing.assert_close(prompt_logits(ours, paged_driver, PROMPT), expected, rtol=0, atol=1e-5)


def test_q8_0_expert_blocks_under_tensor_parallelism(sources, files, ops, model_registry, tmp_path):
    """Each rank's blocks dequantize to the rounded directory's rank slice: 32 of every expert's 64 features."""
    rounded_dir = q8_0_round_trip_copy(sources["qwen2_moe"], tmp_path / "float", ROUTERS)
    for rank in (0, 1):
        kwargs = {"tp_rank": rank, "tp_size": 2}
        ours = next(m for m in load_float_model(files("qwen2_moe", "q8_0"), ops, model_registry, **kwargs).modules()
                    if isinstance(m, FusedMoE))
        reference = next(m for m in load_float_model(rounded_dir, ops, model_registry, **kwargs).modules()
                         if isinstance(m, FusedMoE))
        assert len(ours.expert_blocks) == 8 and ours.expert_blocks[0][1].in_features == 32
        for expert, (w13, w2) in enumerate(ours.expert_blocks):
            assert torch.equal(dequantize(w13), reference.w13_weight[expert]), (rank, expert)
            assert torch.equal(dequantize(w2), reference.w2_weight[expert]), (rank, expert)


def test_tensor_parallel_ranks_hold_what_they_hold_of_the_directory(sources, files, ops, model_registry):
    for rank in (0, 1):
        kwargs = {"tp_rank": rank, "tp_size": 2}
        model = load_float_model(files("qwen2_moe", "f32"), ops, model_registry, **kwargs)
        ours = dict(model.named_parameters())
        reference = dict(load_float_model(sources["qwen2_moe"], ops, model_registry, **kwargs).named_parameters())
        assert ours.keys() == reference.keys()
        for name, param in reference.items():
            assert torch.equal(ours[name], param), name
        experts = next(m for m in model.modules() if isinstance(m, FusedMoE))
        assert experts.w13_weight.shape == (8, 64, 64)  # half of every expert's 2 x 64 gate and up features



def test_expert_parallel_ranks_hold_whole_experts_of_the_file(sources, files, ops, model_registry, tmp_path):
    """--enable-expert-parallel: rank r keeps experts 4r..4r+3 of 8 whole, as Q8_0 blocks of all 64 features equal
    to the rounded directory's experts there; an F32 file's float experts equal the directory's rank."""
    rounded_dir = q8_0_round_trip_copy(sources["qwen2_moe"], tmp_path / "float", ROUTERS)

    def experts(path, rank):
        return next(m for m in load_float_model(path, ops, model_registry, tp_rank=rank, tp_size=2,
                                                expert_parallel=True).modules() if isinstance(m, FusedMoE))

    for rank in (0, 1):
        ours, reference = experts(files("qwen2_moe", "q8_0"), rank), experts(rounded_dir, rank)
        assert list(ours.local_experts()) == list(range(4 * rank, 4 * rank + 4))
        assert len(ours.expert_blocks) == 4 and ours.expert_blocks[0][1].in_features == 64
        for local, (w13, w2) in enumerate(ours.expert_blocks):
            assert torch.equal(dequantize(w13), reference.w13_weight[local]), (rank, local)
            assert torch.equal(dequantize(w2), reference.w2_weight[local]), (rank, local)
        floats, directory = experts(files("qwen2_moe", "f32"), rank), experts(sources["qwen2_moe"], rank)
        assert floats.w13_weight.shape == (4, 128, 64)
        assert torch.equal(floats.w13_weight, directory.w13_weight) and torch.equal(floats.w2_weight, directory.w2_weight)


def test_two_expert_parallel_ranks_decode_a_q8_0_file_as_one(files, monkeypatch, exact_w8_products):
    """Two gloo ranks of whole Q8_0 block experts (fp32 activations, the prompt's too rather than bf16-rounded on
    AVX512-BF16 CPUs: the sums differ in order only) give one rank's greedy tokens and logprobs."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("qwen2_moe", "q8_0"), enable_expert_parallel=True)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_config_carries_the_routing_llama_cpp_runs(preset, sources, files):
    ours, expected = load_hf_config(files(preset, "f32")), load_hf_config(sources[preset])
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "sparse_layers", "qkv_bias", "qk_norm",
                  "head_dim", "hidden_size", "num_hidden_layers"):
        assert getattr(ours, field) == getattr(expected, field), field


@pytest.mark.parametrize("preset,key,value,fragment", [
    ("qwen2_moe", "qwen2moe.expert_used_count", 9, "expert_used_count=9 exceeds qwen2moe.expert_count=8"),
    ("qwen3_moe", "qwen3moe.expert_count", 0, "qwen3moe.expert_count is 0; expected a whole number in 1..4096"),
    ("qwen3_moe", "qwen3moe.expert_count", 1 << 20, "expert_count is 1048576; expected a whole number"),
    ("qwen3_moe", "qwen3moe.expert_used_count", 0, "expert_used_count is 0"),
    ("qwen2_moe", "qwen2moe.expert_count", 6, "blk.0.ffn_gate_inp.weight has ggml shape (64, 8)"),
    ("qwen2_moe", "qwen2moe.expert_feed_forward_length", 48, "expert_feed_forward_length=48 differs"),
    ("qwen2_moe", "qwen2moe.expert_shared_feed_forward_length", 64, "shared_feed_forward_length=64 differs"),
    ("mixtral", "llama.feed_forward_length", 64, "llama.feed_forward_length=64 differs"),
    ("mixtral", "llama.expert_count", 0, "holds expert tensors (blk.0.ffn_gate_inp) but llama.expert_count is 0"),
])
def test_inconsistent_expert_metadata_is_refused_in_one_line(preset, key, value, fragment, files, tmp_path):
    assert gguf.GGUFReader(files(preset, "f32")).fields[key].types == [gguf.GGUFValueType.UINT32]
    path = patched_metadata(files(preset, "f32"), tmp_path / "bad.gguf", key, struct.pack("<I", value))
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_layer_without_its_experts_is_refused_before_loading(files, tmp_path):
    data = files("qwen3_moe", "f32").read_bytes()
    name = b"blk.1.ffn_up_exps.weight"
    assert data.count(name) == 1
    path = tmp_path / "bad.gguf"
    path.write_bytes(data.replace(name, b"blk.1.ffn_up_exps.wei9ht"))
    with pytest.raises(ModelLoadError, match=r"lacks blk\.1\.ffn_up_exps\.weight; llama\.cpp's qwen3moe graph"):
        load_hf_config(path)


def test_llm_runs_q8_0_expert_blocks_like_the_rounded_directory(sources, files, tmp_path, monkeypatch):
    """The cpu backend's quant_matmul on the experts' blocks, with its exact fp32 activations for Q8_0 (its default
    rounds them to int8 blocks as llama.cpp does), gives the greedy tokens of the Q8_0-rounded directory."""
    from flashllm import LLM, SamplingParams

    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    rounded = q8_0_round_trip_copy(sources["qwen3_moe"], tmp_path / "float", ROUTERS)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for model in (rounded, files("qwen3_moe", "q8_0")):
        llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
        results.append([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "hello"], params)])
    assert results[0] == results[1]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_llm_runs_a_moe_gguf_file_like_its_directory(preset, sources, files):
    """The engine's own path (the cpu backend's runner, the file's vocabulary as tokenizer), not only the model."""
    from flashllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for model in (sources[preset], files(preset, "f32")):
        llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
        results.append([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "hello"], params)])
    assert results[0] == results[1]


def test_bench_moe_quant_type_stores_a_gguf_file_s_experts_as_int8(k_quant_file, tmp_path):
    """`flashllm bench latency --moe_quant_type weight_only_int8`: the experts leave their Q4_K / Q6_K blocks (0.75
    and 1.25 bytes a weight unpacked) for the MoE layer's int8 codes (1 byte and a scale per row), in the JSON."""
    import json

    from flashllm.cli import main

    records = []
    for extra in ([], ["--moe_quant_type", "weight_only_int8"]):
        out = tmp_path / f"record{len(records)}.json"
        argv = ["bench", "latency", "--model", str(k_quant_file[1]), "--device", "cpu", "--input-len", "8",
                "--output-len", "4", "--num-prompts", "1", "--max-model-len", "64", "--json", str(out), *extra]
        assert main(argv) == 0
        records.append(json.loads(out.read_text()))
    assert [r["moe_quant_type"] for r in records] == [None, "weight_only_int8"]
    experts = 2 * 8 * 3 * 256 * 768  # layers x experts x projections x hidden x intermediate
    added = records[1]["loaded_weight_bytes"] - records[0]["loaded_weight_bytes"]
    assert 0.05 * experts < added < 0.1 * experts  # (2 x 1 + 1) / 3 - (2 x 0.75 + 1.25) / 3 = 0.083 a weight


def test_block_experts_keep_decode_steps_out_of_device_graphs(files, ops, model_registry):
    """The block experts' forward picks experts on the host: a device with graphs must run such a model eagerly."""
    from types import SimpleNamespace

    from flashllm.core.builder import _no_graphs_reason

    config = SimpleNamespace(device=SimpleNamespace(enforce_eager=False), lora=SimpleNamespace(enable_lora=False))
    selection = SimpleNamespace(adapter=SimpleNamespace(new_graph=lambda device: object()), device="cuda",
                                backend=SimpleNamespace(name="cuda"))
    blocks = load_float_model(files("mixtral", "q8_0"), ops, model_registry)
    floats = load_float_model(files("mixtral", "f32"), ops, model_registry)
    # the reference kernels read tensors on the host too: the float model is refused for its ops, not its layers
    assert "layers read values on the host" not in _no_graphs_reason(config, selection, ops, 1, floats)
    reason = _no_graphs_reason(config, selection, ops, 1, blocks)
    assert reason == "FusedMoE layers read values on the host each step (the chosen experts of GGUF block experts)"


def _fused_and_per_op(path, monkeypatch) -> list[tuple[list, list, int]]:
    """(tokens, logprobs, decode steps the fused call took) of the file through the cpu engine, with the fused
    decode step on and off; five sequences decode together and leave the batch one by one."""
    from flashllm import LLM, SamplingParams
    from flashllm.backends.cpu import decode_stack
    from flashllm.testing.fused_decode import record_fused_steps

    prompts, lengths = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], list(range(30, 63)), [9]], [12, 7, 14, 9, 4]
    runs = []
    for fused in (True, False):
        monkeypatch.setenv(decode_stack.ENV_SWITCH, "1" if fused else "0")
        taken = record_fused_steps(monkeypatch)
        llm = LLM(str(path), dtype="float32", device="cpu", block_size=16, num_kv_blocks=32, max_model_len=128,
                  num_scheduler_steps=1)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in lengths]
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], sum(taken)))
        monkeypatch.undo()
    return runs


@pytest.mark.parametrize("preset", [*PRESETS, "k_quants"])
def test_block_experts_decode_through_the_fused_step_as_through_the_per_op_path(preset, files, k_quant_file,
                                                                                monkeypatch):
    """The cpu backend's fused decode step runs block experts with each expert's own descriptor, built as the dense
    layers' (int8 activations as quant_matmul rounds them): the per-op path's tokens and logprobs."""
    from flashllm.backends.cpu import native

    if native.library() is None:
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    path = k_quant_file[1] if preset == "k_quants" else files(preset, "q8_0")
    (fused_tokens, fused_logprobs, taken), (tokens, logprobs, untaken) = _fused_and_per_op(path, monkeypatch)
    assert untaken == 0 and taken >= 13  # every decode step of the longest request went through the fused call
    assert fused_tokens == tokens
    diffs = torch.cat([(torch.tensor(ours) - torch.tensor(theirs)).abs().flatten()
                       for ours, theirs in zip(fused_logprobs, logprobs, strict=True)])
    # C's routing softmax and weighted sums round apart from torch's by an ulp or so; the next layer's int8
    # activations (quant_matmul's, in both paths) can turn that into one code's step at a rare position
    assert float(diffs.max()) < 5e-3 and int((diffs > 2e-5).sum()) <= diffs.numel() // 20


def test_two_ranks_with_uneven_block_shares_decode_as_one(k_quant_file, monkeypatch):
    """Two gloo ranks holding 512 and 256 of the K-quant experts' 768 features (whole Q6_K blocks of the down
    projection each) give one rank's greedy tokens and logprobs; fp32 activations, so the sums differ in order
    only."""
    monkeypatch.setenv("FLASHLLM_CPU_INT4_ACTIVATIONS", "fp32")
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], k_quant_file[1])
