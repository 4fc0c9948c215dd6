"""`flashllm.AutoModel`: a PaddleNLP / transformers-style facade (from_pretrained, generate, chat) over LLM."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from itertools import dropwhile
from pathlib import Path
from typing import Any

from flashllm.llm import LLM
from flashllm.models.builtin_templates import BUILTIN_TEMPLATES
from flashllm.models.chat_template import MAX_TEMPLATE_BYTES, ChatTemplate, ChatTemplateError
from flashllm.sampling_params import SamplingParams

# transformers' GenerationConfig caps new tokens through max_length=20 when nothing else is set;
# PaddleNLP's predictor does the same with max_length. Without a generation_config value, keep 20.
DEFAULT_MAX_NEW_TOKENS = 20

GENERATE_KWARGS = frozenset({
    "inputs", "input_ids", "attention_mask", "max_new_tokens", "min_new_tokens", "do_sample",
    "temperature", "top_p", "top_k", "repetition_penalty", "seed", "eos_token_id", "pad_token_id",
    "num_return_sequences", "decode_strategy", "num_beams",
})
# PaddleNLP's generate(decode_strategy=...) values
DECODE_STRATEGIES = ("greedy_search", "sampling", "beam_search")

# Names users bring from other generate() APIs, with what to write instead.
_KWARG_HINTS = {
    "max_length": "use max_new_tokens (max_length means the total length in transformers but the "
                  "new tokens in PaddleNLP, so flashllm accepts neither)",
    "decode_strategy": "use do_sample=False for greedy_search, do_sample=True for sampling",
    "num_beams": "beam search is not offered by AutoModel.generate; use LLM with "
                 "SamplingParams(use_beam_search=True)",
}

Messages = list[dict[str, Any]]


class AutoModel:
    """A causal LM loaded for generation, with the calls users of PaddleNLP / transformers type.

    A thin facade: every token is produced by the wrapped `LLM` (`model.llm`); this class only
    translates arguments. `model.tokenizer` is the model's (fast) tokenizer.
    """

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._chat_template: ChatTemplate | None = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str],
                        **kwargs: Any) -> AutoModel:
        """Load a local Hugging Face model directory (never downloads).

        kwargs are LLM options: dtype ("auto" | "float32" | "float16" | "bfloat16"), device
        ("auto" | "cpu" | "cuda:0" | ...), backend, max_model_len, block_size, num_kv_blocks,
        kv_cache_memory, max_num_seqs, tensor_parallel_size (ranks the model is split over) and
        distributed_executor_backend ("uniproc" | "mp" | "ray" | "external"), ...; an unknown one
        raises TypeError listing the known.
        """
        return cls(LLM(os.fspath(pretrained_model_name_or_path), **kwargs))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers PreTrainedTokenizerFast)."""
        return self.llm.tokenizer

    @property
    def generation_config(self) -> dict[str, Any]:
        """The model's generation_config.json ({} when absent); its values are generate's defaults."""
        return self.llm.engine.parts.generation_config

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The template set by set_chat_template (None: the model's own is used)."""
        return self._chat_template

    # ------------------------------------------------------------ generation

    def generate(self, inputs: Any = None, **kwargs: Any) -> list[list[int]]:
        """Generate a continuation of every input; returns the NEW token ids only, one list per row.

        inputs: token ids as a list of lists (ragged is fine, e.g. `tokenizer(texts).input_ids`),
        one list of ints, a 1-D / 2-D integer torch tensor (B, T), or a mapping with "input_ids"
        (and "attention_mask"), such as what the tokenizer returns. `input_ids=` is an alias.
        attention_mask: same shape as inputs, 1 = real token, 0 = padding; padding is dropped
        (left or right, but the real tokens of a row must be contiguous).
        pad_token_id: without an attention_mask, leading pad ids of each row are dropped.
        max_new_tokens (default: generation_config, else 20), min_new_tokens, do_sample (False =
        greedy), temperature, top_p, top_k (0 = off), repetition_penalty, seed, eos_token_id
        (int or list; extends the model's EOS ids), num_return_sequences.
        PaddleNLP's spelling works too: decode_strategy "greedy_search" | "sampling" (do_sample)
        | "beam_search" with num_beams (num_beams > 1 alone also means beam search; beams return
        their best num_return_sequences hypotheses, best first).
        Output rows are in input order (with num_return_sequences=k, k consecutive rows per
        input); a row that stopped on an EOS id ends with that id, as in transformers.
        Unknown keyword arguments raise TypeError naming them.
        """
        _check_kwargs(kwargs)
        if "input_ids" in kwargs:
            if inputs is not None:
                raise TypeError("pass the prompt as inputs= or input_ids=, not both")
            inputs = kwargs.pop("input_ids")
        prompts = token_rows(inputs, kwargs.pop("attention_mask", None), kwargs.get("pad_token_id"))
        num_beams = _paddle_strategy(kwargs)
        if num_beams > 1:
            return self._beam_generate(prompts, num_beams, kwargs)
        outputs = self.llm.generate(prompts, self.sampling_params(**kwargs))
        return [list(completion.token_ids) for output in outputs for completion in output.outputs]

    def _beam_generate(self, prompts: list[list[int]], num_beams: int, kwargs: dict[str, Any]) -> list[list[int]]:
        """Beam search (PaddleNLP's decode_strategy="beam_search"): each input's best num_return_sequences beams."""
        if kwargs.get("do_sample"):
            raise ValueError("beam search does not sample: drop do_sample=True or num_beams")
        # sampling knobs PaddleNLP callers pass along with beam_search mean nothing to beams: ignored
        ignored = {"do_sample", "temperature", "top_p", "top_k", "seed", "pad_token_id"}
        unsupported = sorted(set(kwargs) - {"max_new_tokens", "num_return_sequences"} - ignored)
        if unsupported:
            raise TypeError(f"beam search does not take {unsupported}; drop them or use greedy_search / sampling")
        keep = int(kwargs.get("num_return_sequences", 1))
        if not 1 <= keep <= num_beams:
            raise ValueError(f"num_return_sequences ({keep}) must be between 1 and num_beams ({num_beams})")
        max_tokens = int(kwargs.get("max_new_tokens") or self.generation_config.get("max_new_tokens")
                         or DEFAULT_MAX_NEW_TOKENS)
        outputs = self.llm.beam_search(prompts, beam_width=num_beams, max_tokens=max_tokens)
        return [list(c.token_ids) for output in outputs for c in output.outputs[:keep]]

    def sampling_params(self, **kwargs: Any) -> SamplingParams:
        """The SamplingParams that generate() builds from HF-style keyword arguments.

        Unset knobs take the generation_config value, else transformers' neutral default
        (temperature 1, top_p 1, top_k off, repetition_penalty 1). do_sample=False is greedy
        (temperature 0) and ignores temperature / top_p / top_k.
        """
        _check_kwargs(kwargs)
        if _paddle_strategy(kwargs) > 1:
            raise ValueError("beam search has no SamplingParams; call generate(num_beams=...) instead")
        extra = set(kwargs) - (GENERATE_KWARGS - {"inputs", "input_ids", "attention_mask"})
        if extra:
            raise TypeError(f"sampling_params() does not take {sorted(extra)}; pass them to generate()")
        pick = _defaults(self.generation_config, kwargs)
        params: dict[str, Any] = {
            "max_tokens": pick("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
            "min_tokens": pick("min_new_tokens", 0),
            "repetition_penalty": pick("repetition_penalty", 1.0),
            "n": pick("num_return_sequences", 1),
            "seed": kwargs.get("seed"),
            "stop_token_ids": _id_list("eos_token_id", kwargs.get("eos_token_id")),
            "temperature": 0.0,
        }
        if pick("do_sample", False):
            params.update(_sampling_knobs(pick))
        return SamplingParams(**params)

    # ------------------------------------------------------------ chat

    def set_chat_template(self, template: str | os.PathLike[str] | ChatTemplate | None) -> None:
        """Choose the template chat() renders with.

        template: a built-in name (see BUILTIN_TEMPLATES: "chatml", "llama-2", "llama-3"), a
        jinja template string, a path to a template file (e.g. a .jinja), a ChatTemplate, or
        None to go back to the model's own. Built-ins use the tokenizer's bos/eos tokens where
        the tokenizer defines them, else the format's usual ones. Raises ChatTemplateError
        (a ValueError) for an unknown name, listing the built-ins.
        """
        self._chat_template = None if template is None else self._resolve_template(template)

    def render_chat(self, messages: Messages | str, add_generation_prompt: bool = True) -> str:
        """The prompt text chat() would generate from (a str is one user message)."""
        template = self._chat_template or self._model_template()
        return template.render(_as_messages(messages), add_generation_prompt=add_generation_prompt)

    def chat(self, messages: Messages | str, **kwargs: Any) -> str:
        """Render the conversation, generate (kwargs as in generate()), return the decoded reply.

        The reply is the first generated sequence decoded with skip_special_tokens=True.
        """
        _check_kwargs(kwargs)
        for name in ("inputs", "input_ids", "attention_mask"):
            if name in kwargs:
                raise TypeError(f"chat() builds the prompt from messages; do not pass {name}")
        text = self.render_chat(messages)
        # The template writes the special tokens itself (bos included).
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        reply = self.generate(prompt, **kwargs)[0]
        return self.tokenizer.decode(reply, skip_special_tokens=True)

    def _resolve_template(self, template: str | os.PathLike[str] | ChatTemplate) -> ChatTemplate:
        if isinstance(template, ChatTemplate):
            return template
        if isinstance(template, os.PathLike):
            return self._template_file(Path(template))
        if not isinstance(template, str):
            raise TypeError(f"a chat template is a name, a template string or a path; "
                            f"got {type(template).__name__}")
        if template in BUILTIN_TEMPLATES:
            tokens = {"bos_token": self.tokenizer.bos_token, "eos_token": self.tokenizer.eos_token}
            return ChatTemplate.builtin(template, **tokens)
        if any(marker in template for marker in ("{{", "{%", "{#")):
            return ChatTemplate(template, **self._special_tokens(), name="custom")
        if template.endswith(".jinja") or os.path.isfile(template):
            return self._template_file(Path(template))
        raise ChatTemplateError(
            f"unknown chat template {template!r:.80}: it is not a built-in name (known: "
            f"{', '.join(sorted(BUILTIN_TEMPLATES))}), not a jinja template (no '{{{{' or '{{%'), "
            "and not an existing template file")

    def _template_file(self, path: Path) -> ChatTemplate:
        if not path.is_file():
            raise FileNotFoundError(f"chat template file {path} does not exist")
        size = path.stat().st_size
        if size > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"{path} is {size} bytes; chat templates are limited to "
                                    f"{MAX_TEMPLATE_BYTES}")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ChatTemplateError(f"chat template file {path} is not UTF-8 text: {exc}") from exc
        return ChatTemplate(source, **self._special_tokens(), name=path.name)

    def _special_tokens(self) -> dict[str, str]:
        return {"bos_token": self.tokenizer.bos_token or "", "eos_token": self.tokenizer.eos_token or ""}

    def _model_template(self) -> ChatTemplate:
        return self.llm.chat_template()  # the model's own, loaded once by LLM


# ---------------------------------------------------------------- argument translation


def _defaults(generation_config: Mapping[str, Any], kwargs: Mapping[str, Any]) -> Callable[[str, Any], Any]:
    """A lookup of a generate() knob: the call's value, else generation_config's, else the fallback."""

    def pick(name: str, fallback: Any) -> Any:
        for source in (kwargs, generation_config):
            if source.get(name) is not None:
                return source[name]
        return fallback

    return pick


def _sampling_knobs(pick: Callable[[str, Any], Any]) -> dict[str, Any]:
    temperature = pick("temperature", 1.0)
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {temperature}; "
                         "use do_sample=False for greedy decoding")
    top_k = pick("top_k", 0)
    # transformers / PaddleNLP switch top-k off with 0; SamplingParams spells "off" as -1.
    return {"temperature": temperature, "top_p": pick("top_p", 1.0),
            "top_k": -1 if top_k == 0 else top_k}


def _paddle_strategy(kwargs: dict[str, Any]) -> int:
    """Pop PaddleNLP's decode_strategy / num_beams, turning them into do_sample; the beam count (1: no beams)."""
    strategy = kwargs.pop("decode_strategy", None)
    num_beams = kwargs.pop("num_beams", 1)
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive integer, got {num_beams!r}")
    if strategy is not None and strategy not in DECODE_STRATEGIES:
        raise ValueError(f"decode_strategy {strategy!r} is not one of {', '.join(DECODE_STRATEGIES)}")
    if strategy is not None:
        kwargs["do_sample"] = strategy == "sampling"  # beam_search with one beam is greedy search
    return 1 if strategy in ("greedy_search", "sampling") else num_beams


def _check_kwargs(kwargs: Mapping[str, Any]) -> None:
    unknown = sorted(set(kwargs) - GENERATE_KWARGS)
    if not unknown:
        return
    hints = "; ".join(f"{name}: {_KWARG_HINTS[name]}" for name in unknown if name in _KWARG_HINTS)
    raise TypeError(f"unknown generate() arguments {unknown}" + (f" ({hints})" if hints else "")
                    + f"; known: {sorted(GENERATE_KWARGS)}")


def _id_list(name: str, value: Any) -> list[int]:
    if value is None:
        return []
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{name} must be an int or a list of ints, got {type(value).__name__}")
    return list(ids)


def _as_messages(messages: Messages | str) -> Messages:
    return [{"role": "user", "content": messages}] if isinstance(messages, str) else messages


def _rows(value: Any, name: str) -> list[list[Any]]:
    """A tensor / array / nested list as a list of rows (a flat list is one row)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        if getattr(value, "ndim", 2) not in (1, 2):
            raise ValueError(f"{name} must be 1-D or 2-D (batch, seq_len), got shape "
                             f"{tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be token ids (a list of int lists, a list of ints or an integer "
                        f"tensor), got {type(value).__name__}; tokenize text with model.tokenizer "
                        "or use model.chat()")
    if not value:
        raise ValueError(f"{name} is empty; give at least one prompt of at least one token")
    # A list of 1-D tensors (one per prompt) or of numpy ints becomes plain Python lists / ints.
    value = [v.tolist() if hasattr(v, "tolist") else v for v in value]
    if all(isinstance(v, Sequence) and not isinstance(v, (str, bytes)) for v in value):
        return [list(row) for row in value]
    return [list(value)]


def _check_ints(rows: list[list[Any]], name: str) -> None:
    for i, row in enumerate(rows):
        for token in row:
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"{name}[{i}] holds {token!r} ({type(token).__name__}); token ids "
                                "must be integers (use an integer tensor, e.g. torch.long)")


def _unpad(row: list[int], mask: list[Any], i: int) -> list[int]:
    if len(mask) != len(row):
        raise ValueError(f"attention_mask row {i} has {len(mask)} entries but inputs row {i} has "
                         f"{len(row)}; they must have the same shape")
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"attention_mask row {i} must hold only 0 (padding) and 1 (token)")
    kept = [p for p, m in enumerate(mask) if m]
    if kept and kept[-1] - kept[0] + 1 != len(kept):
        raise ValueError(f"attention_mask row {i} has padding between real tokens; only left or "
                         "right padding can be dropped")
    return [row[p] for p in kept]


def token_rows(inputs: Any, attention_mask: Any = None, pad_token_id: int | None = None) -> list[list[int]]:
    """Prompts as ragged token-id lists, padding removed.

    inputs: list of int lists, one list of ints, an integer tensor / array of shape (T,) or
    (B, T), or a mapping with "input_ids" (its "attention_mask" is used when none is given).
    attention_mask: same shape, 1 = token, 0 = padding. pad_token_id: without a mask, leading
    pad ids are left padding. Raises ValueError for a row left empty or a mismatched mask.
    """
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise TypeError(f"an inputs mapping needs 'input_ids'; got keys {sorted(inputs)}")
        attention_mask = inputs.get("attention_mask") if attention_mask is None else attention_mask
        inputs = inputs["input_ids"]
    if inputs is None:
        raise TypeError("generate() needs inputs: token ids, e.g. tokenizer(texts).input_ids")
    rows = _rows(inputs, "inputs")
    _check_ints(rows, "inputs")
    if attention_mask is not None:
        masks = _rows(attention_mask, "attention_mask")
        if len(masks) != len(rows):
            raise ValueError(f"attention_mask has {len(masks)} rows but inputs has {len(rows)}")
        rows = [_unpad(row, mask, i) for i, (row, mask) in enumerate(zip(rows, masks, strict=True))]
    elif pad_token_id is not None:
        rows = [list(dropwhile(lambda t: t == pad_token_id, row)) for row in rows]
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"inputs row {i} has no tokens once padding is removed")
    return rows
