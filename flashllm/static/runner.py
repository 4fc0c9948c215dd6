"""Static-graph mode: run an exported ONNX decoder step through onnxruntime with flashllm's sampler."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from flashllm.core.request import Request
from flashllm.core.sampler import Sampler
from flashllm.core.sequence import Sequence as Seq
from flashllm.models.hf_config import load_hf_config
from flashllm.models.loader import load_generation_config
from flashllm.outputs import RequestOutput
from flashllm.sampling_params import SamplingParams
from flashllm.static.manifest import MODEL_FILE, StaticManifest, StaticModelError, read_manifest

logger = logging.getLogger(__name__)

Prompt = str | list[int]
MAX_DEFAULT_MODEL_LEN = 8192
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
DEVICE_PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Left padding slots hold this id; the attention mask hides them, so any valid id works.
PAD_TOKEN_ID = 0


def onnxruntime_module() -> Any:
    """Import onnxruntime, or raise StaticModelError naming the extra to install."""
    try:
        import onnxruntime
    except ImportError:
        raise StaticModelError("static mode needs onnxruntime, which is not installed; "
                               "run `pip install 'flashllm[onnx]'`") from None
    return onnxruntime


def select_providers(device: str, available: Sequence[str]) -> list[Any]:
    """onnxruntime execution providers for --device auto | cpu | cuda | cuda:N.

    auto: CUDA when onnxruntime has it, else CPU; cuda:N passes device_id N to the CUDA provider.
    An explicit device whose provider is missing is a StaticModelError naming the package to install.
    """
    kind, _, index = device.partition(":")
    if kind == "auto":
        kind = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if kind not in DEVICE_PROVIDERS or (index and not (kind == "cuda" and index.isdigit())):
        raise StaticModelError(f"--device {device!r} is not supported in static mode; use auto, cpu, cuda or cuda:N")
    providers: list[Any] = list(DEVICE_PROVIDERS[kind])
    if providers[0] not in available:
        raise StaticModelError(f"--device {device} needs onnxruntime's {providers[0]}, which this onnxruntime "
                               f"lacks (it has {', '.join(available)}); install onnxruntime-gpu")
    if index:
        providers[0] = (providers[0], {"device_id": int(index)})
    return providers


class StaticLLM:
    """Generate with an exported static graph (`flashllm export --format onnx`) through onnxruntime.

    Each batch of up to `max_num_seqs` sequences is left-padded into one (B, T) prefill, then decoded
    one token per step with the KV cache the graph returns; finished rows leave the batch. Sampling,
    stop tokens / strings, detokenization and outputs are flashllm's own (core.sampler, core.request),
    so results have the dynamic engine's shape and, for greedy decoding, its tokens.
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
        self.session = self._session(device)
        self.generation_config = load_generation_config(self.model_dir)
        self.tokenizer, self.eos_token_ids = self._tokenizer()
        self.sampler = Sampler()
        self._chat_template: Any = None
        self._ids = itertools.count()

    def _session(self, device: str) -> Any:
        ort = onnxruntime_module()
        providers = select_providers(device, ort.get_available_providers())
        session = ort.InferenceSession(str(self.model_dir / MODEL_FILE), providers=providers)
        inputs = [i.name for i in session.get_inputs()]
        outputs = [o.name for o in session.get_outputs()]
        if inputs != self.manifest.inputs or outputs != self.manifest.outputs:
            raise StaticModelError(f"{self.model_dir / MODEL_FILE} does not match its manifest (graph inputs "
                                   f"{inputs[:4]}..., outputs {outputs[:2]}...); export the model again")
        logger.info("static mode: %s on %s", self.model_dir, session.get_providers()[0])
        return session

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
        from flashllm.llm import _per_prompt

        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = _per_prompt(sampling_params, len(prompts), self.default_sampling_params())
        requests = [self._request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        rows = [(r, seq) for r in requests for seq in r.seqs]
        bar = tqdm(total=len(requests), desc="generating", disable=not use_tqdm)
        try:
            for start in range(0, len(rows), self.max_num_seqs):
                self._run_batch(rows[start:start + self.max_num_seqs])
                bar.n = sum(r.finished for r in requests)
                bar.refresh()
        finally:
            bar.close()
        return [r.output() for r in requests]

    def _request(self, prompt: Prompt, params: SamplingParams) -> Request:
        if params.use_beam_search:
            raise ValueError("beam search is not available in static mode; use --mode dynamic")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token ids")
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        vocab = self.manifest.vocab_size
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"the prompt must be 1 or more token ids in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one generated token")
        return Request(f"req-{next(self._ids)}", text, ids, params, self.tokenizer, self.eos_token_ids,
                       torch.device("cpu"))

    def _run_batch(self, rows: list[tuple[Request, Seq]]) -> None:
        """Prefill the rows together (left-padded), then decode until each one finishes."""
        lengths = [seq.num_tokens for _, seq in rows]
        width = max(lengths)
        input_ids = np.full((len(rows), width), PAD_TOKEN_ID, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, (_, seq) in enumerate(rows):
            input_ids[i, width - lengths[i]:] = seq.token_ids
            mask[i, width - lengths[i]:] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        past = self._empty_past(len(rows))
        while rows:
            logits, past = self._step(input_ids, positions, mask, past)
            keep = self._sample(rows, logits[:, -1])
            rows = [rows[i] for i in keep]
            past = [kv[keep] for kv in past]
            mask = np.concatenate([mask[keep], np.ones((len(keep), 1), dtype=np.int64)], axis=1)
            input_ids = np.array([[seq.last_token_id] for _, seq in rows], dtype=np.int64).reshape(-1, 1)
            positions = np.array([[seq.num_tokens - 1] for _, seq in rows], dtype=np.int64).reshape(-1, 1)

    def _empty_past(self, batch: int) -> list[np.ndarray]:
        m = self.manifest
        shape = (batch, m.num_kv_heads, 0, m.head_dim)
        return [np.zeros(shape, dtype=NUMPY_DTYPES[m.dtype]) for _ in range(2 * m.num_layers)]

    def _step(self, input_ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
              past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One graph run: (B, T) ids/positions, (B, past+T) mask -> logits (B, T, V), present KV."""
        feeds = dict(zip(self.manifest.inputs, [input_ids, positions, mask, *past], strict=True))
        logits, *present = self.session.run(None, feeds)
        return logits, present

    def _sample(self, rows: list[tuple[Request, Seq]], logits: np.ndarray) -> list[int]:
        """Sample one token per row, record it; returns the indices of the rows still running."""
        states = [request.sampling_state(seq) for request, seq in rows]
        sampled = self.sampler(torch.from_numpy(np.ascontiguousarray(logits)), states)
        now = time.monotonic()
        keep = []
        for row, ((request, seq), token) in enumerate(zip(rows, sampled.token_ids, strict=True)):
            seq.append_token(token)
            if request.on_token(seq, sampled, row, now, self.max_model_len) is None:
                keep.append(row)
        return keep

    def beam_search(self, *args: Any, **kwargs: Any) -> list[RequestOutput]:
        """Not available: beam search needs the dynamic engine's prefix-shared KV blocks."""
        raise StaticModelError("beam search is not available in static mode; use --mode dynamic")

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation with the chat template and generate (as LLM.chat)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, chat_template, add_generation_prompt) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def render_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the sandboxed chat template (as LLM.render_chat)."""
        text = self.chat_template(chat_template).render(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_template(self, chat_template: str | None = None) -> Any:
        """The ChatTemplate to render with: a built-in name, a template string, or the export's own."""
        from flashllm.llm import select_chat_template

        template, self._chat_template = select_chat_template(chat_template, self._chat_template, self.model_dir)
        return template

    def has_chat_template(self) -> bool:
        """Whether the export ships a chat template."""
        try:
            self.chat_template()
        except ValueError:
            return False
        return True
