"""`flashllm.LLM`: offline batch generation. `python -m flashllm.llm` runs the predictor CLI."""

from __future__ import annotations

from typing import Any, Sequence

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
    kv_cache_memory, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
    enable_chunked_prefill, strict_kernels, quant_type, seed.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = Engine(engine_config(model, **kwargs))
        self.tokenizer = self.engine.tokenizer

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
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

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
        """Token ids of a conversation rendered with the sandboxed chat template."""
        from flashllm.models.tokenizer import chat_template_for, render_chat

        template = chat_template_for(self.engine.parts.model_dir, self.tokenizer, chat_template)
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token)
        return self.tokenizer.encode(text, add_special_tokens=False)

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
                                "enable_prefix_caching"}),
        "scheduler": (SchedulerConfig, {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"}),
        "device": (DeviceConfig, {"device", "backend", "strict_kernels"}),
        "quant": (QuantConfig, {"quant_type", "group_size"}),
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
