"""MTP speculation with DeepSeek-V3's and GLM-4.5's next-token-prediction layers: the proposer's drafts against an
independent reference of the MTP forward (plain torch around transformers' own decoder layer, recomputed over the
whole sequence every time), greedy tokens equal to plain decoding under preemption and prefix caching, acceptance
in the stats, bad setups refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashllm.config import SpeculativeConfig
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.deepseek import PRESETS, build_deepseek_model, build_deepseek_mtp_model
from flashllm.testing.spec_engine import check_parity_under_preemption, random_prompts, spec_llm
from flashllm.testing.tiny_moe import build_glm4_moe_mtp_model

LAYERS = PRESETS["v3"][2]["num_hidden_layers"]
# the predictable model's output projections scale: about half the drafts accepted (measured 0.57 with k = 3)
PREDICTABLE = 0.03


BUILDERS = {"v3": lambda out, **kw: build_deepseek_mtp_model(out, "v3", **kw), "glm4_moe": build_glm4_moe_mtp_model,
            "glm4_moe_lite": lambda out, **kw: build_deepseek_mtp_model(out, "glm4_moe_lite", **kw)}


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"random" / "predictable" (DeepSeek-V3), "glm4_moe/random" / "glm4_moe/predictable" (GLM-4.5) and
    "glm4_moe_lite/..." (GLM-4.7-Flash: DeepSeek's MTP layer over its MLA decoder)."""
    dirs = {}
    for arch, build in BUILDERS.items():
        prefix = "" if arch == "v3" else f"{arch}/"
        dirs[prefix + "random"] = build(tmp_path_factory.mktemp(f"{arch}_random"), seed=5)
        dirs[prefix + "predictable"] = build(tmp_path_factory.mktemp(f"{arch}_pred"), seed=5, predictable=PREDICTABLE)
    return dirs


class ReferenceMTP:
    """The MTP forward written from the DeepSeek-V3 report, without any cache: the target's final hidden states
    from transformers' DeepseekV3 (last_hidden_state, after the final norm), then
    o = block(eh_proj([rmsnorm(emb(t_{i+1})) * enorm ; rmsnorm(h_i) * hnorm])) over every position at once,
    with transformers' own decoder layer as the block (layer N of an N + 1 layer model) and a causal mask,
    logits = shared_head.head(rmsnorm(o) * shared_head.norm). Draft j + 1 appends (o at the last position,
    draft j) and recomputes everything."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        layers = self.target.config.num_hidden_layers
        types = getattr(self.target.config, "mlp_layer_types", None)  # GLM-4.7-Flash's: its MTP block is MoE
        grown = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, num_hidden_layers=layers + 1,
                                                     attn_implementation="eager",
                                                     **({"mlp_layer_types": [*types, "sparse"]} if types else {})
                                                     ).eval()
        self.block, self.rotary = grown.model.layers[layers], grown.model.rotary_emb
        prefix = f"model.layers.{layers}."
        self.w = {k[len(prefix):]: v.float() for k, v in load_file(model_dir / "model.safetensors").items()
                  if k.startswith(prefix)}
        self.eps = self.target.config.rms_norm_eps

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        w = self.w
        hidden = self.target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]  # h_0 .. h_{n-1}
        inputs = list(tokens[1:])  # t_1 .. t_n
        out: list[int] = []
        for _ in range(k):
            x = torch.cat((self._norm(w["embed_tokens.weight"][torch.tensor(inputs)], w["enorm.weight"]),
                           self._norm(hidden, w["hnorm.weight"])), dim=-1) @ w["eh_proj.weight"].T
            n = x.shape[0]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            o = self.block(x[None], attention_mask=mask, position_ids=positions,
                           position_embeddings=self.rotary(x[None], positions))[0]
            logits = self._norm(o[-1], w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T
            out.append(int(logits.argmax()))
            inputs.append(out[-1])
            hidden = torch.cat((hidden, o[-1:]))
        return out


def _spy(llm: LLM) -> list[tuple[list[int], int, list[int]]]:
    """Record every proposer call: (the sequence's tokens, its draft limit, the drafts)."""
    proposer = llm.engine.speculator.proposer
    calls: list[tuple[list[int], int, list[int]]] = []
    propose = proposer.propose

    def spy(seqs, limits):
        drafts = propose(seqs, limits)
        calls.extend((list(seq.token_ids), limit, list(draft))
                     for seq, limit, draft in zip(seqs, limits, drafts, strict=True))
        return drafts

    proposer.propose = spy
    return calls


@pytest.mark.parametrize(("which", "guard"), [("random", 0.25), ("predictable", 0.0), ("glm4_moe/random", 0.25),
                                              ("glm4_moe/predictable", 0.0), ("glm4_moe_lite/predictable", 0.0)])
def test_drafts_equal_the_reference_mtp_forward(mtp_dirs, which: str, guard: float) -> None:
    """Every round's drafts (k = 3) equal the reference's from the same tokens: the catch-up over chunked prompts,
    over accepted drafts (predictable model) and over the rounds the guard paused drafting for (random model,
    nothing accepted), the MTP layer's own embedding and head (random model: they differ from the target's),
    its reuse for drafts 2 and 3."""
    model_dir = mtp_dirs[which]
    # prompts over 48 tokens prefill in chunks; single steps only: the rounds the guard pauses would
    # otherwise run as multi-step bursts (cpu fused decode), which leave the head a gap by design
    # (Speculator.burst_steps) and so no drafts on the round it resumes
    llm = spec_llm(model_dir, "cpu", SpeculativeConfig(method="mtp", num_speculative_tokens=3, min_acceptance=guard),
               max_num_batched_tokens=48, num_scheduler_steps=1)
    calls = _spy(llm)
    prompts = random_prompts(6, seed=11)
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(calls) >= 18 and max(len(p) for p in prompts) > 48
    reference = ReferenceMTP(model_dir)
    for tokens, limit, drafts in calls[::3]:
        assert drafts == reference.drafts(tokens, limit), f"after {len(tokens)} tokens"
    stats = llm.engine.speculator.stats
    if which.endswith("predictable"):
        assert 0 < stats.num_accepted < stats.num_drafted, stats


@pytest.mark.parametrize(("which", "backend", "k", "count", "blocks"), [
    ("predictable", "cpu", 3, 16, 24), ("predictable", "cpu", 1, 8, 96), ("predictable", "reference", 4, 8, 96),
    ("glm4_moe/predictable", "cpu", 3, 16, 24), ("glm4_moe/predictable", "reference", 2, 8, 96),
    ("glm4_moe_lite/predictable", "cpu", 3, 16, 24)])
def test_greedy_tokens_equal_plain_decoding(mtp_dirs, which: str, backend: str, k: int, count: int,
                                            blocks: int) -> None:
    """Under continuous batching, with preemption forced by a small cache (and prefix-cache hits from repeated
    prompts), speculation with the MTP layer changes no token; acceptance lands in the speculator's stats."""
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=k)
    check_parity_under_preemption(mtp_dirs[which], backend, spec, count, blocks)


def test_models_without_mtp_layers_are_refused(tmp_path: Path, mtp_dirs) -> None:
    plain_v3 = build_deepseek_model(tmp_path / "v3", "v3", seed=1)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        spec_llm(plain_v3, "cpu", SpeculativeConfig(method="mtp"))
    config = json.loads((plain_v3 / "config.json").read_text())
    (plain_v3 / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=f"no model.layers.{LAYERS}.eh_proj.weight"):
        spec_llm(plain_v3, "cpu", SpeculativeConfig(method="mtp"))
    from flashllm.testing.tiny_models import build_tiny_model

    llama = build_tiny_model(tmp_path / "llama", "llama", seed=1, tokenizer=False)
    with pytest.raises(ValueError, match="needs a DeepSeek-V3 or GLM-4.5 model with MTP layers"):
        spec_llm(llama, "cpu", SpeculativeConfig(method="mtp"))


def test_pending_hidden_states_follow_what_the_target_recomputed() -> None:
    """The per-sequence record of target hidden states: rows of rejected drafts are replaced when the target
    scores those positions again, a recompute from an earlier position (preemption) or a gap (steps that
    handed nothing over) restarts the record there."""
    from flashllm.core.spec.mtp import _Pending

    def rows(first: int, n: int, tag: float) -> torch.Tensor:
        return torch.stack([torch.tensor([float(first + i), tag]) for i in range(n)])

    pending = _Pending(0)
    pending.add(0, rows(0, 5, 0.0))      # a prompt
    pending.add(5, rows(5, 4, 1.0))      # a verify round: t_5 and drafts at 6, 7, 8
    pending.add(7, rows(7, 1, 2.0))      # only 6 was accepted: the next step scores position 7 again
    taken = pending.take(8)
    assert taken[:, 0].tolist() == list(range(8)) and taken[:, 1].tolist() == [0.0] * 5 + [1.0, 1.0, 2.0]
    assert (pending.base, pending.count) == (8, 0)
    pending.add(3, rows(3, 6, 3.0))      # preempted: recomputed from position 3
    assert (pending.base, pending.count) == (3, 6)
    pending.add(20, rows(20, 1, 4.0))    # positions 9..19 ran without handing their states over
    assert (pending.base, pending.count) == (20, 1) and pending.take(21)[:, 1].tolist() == [4.0]
