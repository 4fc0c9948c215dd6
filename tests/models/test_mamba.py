"""Mamba and FalconMamba: config.json read as transformers reads it, the selective scan of chunks and decodes equal
to the token-by-token recurrence, paged forwards and whole-engine greedy tokens equal to transformers' (prefill chunks that
carry the states, concurrent requests, preemption, one-token prompts), and two tensor-parallel ranks as one."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mamba import selective_scan
from flashllm.models.layers.recurrent import state_spans
from flashllm.models.mamba import FalconMambaForCausalLM, MambaForCausalLM
from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.hybrid_checks import check_paged_states
from flashllm.testing.parity import random_tokens
from flashllm.testing.state_slots import (
    check_bfloat16_follows_transformers,
    check_fresh_sequences_in_reused_slots,
    check_preemption_recomputes_states,
    check_states_across_prefill_chunks,
    recurrent_llm,
)
from flashllm.testing.tiny_models import build_tiny_model

PRESETS = ("mamba", "falcon_mamba")
CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "state_size", "num_hidden_layers", "conv_kernel",
                 "time_step_rank", "use_bias", "use_conv_bias", "layer_norm_epsilon", "residual_in_fp32",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id")
VARIANTS = [
    {},
    {"hidden_size": 80, "expand": 3, "time_step_rank": 7, "state_size": 4, "conv_kernel": 2, "use_bias": True,
     "use_conv_bias": False, "residual_in_fp32": False, "tie_word_embeddings": False, "layer_norm_epsilon": 1e-3,
     "eos_token_id": [2, 5], "mixer_rms_eps": 1e-3, "intermediate_size": 200},  # given: it wins over expand
]


@pytest.mark.parametrize("changes", VARIANTS)
@pytest.mark.parametrize("model_type, architecture", [("mamba", "MambaForCausalLM"),
                                                      ("falcon_mamba", "FalconMambaForCausalLM")])
def test_config_reads_as_transformers_reads_it(model_type, architecture, changes) -> None:
    from transformers import AutoConfig

    raw = {"model_type": model_type, "architectures": [architecture], **changes}
    ours = parse_hf_config(raw)
    theirs = AutoConfig.for_model(**raw)
    for name in CONFIG_FIELDS:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.mixer_rms_eps == (theirs.mixer_rms_eps if model_type == "falcon_mamba" else None)


@pytest.mark.parametrize("changes, fragment", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "float checkpoints only"),
    ({"state_size": 0}, "state_size=0"),
    ({"time_step_rank": "big"}, "time_step_rank='big'"),
    ({"use_bias": "yes"}, "use_bias='yes'"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({"model_type": "mamba", "architectures": ["MambaForCausalLM"], **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_tensor_parallel_size_that_splits_no_channels_evenly_is_refused(ops) -> None:
    config = parse_hf_config({"architectures": ["MambaForCausalLM"], "hidden_size": 64, "vocab_size": 256})
    with pytest.raises(ValueError, match="intermediate size 128 does not split over 3 tensor-parallel ranks"):
        MambaForCausalLM(config, ops, torch.float32, torch.device("cpu"), tp_rank=0, tp_size=3)


def _metadata(q_lens: list[int], contexts: list[int], slots: list[int]) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(contexts, q_lens, strict=True)], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64), cu_seqlens_q=cu,
                             seq_lens=seq_lens, block_tables=torch.zeros(len(q_lens), 1, dtype=torch.int32),
                             max_seqlen_q=max(q_lens), max_seqlen_k=int(seq_lens.max()),
                             state_slots=torch.tensor(slots, dtype=torch.int64))


def _recurrence(x, dt, A, B, C):
    """The definition, one token at a time from a zero state: (L, I) outputs and the last state."""
    h = torch.zeros(A.shape)
    ys = []
    for t in range(len(x)):
        h = torch.exp(dt[t, :, None] * A) * h + (dt[t] * x[t])[:, None] * B[t]
        ys.append(h @ C[t])
    return torch.stack(ys), h


def test_scan_of_chunks_and_decodes_equals_the_token_by_token_recurrence() -> None:
    torch.manual_seed(0)
    length, channels, width = 140, 6, 5  # chunks longer than SCAN_BLOCK (64), so they cross blocks
    x, B, C = torch.randn(length, channels), torch.randn(length, width), torch.randn(length, width)
    dt, A = torch.rand(length, channels), -torch.rand(channels, width) * 2
    want, last = _recurrence(x, dt, A, B, C)
    state = torch.full((2, channels, width), float("nan"))  # stale: the fresh first chunk must not read it

    def run(lo: int, hi: int, context: int):
        return selective_scan(x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], state,
                              state_spans(_metadata([hi - lo], [context], [1])))

    got = [run(0, 70, 0), run(70, 138, 70), run(138, 139, 138), run(139, 140, 139)]  # two chunks, two decodes
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[1], last, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """preset -> (model directory, flashllm model, transformers model)."""
    from transformers import AutoModelForCausalLM

    from flashllm.backends.reference import reference_op_table
    from flashllm.models.loader import load_model
    from flashllm.testing.loading import builtin_registry

    built = {}
    for preset in PRESETS:
        path = build_tiny_model(tmp_path_factory.mktemp(preset), preset, seed=1, tokenizer=False)
        ours, _ = load_model(path, reference_op_table(), torch.float32, "cpu", builtin_registry(), progress=False)
        built[preset] = (path, ours, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    return built


@pytest.mark.parametrize("preset", PRESETS)
def test_paged_prefill_decode_and_chunks_match_transformers(preset, tiny, paged_driver) -> None:
    _, ours, theirs = tiny[preset]
    check_paged_states(ours, theirs, paged_driver, ours.config.vocab_size)


@pytest.mark.parametrize("preset", PRESETS)
def test_prompts_prefilled_eight_tokens_a_step_carry_their_states_across_chunks(preset, tiny) -> None:
    path, ours, theirs = tiny[preset]
    check_states_across_prefill_chunks(path, theirs, ours.config.vocab_size)


def test_concurrent_requests_and_one_token_prompts_in_reused_slots_match_transformers(tiny) -> None:
    path, ours, theirs = tiny["mamba"]
    check_fresh_sequences_in_reused_slots(path, theirs, ours.config.vocab_size)


def test_forced_preemption_recomputes_the_states_from_scratch(tiny) -> None:
    path, ours, theirs = tiny["mamba"]
    check_preemption_recomputes_states(path, theirs, ours.config.vocab_size)


@pytest.mark.parametrize("preset", PRESETS)
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(preset, tiny) -> None:
    path, ours, _ = tiny[preset]
    two_ranks_decode_as_one([random_tokens(n, ours.config.vocab_size, seed=n) for n in (1, 9, 30)], path)


def test_each_rank_keeps_its_channels_states_and_no_attention_cache(ops) -> None:
    config = parse_hf_config({"architectures": ["FalconMambaForCausalLM"], "hidden_size": 64, "vocab_size": 256,
                              "num_hidden_layers": 3, "state_size": 8, "conv_kernel": 3})
    model = FalconMambaForCausalLM(config, ops, torch.bfloat16, torch.device("cpu"), tp_rank=1, tp_size=2)
    assert model.kv_cache_shape()[0] == 0
    assert model.state_cache_shapes() == [(((64, 2), torch.bfloat16), ((64, 8), torch.float32))] * 3


def test_bfloat16_engine_follows_transformers_bfloat16(tiny) -> None:
    path, ours, _ = tiny["falcon_mamba"]
    check_bfloat16_follows_transformers(path, ours.config.vocab_size)


def test_weight_only_quantized_linears_keep_the_float_tokens(tiny) -> None:
    from flashllm.sampling_params import SamplingParams

    path, ours, _ = tiny["mamba"]
    prompts = [random_tokens(n, ours.config.vocab_size, seed=n) for n in (30, 13, 1)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in recurrent_llm(path, num_kv_blocks=64, **options).generate(
        prompts, params, use_tqdm=False)] for options in ({}, {"quant_type": "w8a16"})]
    assert runs[0] == runs[1]
