"""lm-evaluation-harness model "flashllm": log-likelihoods, rolling perplexity and generate_until on the engine.

lm-eval 0.4.x finds a model only once its module is imported, so run the harness through this module
(same flags as `lm_eval`; `--device` is lm-eval's and defaults to cuda:0, so say `device=` in
--model_args or pass `--device cpu` on a machine without a GPU):

    python -m flashllm.eval.lm_eval_adapter --model flashllm \
        --model_args pretrained=DIR,dtype=float32,device=cpu,max_length=2048 --tasks hellaswag --batch_size auto

From Python, importing this module registers the model:

    import lm_eval, flashllm.eval.lm_eval_adapter
    lm_eval.simple_evaluate(model="flashllm", model_args="pretrained=DIR,device=cpu", tasks=["hellaswag"])

Log-probabilities come from the engine's own model (one packed varlen prefill per batch of
windows, flashllm/eval/forward.py); generation goes through LLM.generate with stop strings.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: register the model from the importable module, not from this copy
    from flashllm.eval.lm_eval_adapter import main

    raise SystemExit(main())

import math
import sys
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from tqdm.auto import tqdm

from flashllm.core.builder import EngineParts
from flashllm.eval.forward import iter_logprobs
from flashllm.eval.windows import Window, sliding_windows
from flashllm.models.layers.attention_metadata import AttentionMetadata

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import normalize_gen_kwargs
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("flashllm's lm-eval adapter needs lm-evaluation-harness: pip install 'lm-eval>=0.4.13' "
                      "(or pip install -e '.[lm-eval]')") from _exc

MODEL_NAME = "flashllm"
DEFAULT_MAX_GEN_TOKS = 256            # lm-eval's default for generate_until tasks
DEFAULT_MAX_BATCH_TOKENS = 4096       # tokens of one packed scoring forward (raised to max_length if smaller)
# gen_kwargs an lm-eval task may carry -> SamplingParams field; do_sample/until/max_gen_toks are handled apart
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "seed": "seed", "repetition_penalty": "repetition_penalty",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


@dataclass(frozen=True, slots=True)
class ScoreItem:
    """Score targets token_ids[window.score_from:window.end], running token_ids[window.begin:window.end - 1]."""

    token_ids: list[int]
    window: Window

    @property
    def num_run(self) -> int:
        return self.window.end - 1 - self.window.begin


def continuation_item(context_ids: list[int], continuation_ids: list[int], max_length: int) -> ScoreItem:
    """The continuation scored after as much of the context as max_length tokens of input allow.

    The last target is never fed back, so context + continuation may be max_length + 1 tokens;
    a longer context is cut from the left, as lm-eval's own HF model does.
    """
    if not context_ids:
        raise ValueError("the context is empty; lm-eval puts the prefix token there, so this is a caller bug")
    if len(continuation_ids) > max_length:
        raise ValueError(f"a continuation of {len(continuation_ids)} tokens cannot be scored with max_length "
                         f"{max_length}; raise max_length in --model_args")
    token_ids = context_ids + continuation_ids
    begin = max(0, len(token_ids) - 1 - max_length)
    return ScoreItem(token_ids, Window(begin, len(token_ids), len(context_ids)))


def rolling_items(token_ids: list[int], prefix_token_id: int, max_length: int) -> list[ScoreItem]:
    """Windows scoring every token of a text once, the first one after the prefix token.

    Disjoint windows of max_length targets with one token of context, the last one moved left to
    a full max_length of context: the windows of lm-eval's get_rolling_token_windows.
    """
    if not token_ids:
        return []
    sequence = [prefix_token_id, *token_ids]
    windows = sliding_windows(len(sequence), max_length + 1, max_length)
    last = windows[-1]
    windows[-1] = Window(max(0, last.end - 1 - max_length), last.end, last.score_from)
    return [ScoreItem(sequence, w) for w in windows]


def pack_batches(items: list[ScoreItem], block_size: int, max_blocks: int, max_items: int | None) -> list[list[int]]:
    """Indices of items per forward, longest first; each batch's KV blocks fit in max_blocks."""
    batches: list[list[int]] = []
    used = 0
    for i in sorted(range(len(items)), key=lambda i: -items[i].num_run):
        need = math.ceil(items[i].num_run / block_size)
        full = max_items is not None and batches and len(batches[-1]) >= max_items
        if not batches or used + need > max_blocks or full:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += need
    return batches


@torch.inference_mode()
def score_batch(parts: EngineParts, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                items: list[ScoreItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One packed prefill over several windows: per item, (target log-probs (k,) fp32, is-argmax (k,) bool).

    Item i gets its own consecutive blocks of `kv_caches` (per layer (K, V), each
    (num_blocks, block_size, num_kv_heads, head_dim)), so the windows never see each other.
    """
    block_size = kv_caches[0][0].shape[1]
    device = kv_caches[0][0].device
    input_ids: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    rows: list[int] = []
    targets: list[int] = []
    first_block = 0
    for item in items:
        run = item.token_ids[item.window.begin:item.window.end - 1]
        rows.extend(len(input_ids) + r for r in item.window.logit_rows())
        targets.extend(item.token_ids[item.window.score_from:item.window.end])
        input_ids.extend(run)
        slots.extend(range(first_block * block_size, first_block * block_size + len(run)))
        tables.append(list(range(first_block, first_block + math.ceil(len(run) / block_size))))
        first_block += len(tables[-1])
    q_lens = [item.num_run for item in items]
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(q_lens),
    )
    positions = [p for n in q_lens for p in range(n)]
    hidden = parts.model(torch.tensor(input_ids, dtype=torch.int64, device=device),
                         torch.tensor(positions, dtype=torch.int64, device=device), kv_caches, metadata)
    target_ids = torch.tensor(targets, dtype=torch.int64)
    picked, greedy, done = [], [], 0
    for chunk, logprobs in iter_logprobs(parts, hidden, torch.tensor(rows, dtype=torch.int64)):
        chunk_targets = target_ids[done:done + chunk.numel()].to(logprobs.device)
        done += chunk.numel()
        picked.append(logprobs.gather(1, chunk_targets.unsqueeze(1)).squeeze(1).cpu())
        greedy.append((logprobs.argmax(dim=-1) == chunk_targets).cpu())
    counts = [item.window.num_scored for item in items]
    return list(zip(torch.cat(picked).split(counts), torch.cat(greedy).split(counts), strict=True))


@register_model(MODEL_NAME)
class FlashLLMEval(TemplateLM):
    """lm-eval's model interface over one flashllm engine (model_args are the keyword arguments).

    pretrained: HF model directory. dtype, device, backend, quant_type, kv_cache_dtype, max_num_seqs,
    enable_prefix_caching, seed: as for flashllm.LLM. max_length: context of scoring windows and of
    generation (default: the engine's max_model_len). batch_size: most requests per scoring forward and
    per generate call ("auto" or None: as many as max_batch_tokens and the KV cache allow).
    add_bos_token: encode with the tokenizer's special tokens (off, as in lm-eval's HF model).
    prefix_token_id: what an empty context is (default: BOS, else EOS).
    """

    def __init__(self, pretrained: str, dtype: str = "auto", device: str | None = None, backend: str | None = None,
                 quant_type: str | None = None, kv_cache_dtype: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 add_bos_token: bool = False, prefix_token_id: int | None = None, max_num_seqs: int | None = None,
                 enable_prefix_caching: bool | None = None, seed: int | None = None) -> None:
        super().__init__()
        from flashllm.core.model_runner import ModelRunner
        from flashllm.llm import LLM

        self.llm = LLM(str(pretrained), dtype=dtype, device=device or "auto", backend=backend, quant_type=quant_type,
                       kv_cache_dtype=kv_cache_dtype, max_model_len=max_length, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=enable_prefix_caching, seed=seed)
        self.parts: EngineParts = self.llm.engine.parts
        if self.parts.tokenizer is None:
            raise ValueError(f"{pretrained} has no tokenizer; lm-eval passes text, so the model needs tokenizer.json")
        self.tokenizer = self.parts.tokenizer
        self._max_length = self.llm.engine.max_model_len
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(add_bos_token)
        self.batch_limit = batch_limit(batch_size, max_batch_size)
        self._prefix_token_id = prefix_token_id
        self._template: Any = None
        self._device = self.parts.runner.device
        block_size = self.parts.config.cache.block_size
        # scoring has its own small cache, so it never disturbs the engine's blocks or its prefix cache
        self.max_scoring_blocks = math.ceil(max(int(max_batch_tokens), self._max_length) / block_size)
        kv_dtype = self.parts.runner.kv_caches[0][0].dtype
        self.scoring_kv_caches = ModelRunner(self.parts.model, self._device, self.max_scoring_blocks, block_size,
                                             kv_dtype).kv_caches

    # ------------------------------------------------------------------ tokenizer glue
    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            if not self.parts.eos_token_ids:
                raise ValueError("the model has no EOS token (tokenizer or generation_config); pass prefix_token_id")
            eos = self.parts.eos_token_ids[0]
        return int(eos)

    @property
    def prefix_token_id(self) -> int:
        if self._prefix_token_id is not None:
            return int(self._prefix_token_id)
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else int(bos)

    @property
    def tokenizer_name(self) -> str:
        return str(self.parts.model_dir).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of `string`; special tokens only when asked (or add_bos_token); keep the last left_truncate_len."""
        flag = self.add_bos_token if add_special_tokens is None else add_special_tokens
        ids = self.tokenizer.encode(string, add_special_tokens=flag)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether every continuation token is the argmax) per request."""
        items = [continuation_item(ctx, cont, self.max_length) if cont else None for _, ctx, cont in requests]
        results = []
        for (key, _, _), (logprobs, greedy) in zip(requests, self._score(items, disable_tqdm), strict=True):
            answer = (float(logprobs.double().sum()), bool(greedy.all()))
            self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Total log-probability of each text, every token scored once after the prefix token."""
        per_text = [rolling_items(self.tok_encode(r.args[0]), self.prefix_token_id, self.max_length)
                    for r in requests]
        scored = iter(self._score([item for items in per_text for item in items], disable_tqdm))
        results = []
        for request, items in zip(requests, per_text, strict=True):
            total = sum(float(next(scored)[0].double().sum()) for _ in items)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            results.append(total)
        return results

    def _score(self, items: list[ScoreItem | None], disable_tqdm: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """score_batch over packed batches, in the items' order; None (nothing to score) gives empty tensors."""
        results = [(torch.zeros(0), torch.ones(0, dtype=torch.bool))] * len(items)
        todo = [i for i, item in enumerate(items) if item is not None]
        block_size = self.parts.config.cache.block_size
        batches = pack_batches([items[i] for i in todo], block_size, self.max_scoring_blocks, self.batch_limit)
        with tqdm(total=len(todo), desc="flashllm scoring", disable=disable_tqdm) as bar:
            for batch in batches:
                outputs = score_batch(self.parts, self.scoring_kv_caches, [items[todo[j]] for j in batch])
                for j, output in zip(batch, outputs, strict=True):
                    results[todo[j]] = output
                bar.update(len(batch))
        return results

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generate for every (context, gen_kwargs) through LLM.generate; text up to the first `until` string."""
        from flashllm.sampling_params import SamplingParams

        params = [self.sampling_params(r.args[1], SamplingParams) for r in requests]
        prompts = [self.prompt_ids(r.args[0], p.max_tokens) for r, p in zip(requests, params, strict=True)]
        step = self.batch_limit or max(1, len(prompts))
        texts: list[str] = []
        for start in range(0, len(prompts), step):
            outputs = self.llm.generate(prompts[start:start + step], params[start:start + step],
                                        use_tqdm=not disable_tqdm)
            texts.extend(output.outputs[0].text for output in outputs)
        for request, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def sampling_params(self, gen_kwargs: dict[str, Any], params_cls: Any) -> Any:
        """SamplingParams of one request: greedy unless do_sample, `until` as stop strings, max_gen_toks tokens.

        The model's generation_config sampling defaults are not applied: a task's gen_kwargs say it all.
        """
        kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks))
        until, max_tokens, do_sample = kwargs.pop("until"), kwargs.pop("max_gen_toks"), kwargs.pop("do_sample")
        unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"gen_kwargs {unknown} have no flashllm equivalent; supported: do_sample, until, "
                             f"max_gen_toks, {', '.join(SAMPLING_KEYS)}")
        fields = {SAMPLING_KEYS[k]: v for k, v in kwargs.items()}
        fields["temperature"] = float(fields.get("temperature", 1.0)) if do_sample else 0.0
        return params_cls(max_tokens=int(max_tokens), stop=[s for s in until if s] or None, **fields)

    def prompt_ids(self, context: str, max_tokens: int) -> list[int]:
        """The context's tokens, cut from the left so that max_tokens more fit in max_length."""
        room = self.max_length - max_tokens
        if room < 1:
            raise ValueError(f"max_gen_toks {max_tokens} leaves no room for a prompt in max_length "
                             f"{self.max_length}; raise max_length or lower max_gen_toks")
        return (self.tok_encode(context) or [self.prefix_token_id])[-room:]

    # ------------------------------------------------------------------ chat templates
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """Source of the template apply_chat_template will use: the model's own (True) or one by name."""
        if chat_template is False or chat_template is None:
            return None
        from flashllm.models.builtin_templates import BUILTIN_TEMPLATES
        from flashllm.models.tokenizer import load_chat_template

        if chat_template is True or chat_template in BUILTIN_TEMPLATES:
            self._template = self.llm.chat_template(None if chat_template is True else chat_template)
        else:
            self._template = load_chat_template(self.parts.model_dir, chat_template)
            if self._template is None:
                raise ValueError(f"{self.parts.model_dir} has no chat template named {chat_template!r}")
        return self._template.source

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        template = self._template or self.llm.chat_template()
        return template.render(chat_history, add_generation_prompt=add_generation_prompt)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> FlashLLMEval:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> FlashLLMEval:
        """model_args win over the harness's own batch_size / device (lm-eval's CLI always sends a device)."""
        from flashllm.registry.resolve import DeviceSelectionError

        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        try:
            return cls(**arg_dict, **extra)
        except DeviceSelectionError as exc:
            if "device" not in extra:
                raise
            raise DeviceSelectionError(f"device {extra['device']!r} came from lm-eval's --device (its command line "
                                       "defaults to cuda:0); pass --device cpu, or device=auto|cpu|cuda:N in "
                                       f"--model_args\n{exc}") from exc


def batch_limit(batch_size: int | str | None, max_batch_size: int | None) -> int | None:
    """Requests per forward: an int batch_size, else ("auto", None) max_batch_size or no limit."""
    if batch_size is None or (isinstance(batch_size, str) and batch_size.startswith("auto")):
        return None if max_batch_size is None else int(max_batch_size)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
    return int(batch_size)


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line (`lm_eval ARGS`) with the "flashllm" model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0
