"""`flashllm.LLM`: offline batch generation. `python -m flashllm.llm` runs the predictor CLI."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from flashllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, QuantConfig, SchedulerConfig
from flashllm.core.engine import Engine
from flashllm.outputs import RequestOutput
from flashllm.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Generate for many prompts at once with continuous batching.

    `model` is a Hugging Face model directory (None = the built-in demo model). Other keywords
    map to EngineConfig fields: dtype, device, backend, max_model_len, block_size, num_kv_blocks,
    kv_cache_memory, kv_cache_dtype, cachekv_int8_type, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, enable_chunked_prefill, strict_kernels, quant_type, seed.

    kv_cache_dtype "int8" or "fp8" (e4m3) stores the KV cache quantized, with scales chosen per
    token and head (cachekv_int8_type "dynamic") or calibrated in the checkpoint ("static").
    fp8 works on CPUs too: the cache is stored as e4m3 bytes and attention dequantizes it to
    fp32, so it halves KV memory against fp16 without needing fp8 arithmetic.

    mode="static": `model` is a directory written by `flashllm export --format onnx`, and the
    result is a `flashllm.static.StaticLLM` (onnxruntime) with the same generate / chat API; it
    takes device, dtype, max_model_len, max_num_seqs and seed.
    """

    def __new__(cls, model: str | None = None, mode: str = "dynamic", **kwargs: Any) -> Any:
        if mode == "static":
            from flashllm.static.runner import StaticLLM

            if model is None:
                raise ValueError("mode='static' needs the directory written by `flashllm export`")
            return StaticLLM(model, **kwargs)  # not an LLM, so __init__ does not run on it
        if mode != "dynamic":
            raise ValueError(f"mode {mode!r} is not one of: dynamic, static")
        return super().__new__(cls)

    def __init__(self, model: str | None = None, mode: str = "dynamic", **kwargs: Any) -> None:
        self.engine = Engine(engine_config(model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._chat_template: Any = None

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = _per_prompt(sampling_params, len(prompts), self.engine.default_sampling_params())
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(prompt, sp))
        except BaseException:
            for request_id in ids:  # a bad prompt later in the list must not leave earlier ones queued
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: Sequence[Prompt], beam_width: int, max_tokens: int,
                    length_penalty: float = 1.0, ignore_eos: bool = False) -> list[RequestOutput]:
        """Beam search per prompt; each output holds its `beam_width` best hypotheses, best first.

        Beams re-submit their tokens each step; their full KV blocks are shared through the
        prefix cache, so only each beam's last partial block is recomputed.
        """
        from flashllm.core.beam_search import beam_search

        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        results = beam_search(self.engine, ids, beam_width, max_tokens, length_penalty=length_penalty,
                              ignore_eos=ignore_eos)
        return [r.to_request_output(f"beam-{i}", tokenizer=self.tokenizer) for i, r in enumerate(results)]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or `chat_template`) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, chat_template, add_generation_prompt) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def render_chat(self, messages: list[Message], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the sandboxed chat template.

        `chat_template`: None = the model's own, a built-in name (chatml, llama-2, llama-3) or a
        template source string.
        """
        text = self.chat_template(chat_template).render(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_template(self, chat_template: str | None = None) -> Any:
        """The ChatTemplate to render with (see render_chat); the model's own is loaded once."""
        template, self._chat_template = select_chat_template(chat_template, self._chat_template,
                                                             self.engine.parts.model_dir)
        return template

    def has_chat_template(self) -> bool:
        """Whether the model directory ships a chat template."""
        try:
            self.chat_template()
        except ValueError:
            return False
        return True

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm)
        try:
            while len(final) < len(request_ids) and self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in request_ids:  # never leave half-run requests holding KV blocks
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [final[r] for r in request_ids]


def engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (unknown keys are an error)."""
    groups = {
        "model": (ModelConfig, {"dtype", "max_model_len", "seed", "tokenizer"}),
        "cache": (CacheConfig, {"block_size", "num_kv_blocks", "kv_cache_memory", "kv_cache_dtype",
                                "cachekv_int8_type", "enable_prefix_caching"}),
        "scheduler": (SchedulerConfig, {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"}),
        "device": (DeviceConfig, {"device", "backend", "strict_kernels"}),
        "quant": (QuantConfig, {"quant_type", "group_size", "quantize_lm_head"}),
    }
    known = set().union(*(keys for _, keys in groups.values()))
    unknown = set(kwargs) - known
    if unknown:
        raise TypeError(f"unknown LLM options {sorted(unknown)}; known: {sorted(known)}")
    parts = {}
    for name, (cls, keys) in groups.items():
        parts[name] = cls(**{k: v for k, v in kwargs.items() if k in keys and v is not None})
    parts["model"].model = model
    return EngineConfig(**parts)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int,
                default: SamplingParams) -> list[SamplingParams]:
    if params is None:
        return [default] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt")
    return list(params)


if __name__ == "__main__":
    from flashllm.cli.predict import main

    raise SystemExit(main())


def select_chat_template(chat_template: str | None, own: Any, model_dir: Any) -> tuple[Any, Any]:
    """(the ChatTemplate to render with, the model's own template, loaded from model_dir on first need).

    chat_template: a built-in name (chatml, llama-2, llama-3), a template source string, or None
    for the model's own; a model without one raises ValueError naming the alternatives.
    """
    from flashllm.models.tokenizer import BUILTIN_TEMPLATES, ChatTemplate, load_chat_template

    if chat_template in BUILTIN_TEMPLATES:
        return ChatTemplate.builtin(chat_template), own
    if chat_template is not None:
        return ChatTemplate(chat_template), own
    own = own if own is not None else load_chat_template(model_dir)
    if own is None:
        raise ValueError("this model has no chat template; pass chat_template= a built-in name "
                         f"({', '.join(BUILTIN_TEMPLATES)}) or a template string")
    return own, own
