"""LLM.embed against transformers: the base model's last_hidden_state pooled by hand (last token, mean, first
token), normalized, on the reference and cpu backends, with prompts split over prefill chunks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from flashllm.core.pooling import record_pooled
from flashllm.core.sequence import Sequence
from flashllm.llm import LLM
from flashllm.models.errors import ModelLoadError
from flashllm.models.pooling_config import read_pooling
from flashllm.sampling_params import Pooling, SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog again and again and again", "a"]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(f"embed-{request.param}"), request.param, seed=3)


@pytest.fixture(scope="module")
def states(model_dir: Path) -> list[torch.Tensor]:
    """transformers' final hidden states (after the last norm) of each text, (T, H)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(tokenizer(t, return_tensors="pt").input_ids).last_hidden_state[0] for t in TEXTS]


def _expected(state: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    vector = {"last": state[-1], "mean": state.mean(dim=0), "cls": state[0]}[pooling.type][: pooling.dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


@pytest.mark.parametrize("backend", ["reference", None])
def test_embeddings_are_transformers_hidden_states_pooled(model_dir: Path, states: list[torch.Tensor],
                                                          backend: str | None) -> None:
    # 16-token steps: the long text's prompt runs in chunks, which mean pooling must sum
    llm = LLM(str(model_dir), device="cpu", backend=backend, dtype="float32", block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=16)
    for pooling in (Pooling("last"), Pooling("mean"), Pooling("cls"), Pooling("mean", normalize=False, dimensions=9)):
        for state, output in zip(states, llm.embed(TEXTS, pooling), strict=True):
            got = torch.tensor(output.outputs.embedding)
            assert got.shape == (pooling.dimensions or state.shape[1],)
            torch.testing.assert_close(got, _expected(state, pooling), atol=1e-5, rtol=1e-4)


def test_the_default_pooling_is_the_directory_s_and_cache_hits_change_nothing(model_dir: Path,
                                                                              states: list[torch.Tensor]) -> None:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64)
    first = llm.embed(TEXTS[1])[0].outputs.embedding  # no sentence-transformers files: last token, normalized
    again = llm.embed(TEXTS[1])[0].outputs.embedding  # its full blocks now come from the prefix cache
    torch.testing.assert_close(torch.tensor(first), _expected(states[1], Pooling()), atol=1e-5, rtol=1e-4)
    # the cache hit leaves a shorter chunk to run, whose kernels may sum in another order: close, not equal
    torch.testing.assert_close(torch.tensor(again), torch.tensor(first), atol=1e-6, rtol=1e-5)
    assert llm.engine.block_manager.prefix_cache_hit_rate > 0
    ids = llm.tokenizer.encode(TEXTS[1])
    assert llm.embed(TEXTS[1], truncate_prompt_tokens=4)[0].outputs.embedding == llm.embed([ids[-4:]])[0].outputs.embedding


def test_mean_pooling_restarts_with_a_recomputed_prompt() -> None:
    """A preempted prompt runs again from position 0: its sum starts over instead of counting rows twice."""
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(pooling=Pooling("mean")))
    hidden = torch.arange(8.0).view(4, 2)
    for _ in range(2):
        record_pooled(hidden, [(seq, 0, 0, 2)])
        record_pooled(hidden, [(seq, 2, 2, 2)])
    torch.testing.assert_close(seq.pooled, hidden.sum(dim=0))


def _sentence_transformers_dir(root: Path, pooling: dict, modules: list[dict] | None = None) -> Path:
    (root / "1_Pooling").mkdir(parents=True)
    (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = modules or [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                          {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                          {"idx": 2, "name": "2", "path": "2_Normalize",
                           "type": "sentence_transformers.models.Normalize"}]
    (root / "modules.json").write_text(json.dumps(modules))
    return root


def test_sentence_transformers_pooling_is_read(tmp_path: Path) -> None:
    assert read_pooling(tmp_path) == Pooling("last", normalize=True)
    mean = _sentence_transformers_dir(tmp_path / "mean", {"pooling_mode_mean_tokens": True})
    assert read_pooling(mean) == Pooling("mean", normalize=True)
    cls = _sentence_transformers_dir(tmp_path / "cls", {"pooling_mode_cls_token": True}, [
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    assert read_pooling(cls) == Pooling("cls", normalize=False)


@pytest.mark.parametrize(("pooling", "modules", "message"), [
    ({"pooling_mode_max_tokens": True}, None, "must use exactly one of"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": True}, None, "must use exactly one of"),
    ({"pooling_mode_lasttoken": True, "include_prompt": False}, None, "include_prompt false"),
    ({"pooling_mode_mean_tokens": True}, [{"path": "", "type": "sentence_transformers.models.Transformer"},
                                          {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                                          {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
     "this pipeline has"),
    ({"pooling_mode_mean_tokens": True}, [{"path": "../../etc", "type": "sentence_transformers.models.Pooling"}],
     "leaves the model directory"),
])
def test_pipelines_flashllm_cannot_compute_are_refused(tmp_path: Path, pooling: dict, modules: list | None,
                                                       message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        read_pooling(_sentence_transformers_dir(tmp_path / "m", pooling, modules))


def test_pooling_settings_are_checked() -> None:
    for bad in ({"type": "max"}, {"dimensions": 0}, {"normalize": 1}):
        with pytest.raises(ValueError):
            Pooling(**bad)
    with pytest.raises(ValueError, match="n=1"):
        SamplingParams(n=2, pooling=Pooling())


def test_a_checkpoint_saved_from_the_base_model_loads(model_dir: Path, tmp_path: Path) -> None:
    """Tensor names without `model.` and no LM head (a checkpoint saved from the decoder alone, as some embedding
    models ship): with tied embeddings the same weights give the same embeddings; an untied model lacks its head."""
    import shutil

    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    tensors = load_file(str(bare / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if not k.startswith("lm_head.")},
              str(bare / "model.safetensors"), metadata={"format": "pt"})
    if "lm_head.weight" in tensors:  # an untied model: its head is missing, and the loader says so
        with pytest.raises(ModelLoadError, match="missing 1 tensor.*lm_head.weight"):
            LLM(str(bare), device="cpu", dtype="float32", block_size=16, num_kv_blocks=32)
        return
    outputs = [LLM(str(d), device="cpu", dtype="float32", block_size=16, num_kv_blocks=32).embed(TEXTS[:2])
               for d in (model_dir, bare)]
    assert [o.outputs.embedding for o in outputs[0]] == [o.outputs.embedding for o in outputs[1]]
