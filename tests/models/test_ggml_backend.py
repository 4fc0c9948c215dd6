"""The ggml backend (llama.cpp's arithmetic) in the engine gives flashllm.testing.ggml_cpu.LlamaGGUF's logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from safetensors.torch import load_file, save_file  # noqa: E402

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.backends.ggml import kernels, numerics  # noqa: E402
from flashllm.testing.ggml_cpu import LlamaGGUF  # noqa: E402
from flashllm.testing.gguf_files import write_gguf  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

# head_dim 64: ggml's f32 dot runs whole 64-feature steps; GQA (4 heads over 2); the token embedding
# (and so the tied head) Q8_0 as in SmolLM2's Q4_1 file, the emulation's layout
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 300, 77, 12, 1, 102, 64, 33, 7, 210, 150, 9, 60],
           [44, 2, 190, 71, 71, 13, 250, 6, 18]]
STEPS = 5
QK_GAIN = 0.25


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ggml")
    source = build_tiny_model(root / "src", "llama-tied", seed=11, **SHAPE)
    # attention scores of a few units, as a trained model's: with the tiny init's near-zero scores every
    # probability sits by 1/n and a 1-ulp difference in Q or K never reaches the attention's output bits
    weights = load_file(str(source / "model.safetensors"))
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = weights[name] * QK_GAIN
    save_file(weights, str(source / "model.safetensors"), metadata={"format": "pt"})
    return {q: write_gguf(source, root / f"{q}.gguf", q, types={"token_embd": "Q8_0"}) for q in ("Q4_1", "Q8_0")}


Rows = dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]


def _engine_rows(path: Path, prompts: list[list[int]], **engine: object) -> Rows:
    """Every (LM head input, logits) row pair the engine sampled from while it ran the prompts together, keyed by
    the context it scored. The head's input is the final norm of the residual stream: int8 rounding before each
    matmul absorbs most 1-ulp differences, the residual stream keeps them, so the test compares both."""
    llm = LLM(str(path), device="cpu", dtype="float32", backend="ggml", max_model_len=256, **engine)
    rows: Rows = {}
    heads: list[torch.Tensor] = []
    model, runner = llm.engine.parts.model, llm.engine.runner
    compute_logits, execute_model = model.compute_logits, runner.execute_model
    llm.engine.config.scheduler.num_scheduler_steps = 1  # one step per round: every sampled row goes through here

    def recording_logits(hidden: torch.Tensor) -> torch.Tensor:
        heads.append(hidden.clone())
        return compute_logits(hidden)

    def recording_step(batch, greedy: bool = False):
        logits = execute_model(batch)
        samplers = [item.seq for item in batch.scheduled if item.produces_token]
        hidden = heads.pop() if samplers else None
        for i, seq in enumerate(samplers):
            rows[tuple(seq.token_ids)] = (hidden[i].numpy().copy(), logits[i].numpy().copy())
        return runner.argmax(logits) if greedy else logits

    model.compute_logits, runner.execute_model = recording_logits, recording_step
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    return rows


class _Oracle(LlamaGGUF):
    """LlamaGGUF that also keeps its LM head's input (the final norm's output for the last token)."""

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if name in ("output.weight", "token_embd.weight"):
            self.head_input = x[-1].copy()
        return super()._linear(x, name)


def _oracle_rows(path: Path, prompt: list[int], tokens: list[int]) -> Rows:
    """The oracle's (head input, logits) after the prompt (one batch) and after each next token (one at a time)."""
    model, context = _Oracle(path), list(prompt)
    logits = model.forward(list(prompt))
    out = {tuple(context): (model.head_input, logits)}
    for token in tokens:
        context.append(token)
        logits = model.forward([token])
        out[tuple(context)] = (model.head_input, logits)
    return out


def _assert_bit_equal(rows: Rows, path: Path, prompt: list[int]) -> None:
    # the oracle follows the engine's own greedy tokens; each of its rows must be there, bit for bit
    longest = max((ctx for ctx in rows if ctx[:len(prompt)] == tuple(prompt)), key=len)
    tokens = list(longest[len(prompt):])
    assert len(tokens) == STEPS - 1
    for context, expected in _oracle_rows(path, prompt, tokens).items():
        for what, got, want in zip(("LM head input", "logits"), rows[context], expected, strict=True):
            assert got.dtype == np.float32 and np.array_equal(got, want), (
                f"{path.name}, {len(context)}-token context: the {what} differ from llama.cpp's arithmetic by up "
                f"to {np.abs(got - want).max():.3g}")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_two_sequences_prefill_and_decode_bit_equal_to_the_emulated_llama_cpp(qtype, tiny_gguf):
    rows = _engine_rows(tiny_gguf[qtype], PROMPTS)
    for prompt in PROMPTS:
        _assert_bit_equal(rows, tiny_gguf[qtype], prompt)


class _RecordingNumerics:
    """The numerics module as the ggml kernels see it, keeping every activation block_dot rounds to int8."""

    def __init__(self, sink: list[np.ndarray]) -> None:
        self._sink = sink

    def __getattr__(self, name: str):
        return getattr(numerics, name)

    def block_dot(self, x: np.ndarray, *blocks: np.ndarray) -> np.ndarray:
        self._sink.append(x.copy())
        return numerics.block_dot(x, *blocks)


class _RecordingOracle(LlamaGGUF):
    def __init__(self, path: Path, sink: list[np.ndarray]) -> None:
        super().__init__(path)
        self._sink = sink

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if not self._sink or not np.array_equal(self._sink[-1], x):  # q, k, v (gate, up) share one input
            self._sink.append(x.copy())
        return super()._linear(x, name)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_every_matmul_input_bit_equal_to_the_emulated_llama_cpp(qtype, tiny_gguf, monkeypatch):
    # Each int8 rounding before a matmul absorbs most 1-ulp differences of what feeds it (a norm, the rotary, the
    # attention, SwiGLU), so logits alone rarely see a wrong order on a 2-layer model; the matmul inputs do.
    # The engine's fused qkv and gate_up take the input the oracle's separate projections share.
    ours: list[np.ndarray] = []
    monkeypatch.setattr(kernels, "g", _RecordingNumerics(ours))
    rows = _engine_rows(tiny_gguf[qtype], PROMPTS[:1])
    tokens = list(max(rows, key=len)[len(PROMPTS[0]):])
    theirs: list[np.ndarray] = []
    oracle = _RecordingOracle(tiny_gguf[qtype], theirs)
    for ids in [PROMPTS[0]] + [[t] for t in tokens]:
        oracle.forward(list(ids))
    assert len(ours) == len(theirs) == (1 + len(tokens)) * (4 * 2 + 1)  # 4 per layer, the head, per step
    for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert np.array_equal(got, want), f"matmul input {i} (step {i // 9}, call {i % 9}) differs by up to " \
                                          f"{np.abs(got - want).max():.3g}"


def test_a_prompt_in_chunks_gives_the_same_bits(tiny_gguf):
    # per-token ops are row by row and each query row's attention sums over the same keys, so chunks of the
    # prompt change nothing as long as none holds a single token (llama.cpp's ubatch rule: then ggml's vec_dot
    # order for P.V); 8 + 8 + 3 tokens here, against the oracle's one 19-token batch
    rows = _engine_rows(tiny_gguf["Q4_1"], PROMPTS[:1], max_num_batched_tokens=8, max_num_seqs=1)
    _assert_bit_equal(rows, tiny_gguf["Q4_1"], PROMPTS[0])


def test_the_gguf_keeps_its_interleaved_rotary_pairs_and_ggml_angles(tiny_gguf):
    llm = LLM(str(tiny_gguf["Q8_0"]), device="cpu", dtype="float32", backend="ggml", max_model_len=256)
    try:
        rotary = llm.engine.parts.model.model.rotary_emb
        assert rotary.is_neox is False
        assert llm.engine.parts.ops.sources["paged_attention"] == "ggml"
    finally:
        llm.engine.shutdown()
    from flashllm.backends.ggml.numerics import rope_table

    cos, sin = rope_table(range(rotary.cos_sin_cache.shape[0]), 64, LlamaGGUF(tiny_gguf["Q8_0"]).base)
    assert torch.equal(rotary.cos_sin_cache, torch.from_numpy(np.concatenate([cos, sin], -1)))


def test_the_default_cpu_engine_is_untouched(tiny_gguf):
    llm = LLM(str(tiny_gguf["Q8_0"]), device="cpu", dtype="float32", max_model_len=256)
    try:
        assert llm.engine.parts.model.model.rotary_emb.is_neox is True
        assert "ggml" not in set(llm.engine.parts.ops.sources.values())
    finally:
        llm.engine.shutdown()
