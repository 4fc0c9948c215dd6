"""Static-graph mode: run an exported ONNX decoder step through onnxruntime with flashllm's sampler."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from flashllm.chat_methods import ChatMethods
from flashllm.models.hf_config import load_hf_config
from flashllm.models.loader import load_generation_config
from flashllm.models.tokenizers import TOKENIZER_FILES
from flashllm.outputs import RequestOutput
from flashllm.sampling_params import SamplingParams, per_prompt
from flashllm.static.engine import StaticEngine
from flashllm.static.graph import StaticGraph, onnxruntime_module, select_providers
from flashllm.static.manifest import StaticManifest, StaticModelError, read_manifest

__all__ = ["StaticLLM", "onnxruntime_module", "select_providers"]

logger = logging.getLogger(__name__)

Prompt = str | list[int]
MAX_DEFAULT_MODEL_LEN = 8192


class StaticLLM(ChatMethods):
    """Generate with an exported static graph (`flashllm export --format onnx`) through onnxruntime.

    `engine` (a StaticEngine) left-pads up to `max_num_seqs` sequences into one prefill, then
    decodes them one token per step with the KV cache the graph returns; finished rows leave the
    batch, and the next batch starts when this one is done. Sampling, stop tokens / strings,
    detokenization and outputs are flashllm's own (core.sampler, core.request), so results have
    the dynamic engine's shape and, for greedy decoding, its tokens.
    """

    def __init__(self, model: str | Path, *, device: str = "auto", dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 16, seed: int | None = None) -> None:
        self.model_dir = Path(model)
        self.manifest: StaticManifest = read_manifest(self.model_dir)
        if dtype not in ("auto", self.manifest.dtype):
            raise StaticModelError(f"{self.model_dir} was exported in {self.manifest.dtype}; --dtype {dtype} needs "
                                   f"a new export (`flashllm export MODEL --format onnx --dtype {dtype}`)")
        if seed is not None:
            torch.manual_seed(seed)  # seeds the generators of requests without their own seed
        self.hf_config = load_hf_config(self.model_dir)
        limit = self.hf_config.max_position_embeddings
        self.max_model_len = max_model_len or min(limit, MAX_DEFAULT_MODEL_LEN)
        if self.max_model_len > limit:
            raise StaticModelError(f"max_model_len {self.max_model_len} exceeds the model's "
                                   f"max_position_embeddings {limit}")
        self.max_num_seqs = max_num_seqs
        self.graph = StaticGraph(self.model_dir, self.manifest, device)
        self.generation_config = load_generation_config(self.model_dir)
        self.tokenizer, self.eos_token_ids = self._tokenizer()
        self.engine = StaticEngine(self.graph, self.tokenizer, self.eos_token_ids, self.max_model_len, max_num_seqs)

    @property
    def session(self) -> Any:
        """The onnxruntime InferenceSession that runs the graph."""
        return self.graph.session

    def _tokenizer(self) -> tuple[Any, list[int]]:
        """The export's tokenizer (None when it has none) and the EOS ids generation stops at."""
        from flashllm.models.tokenizer import eos_token_ids, load_tokenizer

        configured = self.generation_config.get("eos_token_id")
        if not any((self.model_dir / name).is_file() for name in TOKENIZER_FILES):
            logger.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", self.model_dir)
            return None, [] if configured is None else [configured] if isinstance(configured, int) else configured
        try:
            tokenizer = load_tokenizer(self.model_dir)
        except (ValueError, OSError) as exc:
            raise StaticModelError(f"cannot load the tokenizer in {self.model_dir}: {exc}") from None
        return tokenizer, eos_token_ids(tokenizer, self.generation_config)

    def default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from the exported generation_config.json."""
        return SamplingParams.from_generation_config(self.generation_config)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order, as LLM.generate."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = per_prompt(sampling_params, len(prompts), self.default_sampling_params())
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generating", disable=not use_tqdm)
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(prompt, sp))
            while len(final) < len(ids) and self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in ids:  # a bad prompt or a failed step must not leave requests queued
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [final[r] for r in ids]

    def beam_search(self, *args: Any, **kwargs: Any) -> list[RequestOutput]:
        """Not available: beam search needs the dynamic engine's prefix-shared KV blocks."""
        raise StaticModelError("beam search is not available in static mode; use --mode dynamic")

    def _template_dir(self) -> Path:
        return self.model_dir
