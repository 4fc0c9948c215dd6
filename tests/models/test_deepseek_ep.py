"""Expert parallelism (--enable-expert-parallel): each rank holds whole experts, E / ranks of them, runs the
(token, expert) pairs routed to them and the ranks' sums are all-reduced. Checked against the reference
fused_moe on every expert, against one rank through the engine over gloo, and against transformers."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.moe import FusedMoE
from flashllm.ops.fused_moe import fused_moe as reference_fused_moe
from flashllm.quant.spec import weight_quant_spec
from flashllm.sampling_params import SamplingParams
from flashllm.testing.deepseek import build_deepseek_model
from flashllm.testing.tiny_models import build_tiny_model

E, H, INTER, K = 8, 16, 12, 3  # experts, hidden, intermediate, experts a token


class _Unread:
    """A checkpoint tensor stand-in whose shape is known but whose data must never be read."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = torch.Size(shape)

    def __getattr__(self, name: str):
        raise AssertionError(f"another rank's expert tensor was read ({name})")


def _experts(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(E, INTER, H, generator=gen), torch.randn(E, INTER, H, generator=gen),
            torch.randn(E, H, INTER, generator=gen), torch.randn(6, H, generator=gen))


def _rank_layer(ops, rank: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> FusedMoE:
    """Rank `rank` of two expert-parallel ranks, loaded expert by expert as a per-expert checkpoint is."""
    layer = FusedMoE(E, H, INTER, ops, torch.float32, torch.device("cpu"), tp_rank=rank, tp_size=2,
                     expert_parallel=True)
    assert tuple(layer.w13_weight.shape) == (E // 2, 2 * INTER, H) and tuple(layer.w2_weight.shape) == (E // 2, H, INTER)
    for expert in range(E):
        mine = rank * E // 2 <= expert < (rank + 1) * E // 2
        for part, tensor in (("gate", gate), ("up", up), ("down", down)):
            loaded = tensor[expert] if mine else _Unread(tuple(tensor[expert].shape))
            param = layer.w2_weight if part == "down" else layer.w13_weight
            param.weight_loader(param, loaded, (expert, part))
    assert layer.fully_loaded() == {"w13_weight", "w2_weight"}
    return layer


@pytest.mark.parametrize("quant_type", ["none", "weight_only_int8"])
def test_two_ranks_of_whole_experts_sum_to_the_reference_over_every_expert(ops, quant_type: str) -> None:
    """Six tokens, three experts each (some tokens with several on one rank, some with none): the two ranks'
    shares add up to the reference fused_moe on the whole (E, 2I, H) / (E, H, I) stacks, int8 experts too
    (each rank quantizes its own experts per output channel, as one rank does)."""
    gate, up, down, x = _experts(seed=3)
    w13, w2 = torch.cat((gate, up), dim=1), down
    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(x.shape[0])])
    ids[0] = torch.tensor([0, 1, 2])  # every expert on rank 0
    weights = torch.rand(ids.shape, generator=gen)
    quant = weight_quant_spec(quant_type, -1, False)
    total = torch.zeros_like(x)
    for rank in range(2):
        layer = _rank_layer(ops, rank, gate, up, down)
        layer.process_weights_after_loading(quant)
        assert layer.w13_weight.dtype == (torch.int8 if quant.enabled else torch.float32)
        total += layer._local_experts(x, weights, ids)
    if quant.enabled:
        whole = FusedMoE(E, H, INTER, ops, torch.float32, torch.device("cpu"))
        whole.w13_weight.data.copy_(w13)
        whole.w2_weight.data.copy_(w2)
        whole.process_weights_after_loading(quant)
        expected = reference_fused_moe(x, whole.w13_weight, whole.w2_weight, weights, ids,
                                       whole.w13_scale, whole.w2_scale)
    else:
        expected = reference_fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-5)


def test_experts_that_do_not_split_evenly_are_refused(ops) -> None:
    with pytest.raises(ValueError, match="7 experts do not split evenly over 2 expert-parallel ranks"):
        FusedMoE(7, H, INTER, ops, torch.float32, torch.device("cpu"), tp_rank=0, tp_size=2, expert_parallel=True)


def test_a_model_without_expert_parallelism_refuses_the_flag(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path, "llama", seed=1, tokenizer=False)
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM does not implement expert parallelism"):
        LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16, block_size=16,
            enable_expert_parallel=True)


def _greedy(model_dir, tp: int, **options) -> list[tuple[list[int], list]]:
    prompts = [[(7 * i + 3) % 250 + 1 for i in range(n)] for n in (5, 23, 40)]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None, block_size=16, num_kv_blocks=32,
              max_num_batched_tokens=16, **options)
    try:
        if options.get("enable_expert_parallel"):  # the driver is rank 0: it holds experts 0..3 of 8, whole
            moe = llm.engine.parts.model.model.layers[1].mlp.experts
            assert (moe.num_local_experts, moe.first_expert, moe.w2_weight.shape[0]) == (4, 0, 4)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()  # a later tensor-parallel test in this process must be able to join a group
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outputs]


@pytest.mark.parametrize("quant_type", ["none", "weight_only_int8"])
def test_two_expert_parallel_ranks_give_one_rank_s_tokens(tmp_path, quant_type: str, exact_w8_products) -> None:
    """DeepSeek-V3 with 8 experts, 4 a rank (MLA and shared experts tensor parallel), over gloo, 16-token
    prefill chunks: the greedy tokens of one rank, and their logprobs within 1e-4 (w8a16 on fp32 activations:
    bf16 rounding would turn the all-reduce's fp32 order into rounding-sized steps)."""
    model_dir = build_deepseek_model(tmp_path, "v3", seed=5)
    one = _greedy(model_dir, 1, quant_type=quant_type)
    two = _greedy(model_dir, 2, quant_type=quant_type, enable_expert_parallel=True)
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one, two, strict=True):
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4


def test_serve_builds_expert_parallel_ranks(tmp_path) -> None:
    """`flashllm serve -tp 2 --distributed-executor-backend mp --enable-expert-parallel`: the engine the server
    builds holds 4 of the 8 experts whole on its driver rank and gives one rank's greedy tokens."""
    from flashllm.cli import build_parser
    from flashllm.cli import serve as serve_cli
    from flashllm.serving import server

    model_dir = build_deepseek_model(tmp_path, "v3", seed=5)
    one = _greedy(model_dir, 1)
    args = build_parser().parse_args(["serve", str(model_dir), "--device", "cpu", "--dtype", "float32", "-tp", "2",
                                      "--distributed-executor-backend", "mp", "--enable-expert-parallel",
                                      "--block-size", "16", "--num-kv-blocks", "32", "--max-num-batched-tokens", "16"])
    engine = server._build_engine(serve_cli.resolve_options(args, {}))
    try:
        moe = engine.parts.model.model.layers[1].mlp.experts
        assert (moe.num_local_experts, moe.first_expert, moe.w2_weight.shape[0]) == (4, 0, 4)
        prompts = [[(7 * i + 3) % 250 + 1 for i in range(n)] for n in (5, 23, 40)]
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                               request_id=str(i))
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        engine.shutdown()
    assert [finished[str(i)] for i in range(len(prompts))] == [tokens for tokens, _ in one]
