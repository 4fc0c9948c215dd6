"""EAGLE-3 heads: drafts against an independent reference of the head's forward (transformers' Llama attention,
MLP and norms, the target's layer inputs from transformers' output_hidden_states, recomputed over the whole
sequence every time), greedy tokens equal to plain decoding under preemption, the cpu backend's fused decode
step keeping the taps, bad heads refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashllm.config import SpeculativeConfig
from flashllm.models.eagle import default_tap_layers
from flashllm.sampling_params import SamplingParams
from flashllm.testing.eagle import build_eagle3_head, build_eagle_head
from flashllm.testing.spec_engine import check_parity_under_preemption, random_prompts, record_drafts, spec_llm
from flashllm.testing.tiny_models import build_tiny_model

PREDICTABLE = 0.03
LAYERS = 8  # the default taps (2, L // 2, L - 3) are three different layers from 6 on


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    mk = tmp_path_factory.mktemp
    target = build_tiny_model(mk("target"), "llama", seed=3, tokenizer=False, num_hidden_layers=LAYERS)
    ptarget = build_tiny_model(mk("ptarget"), "llama", seed=3, tokenizer=False, num_hidden_layers=LAYERS)
    return {"target": target, "ptarget": ptarget,
            "head": build_eagle3_head(mk("head"), target, seed=6),
            # the other published spelling, its own embedding, the residual after hidden_norm, chosen layers
            # (layer 0's input is the embedding itself)
            "head_b": build_eagle3_head(mk("head_b"), target, seed=7, own_embedding=True, midlayer=False,
                                        norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[5, 0, 3]),
            "phead": build_eagle3_head(mk("phead"), ptarget, seed=6, predictable=PREDICTABLE)}


class ReferenceEagle3:
    """The EAGLE-3 head's forward as published, without any cache: the target's layer inputs from transformers
    (output_hidden_states[i] is what enters layer i), g = fc(their concatenation) at positions 0..n-1; then
    x = [input_layernorm(emb(t_{i+1})) ; hidden_norm(g_i)], transformers' LlamaAttention over x (built 2 * hidden
    wide, its o_proj padded with zero rows and cut back), + g_i (or + hidden_norm(g_i)), + LlamaMLP after
    post_attention_layernorm; the draft is d2t's map of argmax lm_head(norm(o)). Draft j + 1 appends (o at the
    last position, draft j) and recomputes everything."""

    def __init__(self, target_dir: Path, head_dir: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama import modeling_llama as hf

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        raw = json.loads((head_dir / "config.json").read_text())
        num_layers = self.target.config.num_hidden_layers
        self.taps = sorted(raw.get("eagle_aux_hidden_state_layer_ids") or default_tap_layers(num_layers))
        self.norm_before_residual = bool(raw.get("norm_before_residual"))
        h = raw["hidden_size"]
        fields = {k: v for k, v in raw.items() if k not in ("architectures", "draft_vocab_size", "hidden_size")}
        config = LlamaConfig(**fields, hidden_size=2 * h, head_dim=h // raw["num_attention_heads"])
        config._attn_implementation = "eager"
        w = {k.removeprefix("midlayer.").removeprefix("layers.0."): v for k, v in load_file(
            head_dir / "model.safetensors").items()}
        self.attn = hf.LlamaAttention(config, layer_idx=0).eval()
        attn_w = {k.removeprefix("self_attn."): v for k, v in w.items() if k.startswith("self_attn.")}
        for name in ("o_proj.weight", "o_proj.bias"):  # o_proj writes the first h of 2h outputs
            if name in attn_w:
                attn_w[name] = torch.cat((attn_w[name], torch.zeros_like(attn_w[name])))
        self.attn.load_state_dict(attn_w, strict=True)
        self.rotary = hf.LlamaRotaryEmbedding(config)
        small = LlamaConfig(**{**fields, "hidden_size": h})
        self.mlp = hf.LlamaMLP(small).eval()
        self.mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in w.items() if k.startswith("mlp.")})
        self.norms = {}
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
            self.norms[name] = hf.LlamaRMSNorm(h, eps=raw["rms_norm_eps"]).eval()
            self.norms[name].weight.data.copy_(w[f"{name}.weight"])
        self.fc, self.lm_head = w["fc.weight"], w["lm_head.weight"]
        self.embed = w.get("embed_tokens.weight", self.target.model.embed_tokens.weight.detach())
        self.draft_to_target = torch.arange(self.lm_head.shape[0]) + w["d2t"]

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        states = self.target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        hidden = torch.cat([states[i][0, :-1] for i in self.taps], dim=-1) @ self.fc.T  # g_0 .. g_{n-1}
        inputs = list(tokens[1:])  # t_1 .. t_n
        out: list[int] = []
        n1 = self.norms
        for _ in range(k):
            normed = n1["hidden_norm"](hidden)
            x = torch.cat((n1["input_layernorm"](self.embed[torch.tensor(inputs)]), normed), dim=-1)[None]
            n = x.shape[1]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            attended = self.attn(x, position_embeddings=self.rotary(x, positions), attention_mask=mask)[0][0]
            r = attended[:, : hidden.shape[1]] + (normed if self.norm_before_residual else hidden)
            o = r + self.mlp(n1["post_attention_layernorm"](r))
            out.append(int(self.draft_to_target[(n1["norm"](o[-1]) @ self.lm_head.T).argmax()]))
            inputs.append(out[-1])
            hidden = torch.cat((hidden, o[-1:]))
        return out


def _eagle3(head: Path, k: int = 3, guard: float = 0.25, method: str = "eagle3") -> SpeculativeConfig:
    return SpeculativeConfig(method=method, model=str(head), num_speculative_tokens=k, min_acceptance=guard)


@pytest.mark.parametrize(("target", "head", "method"),
                         [("target", "head", "eagle3"), ("target", "head_b", "eagle"), ("ptarget", "phead", "eagle3")])
def test_drafts_equal_the_reference_eagle3_forward(dirs, target: str, head: str, method: str) -> None:
    """Every checked round's drafts (k = 3) equal the reference's from the same tokens: the tapped layers (the
    default ones, and chosen ones including layer 0), the catch-up over chunked prompts and over accepted
    (predictable head) and rejected drafts, the reuse of the head's output, the draft-to-target id map. Method
    eagle loads an EAGLE-3 head too."""
    llm = spec_llm(dirs[target], "cpu", _eagle3(dirs[head], guard=0.0, method=method), max_num_batched_tokens=48)
    calls = record_drafts(llm)
    prompts = random_prompts(6, seed=11)
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(calls) >= 18 and max(len(p) for p in prompts) > 48
    reference = ReferenceEagle3(dirs[target], dirs[head])
    draft_ids = set(reference.draft_to_target.tolist())
    assert len(draft_ids) < 256
    for tokens, limit, drafts in calls[::3]:
        assert drafts == reference.drafts(tokens, limit), f"after {len(tokens)} tokens"
        assert set(drafts) <= draft_ids
    stats = llm.engine.speculator.stats
    if head == "phead":
        assert 0 < stats.num_accepted < stats.num_drafted, stats


@pytest.mark.parametrize(("builder", "preset", "taps"), [("moe", "mixtral", [0, 1, 2]), ("moe", "qwen2_moe", [1, 3, 5]),
                                                    ("deepseek", "v3", [0, 1, 2])])
def test_moe_and_latent_attention_targets(tmp_path: Path, tapped_steps, builder: str, preset: str,
                                          taps: list[int]) -> None:
    """Mixture-of-experts (Mixtral, Qwen2-MoE) and latent-attention (DeepSeek-V3) targets hand over their
    layers too, through the fused step's MoE and MLA layers: drafts equal the reference's, greedy tokens
    equal plain decoding, drafts were accepted and rejected. The heads' configs say 64 positions, fewer than
    the prompts reach: the head's rotary table covers the target's."""
    from flashllm.testing.deepseek import build_deepseek_model
    from flashllm.testing.tiny_moe import build_moe_model

    if builder == "moe":  # Mixtral's preset has 2 layers: one more, for three taps
        target = build_moe_model(tmp_path / "target", preset, seed=3, num_hidden_layers=max(taps) + 1)
    else:
        target = build_deepseek_model(tmp_path / "target", preset, seed=3)
    # a head config shorter than the prompts: it drafts at the target's positions all the same
    head = build_eagle3_head(tmp_path / "head", target, seed=6, predictable=PREDICTABLE,
                             eagle_aux_hidden_state_layer_ids=taps, max_position_embeddings=64)
    prompts = random_prompts(6, seed=12)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in spec_llm(target, "cpu", None).generate(prompts, params, use_tqdm=False)]
    llm = spec_llm(target, "cpu", _eagle3(head, guard=0.0))
    calls = record_drafts(llm)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert spec == plain
    assert max(tapped_steps) > len(prompts), "no verify step ran the fused call with taps"
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted < stats.num_drafted, stats
    reference = ReferenceEagle3(target, head)
    for tokens, limit, drafts in calls[::4]:
        assert drafts == reference.drafts(tokens, limit), f"after {len(tokens)} tokens"


@pytest.fixture
def tapped_steps(monkeypatch) -> list[int]:
    """The token counts of the steps the cpu backend's fused decode call ran with taps bound."""
    from flashllm.backends.cpu.decode_stack import FusedDecode

    steps: list[int] = []
    bind = FusedDecode._bind_taps

    def counting(self, tokens):
        out = bind(self, tokens)
        if out is not None and out is not False:
            steps.append(tokens)
        return out

    monkeypatch.setattr(FusedDecode, "_bind_taps", counting)
    return steps


def _drafted(llm, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every round's drafts while `llm` generates."""
    calls = record_drafts(llm)
    llm.generate(prompts, params, use_tqdm=False)
    return [drafts for _, _, drafts in calls]


@pytest.mark.parametrize("head", ["head", "phead"])
def test_the_fused_decode_step_keeps_the_taps(dirs, monkeypatch, tapped_steps, head: str) -> None:
    """The cpu backend's fused decoder-stack step keeps the tapped layers' streams in its native call: it runs
    the decode and verify steps with the head loaded, and every round's drafts equal those of the
    layer-by-layer forward (FLASHLLM_CPU_FUSED_DECODE=0)."""
    target = dirs["ptarget" if head == "phead" else "target"]
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    fused_llm = spec_llm(target, "cpu", _eagle3(dirs[head], guard=0.0))
    fused = _drafted(fused_llm, prompts, params)
    assert fused_llm.engine.runner._fused_decode is not None and max(tapped_steps) > len(prompts), tapped_steps
    monkeypatch.setenv("FLASHLLM_CPU_FUSED_DECODE", "0")
    plain_llm = spec_llm(target, "cpu", _eagle3(dirs[head], guard=0.0))
    plain = _drafted(plain_llm, prompts, params)
    assert plain_llm.engine.runner._fused_decode is None
    assert fused == plain and sum(map(len, fused)) > 20


@pytest.mark.parametrize(("backend", "k", "count", "blocks"), [("cpu", 3, 16, 24), ("reference", 4, 8, 96)])
def test_greedy_tokens_equal_plain_decoding(dirs, backend: str, k: int, count: int, blocks: int) -> None:
    """Under continuous batching, with preemption forced by a small cache and prefix-cache hits, an EAGLE-3
    head changes no token; acceptance rate and mean accepted length land in the speculator's stats."""
    check_parity_under_preemption(dirs["ptarget"], backend, _eagle3(dirs["phead"], k=k), count, blocks)


def _edit(head: Path, tmp: Path, config: dict | None = None, tensors: dict | None = None,
          drop: tuple[str, ...] = ()) -> Path:
    """A copy of `head` with config fields replaced and tensors replaced or dropped."""
    from safetensors.torch import load_file, save_file

    out = tmp / f"edit{len(list(tmp.iterdir()))}"
    out.mkdir()
    raw = json.loads((head / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, **(config or {})}))
    weights = {k: v for k, v in load_file(head / "model.safetensors").items() if k not in drop}
    save_file({**weights, **(tensors or {})}, out / "model.safetensors")
    return out


def test_heads_that_do_not_fit_the_target_are_refused(dirs, tmp_path: Path) -> None:
    """One line, at load, nothing started: another target hidden size, another vocabulary, tapped layers that
    are not three different layers of the target (given, or the default ones of a shallow target), a d2t of
    the wrong length, with ids outside the vocabulary or missing under a smaller draft vocabulary, a second
    layer, and an EAGLE-1 head under method eagle3."""
    target, head = dirs["target"], dirs["head"]
    d2t = torch.zeros(160, dtype=torch.int64)
    d2t[-1] = 1000
    cases = {
        "target_hidden_size 32": (target, _edit(head, tmp_path, {"target_hidden_size": 32})),
        "vocab_size 300": (target, _edit(head, tmp_path, {"vocab_size": 300})),
        "are not three different layers": (target, _edit(head, tmp_path,
                                                         {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]})),
        "0..7": (target, _edit(head, tmp_path, {"eagle_aux_hidden_state_layer_ids": [1, 2, 8]})),
        "default layers for 2 layers": (build_tiny_model(tmp_path / "shallow", "llama", seed=3, tokenizer=False),
                                        head),
        "d2t has shape": (target, _edit(head, tmp_path, tensors={"d2t": torch.zeros(7, dtype=torch.int64)})),
        "outside the target's vocabulary": (target, _edit(head, tmp_path, tensors={"d2t": d2t})),
        "no d2t tensor": (target, _edit(head, tmp_path, drop=("d2t",))),
        "num_hidden_layers=2": (target, _edit(head, tmp_path, {"num_hidden_layers": 2})),
        "is an EAGLE-1 head": (target, build_eagle_head(tmp_path / "eagle1", target, seed=1)),
    }
    for message, (model, bad) in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            spec_llm(model, "cpu", _eagle3(bad))
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="--speculative-model"):
        spec_llm(target, "cpu", SpeculativeConfig(method="eagle3"))


def test_a_model_whose_stack_cannot_hand_over_its_layers_is_refused(dirs) -> None:
    """A decoder stack that does not run run_decoder_stack (ChatGLM's, Baichuan-13B's) declares no hidden_taps:
    the head is refused before anything loads, and nothing is tapped."""
    from types import SimpleNamespace

    from flashllm.models.eagle import load_eagle_head
    from flashllm.models.hf_config import ModelLoadError

    stack = SimpleNamespace(embed_tokens=torch.nn.Embedding(256, 64), layers=[None] * LAYERS)
    with pytest.raises(ModelLoadError, match="does not hand them over"):
        load_eagle_head(dirs["head"], SimpleNamespace(model=stack), 64, 256, None, torch.float32, torch.device("cpu"))
    assert not hasattr(stack, "hidden_taps")


def test_a_model_prefix_on_every_tensor_name_changes_nothing(dirs, tmp_path: Path) -> None:
    """Some converters write `model.`-prefixed names (model.embed_tokens.weight, model.fc.*, model.d2t): the head
    with its own embedding and fc loads from them and drafts exactly what the unprefixed copy drafts."""
    from safetensors.torch import load_file, save_file

    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "config.json").write_text((dirs["head_b"] / "config.json").read_text())
    weights = load_file(dirs["head_b"] / "model.safetensors")
    assert "embed_tokens.weight" in weights
    save_file({f"model.{k}": v for k, v in weights.items()}, prefixed / "model.safetensors")
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    drafts = {}
    for name, head in (("plain", dirs["head_b"]), ("prefixed", prefixed)):
        llm = spec_llm(dirs["target"], "cpu", _eagle3(head, guard=0.0))
        drafts[name] = _drafted(llm, prompts, params)
    assert drafts["plain"] == drafts["prefixed"] and sum(map(len, drafts["plain"])) > 10
