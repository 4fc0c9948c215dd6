"""Train a small EAGLE-3 head for a Llama-family model on the model's own greedy answers, on the CPU.

No published EAGLE-3 head is stored on this machine, so this makes one to measure flashllm's EAGLE-3 path on
a real model (docs/benchmarks.md). It is a measurement aid, not a recipe for good heads: minutes of
self-distillation on a few hundred generated answers.

1. Answers: flashllm generates greedy chat answers to templated instructions (TEMPLATES x TRAIN_TOPICS).
2. Features: transformers runs the model over each prompt + answer with output_hidden_states; the head reads
   the inputs of layers (2, L // 2, L - 3) and learns the model's argmax at the next position.
3. Vocabulary: the `--draft-vocab` most frequent target tokens; d2t maps draft ids back.
4. Training: the head's layer over whole sequences, unrolled `--unroll` times as EAGLE-3's training-time
   test does (step s reads the previous step's output one position back, attends to real-feature keys up to
   i - s and to the earlier steps' keys on the diagonal), cross-entropy over the draft vocabulary.
5. Written in the published layout (config.json, model.safetensors with fc, midlayer.*, norm, lm_head, d2t,
   t2d); EVAL_TOPICS' prompts (chat-rendered) and the model's answers are written as a ShareGPT file for
   `flashllm bench latency --dataset sharegpt`.

    python benchmarks/cpu/eagle3_train.py --model /work/smollm2-hf --out /tmp/eagle3-head
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TEMPLATES = ("Explain {} to a curious twelve-year-old.", "Write a short story about {}.",
             "List five interesting facts about {}.", "What are the pros and cons of {}?",
             "Write a friendly email inviting a colleague to learn about {}.", "Describe the history of {} briefly.",
             "Give me three tips for getting started with {}.", "Write a short poem about {}.")
TRAIN_TOPICS = ("the ocean", "volcanoes", "bicycles", "photosynthesis", "the moon", "chess", "coffee",
                "rainforests", "honeybees", "the printing press", "electric cars", "gardening", "jazz music",
                "the human heart", "recycling", "penguins", "the internet", "mountains", "baking bread",
                "the solar system", "dinosaurs", "libraries", "trains", "the weather", "friendship",
                "video games", "the Roman Empire", "sleep", "rivers", "robots", "tea", "whales")
EVAL_TOPICS = ("deserts", "airplanes", "music lessons", "the Great Wall of China")


def generate_answers(model: str, prompts: list[str], max_tokens: int) -> list[tuple[list[int], str, str]]:
    """Per prompt: prompt + greedy answer token ids (the chat template applied), the rendered prompt text and
    the answer text (flashllm, batched)."""
    from flashllm import LLM
    from flashllm.sampling_params import SamplingParams

    llm = LLM(model, device="cpu", dtype="float32")
    chats = [[{"role": "user", "content": p}] for p in prompts]
    outputs = llm.chat(chats, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    template = llm.chat_template()
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), template.render(c, add_generation_prompt=True),
             o.outputs[0].text) for c, o in zip(chats, outputs, strict=True)]


@torch.no_grad()
def features(model_dir: str, sequences: list[list[int]], taps: tuple[int, ...]) -> list[tuple[Tensor, Tensor]]:
    """Per sequence: the tapped layers' inputs (T, 3H) and the model's argmax at each position (T,)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in sequences:
        result = target(torch.tensor([ids]), output_hidden_states=True)
        states = torch.cat([result.hidden_states[i][0] for i in taps], dim=-1)
        out.append((states, result.logits[0].argmax(-1)))
    return out


class Head(nn.Module):
    """The EAGLE-3 head being trained: the same computation Eagle3Head runs (models/eagle.py)."""

    def __init__(self, config: dict, draft_vocab: int, lm_head: Tensor) -> None:
        super().__init__()
        h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
        self.heads, self.kv, self.dim = heads, kv, h // heads
        self.eps, self.theta = config["rms_norm_eps"], config.get("rope_theta", 10000.0)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, heads * self.dim, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * self.dim, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * self.dim, bias=False)
        self.o_proj = nn.Linear(heads * self.dim, h, bias=False)
        inter = config["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(h)) for n in
                                       ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")})
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head)

    def rms(self, x: Tensor, name: str) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norms[name]

    def rope(self, x: Tensor) -> Tensor:
        """x (T, heads, D) rotated at positions 0..T-1 (neox halves, as the Llama checkpoints)."""
        t, d = x.shape[0], self.dim
        inv = self.theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.arange(t, dtype=torch.float32)[:, None] * inv
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def unrolled(self, aux: Tensor, embeds: Tensor, steps: int) -> list[Tensor]:
        """Logits of each unrolled step over one sequence (see the module docstring); step s's rows before s
        have no input and are garbage (the caller masks them)."""
        t = aux.shape[0]
        e = self.rms(embeds, "input_layernorm")
        hidden = self.fc(aux)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        logits = []
        group = self.heads // self.kv
        positions = torch.arange(t)
        for s in range(steps):
            normed = self.rms(hidden, "hidden_norm")
            x = torch.cat((e, normed), dim=-1)
            q = self.rope(self.q_proj(x).view(t, self.heads, self.dim))
            k = self.rope(self.k_proj(x).view(t, self.kv, self.dim)).repeat_interleave(group, dim=1)
            v = self.v_proj(x).view(t, self.kv, self.dim).repeat_interleave(group, dim=1)
            keys.append(k)
            values.append(v)
            scale = self.dim ** -0.5
            # real-feature keys (step 0) at j <= i - s
            base = torch.einsum("ihd,jhd->hij", q, keys[0]) * scale
            base = base.masked_fill(positions[None, :] > positions[:, None] - s, float("-inf"))
            # step u's key at position i - (s - u), for u = 1..s
            diag = [torch.einsum("ihd,ihd->hi", q, keys[u].roll(s - u, dims=0)) * scale for u in range(1, s + 1)]
            scores = torch.cat((base, *(d[:, :, None] for d in diag)), dim=-1)
            weights = torch.softmax(scores.nan_to_num(neginf=-1e30), dim=-1)
            attended = torch.einsum("hij,jhd->ihd", weights[:, :, :t], values[0])
            for n, u in enumerate(range(1, s + 1)):
                attended = attended + weights[:, :, t + n].T[:, :, None] * values[u].roll(s - u, dims=0)
            r = self.o_proj(attended.reshape(t, -1)) + hidden
            post = self.rms(r, "post_attention_layernorm")
            o = r + self.down_proj(F.silu(self.gate_proj(post)) * self.up_proj(post))
            logits.append(self.lm_head(self.rms(o, "norm")))
            hidden = torch.cat((hidden[:1], o[:-1]))  # step s + 1 at position i reads o at i - 1
        return logits


def train(head: Head, data: list[tuple[Tensor, Tensor, Tensor]], epochs: int, steps: int, lr: float) -> None:
    """data: (aux (T, 3H), embeds of t_{i+1} (T, H), draft-vocab label of position i (T,), -100 where none)."""
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    total = epochs * len(data)
    done = 0
    for epoch in range(epochs):
        order = torch.randperm(len(data)).tolist()
        seen = correct = 0
        loss_sum = 0.0
        start = time.perf_counter()
        for index in order:
            aux, embeds, labels = data[index]
            for group in opt.param_groups:  # cosine decay
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * done / total))
            logits = head.unrolled(aux, embeds, steps)
            loss = 0.0
            for s, step_logits in enumerate(logits):
                target = labels.clone()
                target[:s] = -100
                loss = loss + F.cross_entropy(step_logits, target, ignore_index=-100) * 0.8 ** s
                if s == 0:
                    keep = target != -100
                    correct += int((step_logits.argmax(-1) == target)[keep].sum())
                    seen += int(keep.sum())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            loss_sum += float(loss.detach())
            done += 1
        print(f"epoch {epoch + 1}: loss {loss_sum / len(data):.3f}, first-step top-1 {correct / max(seen, 1):.3f}, "
              f"{time.perf_counter() - start:.0f} s", flush=True)


def write_head(head: Head, config: dict, draft_ids: Tensor, vocab: int, taps: tuple[int, ...], out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    w = {"fc.weight": head.fc.weight, "norm.weight": head.norms["norm"], "lm_head.weight": head.lm_head.weight}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w[f"midlayer.self_attn.{name}.weight"] = getattr(head, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        w[f"midlayer.mlp.{name}.weight"] = getattr(head, name).weight
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{name}.weight"] = head.norms[name]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {k: v.detach().float().contiguous() for k, v in w.items()}
    save_file({**tensors, "d2t": draft_ids - torch.arange(draft_ids.numel()), "t2d": t2d},
              out / "model.safetensors", metadata={"format": "pt"})
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "rope_theta", "max_position_embeddings", "vocab_size")
    head_config = {k: config[k] for k in keys if k in config}
    head_config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                       draft_vocab_size=int(draft_ids.numel()), eagle_aux_hidden_state_layer_ids=list(taps),
                       tie_word_embeddings=False, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(head_config, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=200, help="answer length per prompt")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--unroll", type=int, default=3, help="training-time-test steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    config = json.loads((Path(args.model) / "config.json").read_text())
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    layers = config["num_hidden_layers"]
    taps = (2, layers // 2, layers - 3)
    prompts = [t.format(topic) for topic in TRAIN_TOPICS for t in TEMPLATES]
    eval_prompts = [t.format(topic) for topic in EVAL_TOPICS for t in TEMPLATES[:4]]
    start = time.perf_counter()
    answers = generate_answers(args.model, prompts + eval_prompts, args.max_tokens)
    sequences = [ids for ids, _, _ in answers[: len(prompts)]]
    print(f"{len(sequences)} answers, {sum(map(len, sequences))} tokens, {time.perf_counter() - start:.0f} s",
          flush=True)
    start = time.perf_counter()
    feats = features(args.model, sequences, taps)
    print(f"features: {time.perf_counter() - start:.0f} s", flush=True)
    counts = torch.bincount(torch.cat([labels for _, labels in feats]), minlength=config["vocab_size"])
    draft_ids = counts.argsort(descending=True)[: args.draft_vocab].sort().values
    to_draft = torch.full((config["vocab_size"],), -100, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(draft_ids.numel())
    print(f"draft vocabulary: {draft_ids.numel()} ids cover {counts[draft_ids].sum() / counts.sum():.3f} of labels")
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(Path(args.model).glob("*.safetensors")):
        weights.update(load_file(f))
    embed = weights["model.embed_tokens.weight"].float()
    lm_head = weights.get("lm_head.weight", embed).float()
    data = []
    for ids, (aux, labels) in zip(sequences, feats, strict=True):
        ids_t = torch.tensor(ids)
        # position i: reads t_{i+1}, learns the model's argmax at i + 1; the last position has no t_{i+1}
        data.append((aux[:-1], embed[ids_t[1:]], to_draft[labels[1:]]))
    head = Head(config, draft_ids.numel(), lm_head[draft_ids])
    train(head, data, args.epochs, args.unroll, args.lr)
    write_head(head, config, draft_ids, config["vocab_size"], taps, out)
    # held-out topics: the rendered chat prompt, and the model's own answer (its length sets the bench's)
    sharegpt = [{"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": answer}]}
                for _, text, answer in answers[len(prompts):]]
    (out / "eval_prompts.json").write_text(json.dumps(sharegpt, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
