"""EAGLE-1 heads: drafts against an independent reference of the head's forward (transformers' own Llama decoder
layer and the target's hidden states from transformers, recomputed over the whole sequence every time), greedy
tokens equal to plain decoding under preemption, acceptance in the stats, bad heads refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashllm.config import SpeculativeConfig
from flashllm.sampling_params import SamplingParams
from flashllm.testing.eagle import build_eagle_head
from flashllm.testing.greedy_rows import greedy_screen_rows
from flashllm.testing.spec_engine import check_parity_under_preemption, random_prompts, record_drafts, spec_llm
from flashllm.testing.tiny_models import build_tiny_model

PREDICTABLE = 0.03


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    random_target = build_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=3, tokenizer=False)
    predictable_target = build_tiny_model(tmp_path_factory.mktemp("ptarget"), "llama", seed=3, tokenizer=False)
    return {"target": random_target, "head": build_eagle_head(tmp_path_factory.mktemp("head"), random_target, seed=6),
            "ptarget": predictable_target,
            "phead": build_eagle_head(tmp_path_factory.mktemp("phead"), predictable_target, seed=6,
                                      predictable=PREDICTABLE)}


class ReferenceEagle:
    """The EAGLE-1 head's forward written from the paper, without any cache: the target's final hidden states
    h_0..h_{n-1} from transformers (last_hidden_state, after the final norm), then
    x = fc([emb(t_{i+1}) ; h_i]); o = transformers' LlamaDecoderLayer with its input norm replaced by the identity;
    logits = target lm_head(o) over every position with a causal mask. Draft j + 1 appends (o at the last
    position, draft j) and recomputes everything."""

    def __init__(self, target_dir: Path, head_dir: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        config = LlamaConfig(**json.loads((head_dir / "config.json").read_text()))
        config._attn_implementation = "eager"
        self.block = LlamaDecoderLayer(config, layer_idx=0).eval()
        self.block.input_layernorm = torch.nn.Identity()
        weights = load_file(head_dir / "model.safetensors")
        missing, unexpected = self.block.load_state_dict(
            {k[len("layers.0."):]: v for k, v in weights.items() if k.startswith("layers.0.")}, strict=False)
        assert missing == [] and unexpected == [], (missing, unexpected)
        self.rotary = LlamaRotaryEmbedding(config)
        self.fc_weight, self.fc_bias = weights["fc.weight"], weights["fc.bias"]

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        embed, head = self.target.model.embed_tokens, self.target.lm_head
        hidden = self.target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]  # h_0 .. h_{n-1}
        inputs = list(tokens[1:])  # t_1 .. t_n
        out: list[int] = []
        for _ in range(k):
            x = torch.cat((embed(torch.tensor(inputs)), hidden), dim=-1) @ self.fc_weight.T + self.fc_bias
            n = x.shape[0]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            o = self.block(x[None], attention_mask=mask, position_ids=positions,
                           position_embeddings=self.rotary(x[None], positions))[0]
            out.append(int(head(o[-1]).argmax()))
            inputs.append(out[-1])
            hidden = torch.cat((hidden, o[-1:]))
        return out


def _eagle(head: Path, k: int = 3, guard: float = 0.25) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle", model=str(head), num_speculative_tokens=k, min_acceptance=guard)


@pytest.mark.parametrize(("target", "head"), [("target", "head"), ("ptarget", "phead")])
def test_drafts_equal_the_reference_eagle_forward(eagle_dirs, target: str, head: str) -> None:
    """Every checked round's drafts (k = 3) equal the reference's from the same tokens: the catch-up over chunked
    prompts, over accepted drafts (predictable head) and over rejected ones (random head), the reuse of the
    head's output for drafts 2 and 3. (The guard is off: a paused sequence's bursts leave a gap in the head's
    cache, which test_a_paused_sequence_bursts_and_keeps_its_tokens covers.)"""
    llm = spec_llm(eagle_dirs[target], "cpu", _eagle(eagle_dirs[head], guard=0.0), max_num_batched_tokens=48)
    calls = record_drafts(llm)
    prompts = random_prompts(6, seed=11)
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(calls) >= 18 and max(len(p) for p in prompts) > 48
    reference = ReferenceEagle(eagle_dirs[target], eagle_dirs[head])
    for tokens, limit, drafts in calls[::3]:
        assert drafts == reference.drafts(tokens, limit), f"after {len(tokens)} tokens"
    stats = llm.engine.speculator.stats
    if head == "phead":
        assert 0 < stats.num_accepted < stats.num_drafted, stats


@pytest.mark.parametrize(("backend", "k", "count", "blocks"), [("cpu", 3, 16, 24), ("reference", 4, 8, 96)])
def test_greedy_tokens_equal_plain_decoding(eagle_dirs, backend: str, k: int, count: int, blocks: int) -> None:
    """Under continuous batching, with preemption forced by a small cache and prefix-cache hits, an EAGLE head
    changes no token; acceptance rate and mean accepted length land in the speculator's stats."""
    check_parity_under_preemption(eagle_dirs["ptarget"], backend, _eagle(eagle_dirs["phead"], k=k), count, blocks)


@pytest.mark.parametrize("handed_over", [True, False], ids=["bursts-feed-head", "bursts-leave-gaps"])
def test_a_paused_sequence_bursts_and_keeps_its_tokens(eagle_dirs, monkeypatch, handed_over: bool) -> None:
    """A random head is soon paused by the guard: the paused sequences then run multi-step bursts, and drafting
    again changes no token, whether the bursts hand the head their hidden states (the cpu runner's) or not (as
    on a backend whose multi-step calls do not: the head then resumes with a gap in its cache)."""
    from flashllm.backends.cpu.runner import CpuRunner

    bursts: list[int] = []
    execute_burst = CpuRunner.execute_burst
    if not handed_over:
        monkeypatch.setattr(CpuRunner, "bursts_feed_hidden_sink", False)

    def counting(self, batch, states, steps):
        sink = self.hidden_sink
        if not handed_over:
            self.hidden_sink = None
        try:
            rows = execute_burst(self, batch, states, steps)
        finally:
            self.hidden_sink = sink
        if rows is not None:
            bursts.append(len(rows))
        return rows

    monkeypatch.setattr(CpuRunner, "execute_burst", counting)
    target = eagle_dirs["target"]
    prompts = random_prompts(6, seed=5)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in spec_llm(target, "cpu", None).generate(prompts, params, use_tqdm=False)]
    bursts.clear()
    # batches the greedy screen, and so a burst, takes (two sequences on an AVX2 CPU)
    llm = spec_llm(target, "cpu", _eagle(eagle_dirs["head"], guard=0.25), max_num_seqs=greedy_screen_rows())
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert spec == plain
    assert bursts and max(bursts) > 1, f"no paused sequence ran a burst: {bursts}"
    assert llm.engine.speculator.stats.num_drafted > 0


def test_heads_that_do_not_fit_the_target_are_refused(eagle_dirs, tmp_path: Path) -> None:
    """Another hidden size, another vocabulary, more than one layer, no head directory: one line, at load."""
    target = eagle_dirs["target"]
    cases = {"hidden_size 32": build_eagle_head(tmp_path / "narrow", target, hidden_size=32, intermediate_size=64),
             "vocab_size 300": build_eagle_head(tmp_path / "vocab", target, vocab_size=300),
             "num_hidden_layers=2": build_eagle_head(tmp_path / "deep", target, num_hidden_layers=2)}
    for message, head in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            spec_llm(target, "cpu", _eagle(head))
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="--speculative-model"):
        spec_llm(target, "cpu", SpeculativeConfig(method="eagle"))
