"""GGUF files under tensor parallelism: each rank holds its slice of the stored blocks (no float copy),
and two gloo ranks give the greedy tokens and logprobs one rank gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.models.layers.linear import LinearBase  # noqa: E402
from flashllm.ops.quant_matmul import dequantize  # noqa: E402
from flashllm.testing.gguf_files import write_gguf  # noqa: E402
from flashllm.testing.loading import load_flashllm
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

STEPS = 24
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(40)], [5, 17, 99, 3], [(5 * i + 1) % 250 + 1 for i in range(23)]]
# rank shares of whole blocks: 64 / 128 input features per rank for the 32-blocks, 256 / 512 for the K-quants
SHAPES = {"Q8_0": {"hidden_size": 128, "intermediate_size": 256},
          "Q4_1": {"hidden_size": 128, "intermediate_size": 256},
          "Q4_K": {"hidden_size": 512, "intermediate_size": 1024}}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    files = {}
    for qtype, shape in SHAPES.items():
        root = tmp_path_factory.mktemp(qtype)
        source = build_tiny_model(root / "source", "llama", seed=5, **shape)
        files[qtype] = write_gguf(source, root / "model.gguf", qtype)
    return files


def _load(path: Path, rank: int = 0, tp: int = 1) -> torch.nn.Module:
    return load_flashllm(path, tp_rank=rank, tp_size=tp)


@pytest.mark.parametrize("qtype", sorted(SHAPES))
def test_each_rank_holds_its_slice_of_the_gguf_blocks(gguf_files: dict[str, Path], qtype: str) -> None:
    whole = {n: m for n, m in _load(gguf_files[qtype]).named_modules() if isinstance(m, LinearBase)}
    ranks = [dict(_load(gguf_files[qtype], rank, 2).named_modules()) for rank in range(2)]
    assert len(whole) == 8
    for name, module in whole.items():
        parts = [rank[name] for rank in ranks]
        assert all(p.qweight.gguf_type == qtype == module.qweight.gguf_type and p.weight is None for p in parts)
        dense = [dequantize(p.qweight) for p in parts]
        full = dequantize(module.qweight)
        if name.endswith(("o_proj", "down_proj")):  # row parallel: each rank its half of the input features
            torch.testing.assert_close(torch.cat(dense, dim=1), full, rtol=0, atol=0)
        else:  # column parallel: each rank its half of every fused projection's rows
            sizes = module.output_sizes if hasattr(module, "output_sizes") else None
            if sizes is None:  # qkv: 4 query heads, 2 kv heads of head_dim hidden / 4
                d = full.shape[1] // 4
                sizes = [4 * d, 2 * d, 2 * d]
            halves = [p.split([s // 2 for s in sizes]) for p in dense]
            joined = torch.cat([torch.cat([h[i] for h in halves]) for i in range(len(sizes))])
            torch.testing.assert_close(joined, full, rtol=0, atol=0)


def _run(path: Path, tp: int) -> list[tuple[list[int], list[float], list[list[tuple[int, float]]]]]:
    llm = LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp, block_size=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    try:
        outputs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs), list(o.outputs[0].top_logprobs))
            for o in outputs]


@pytest.mark.parametrize("qtype", sorted(SHAPES))
@pytest.mark.parametrize("activations", ["exact", "int8"])
def test_two_ranks_match_one_on_a_gguf_file(gguf_files: dict[str, Path], qtype: str, activations: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """exact: fp32 activations (inherited by the ranks), where two ranks' sums differ from one rank's in
    order only. int8 (the default): both round activations per block of a rank's own input features, the
    same blocks as one rank's; but rounding is discontinuous, so the sums' fp32 order flips a few codes,
    and logprobs agree only to within that rounding: tokens are equal up to a near tie, if any (one rank's
    runner-up within that rounding of its pick), and the run ends there."""
    if activations == "exact":
        monkeypatch.setenv("FLASHLLM_CPU_INT4_ACTIVATIONS", "fp32")
        monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    tolerance = 1e-4 if activations == "exact" else 0.05
    one, two = _run(gguf_files[qtype], 1), _run(gguf_files[qtype], 2)
    for (tokens1, logprobs1, top1), (tokens2, logprobs2, _) in zip(one, two, strict=True):
        assert len(tokens1) == len(tokens2) == STEPS
        same = next((i for i, (a, b) in enumerate(zip(tokens1, tokens2, strict=True)) if a != b), STEPS)
        if activations == "exact":
            assert same == STEPS
        elif same < STEPS:  # rounding moved a near tie: one rank's runner-up is two ranks' token, as likely
            runner_up = dict(top1[same])
            assert tokens2[same] in runner_up and logprobs1[same] - runner_up[tokens2[same]] < tolerance, \
                (same, top1[same], tokens2[same])
        gap = max((abs(a - b) for a, b in zip(logprobs1[:same], logprobs2[:same], strict=True)), default=0.0)
        assert gap < tolerance, gap
