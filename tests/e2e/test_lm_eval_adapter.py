"""The lm-eval "flashllm" model on a tiny local model, checked against transformers on the same weights."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[lm-eval]'); the adapter needs it")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from flashllm.eval.lm_eval_adapter import (  # noqa: E402
    MODEL_NAME,
    FlashLLMEval,
    ScoreItem,
    pack_batches,
    rolling_items,
)
from flashllm.eval.windows import Window  # noqa: E402
from flashllm.sampling_params import SamplingParams  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

MAX_LENGTH = 40  # small, so that contexts are cut and texts span several windows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def lm(model_dir: Path) -> FlashLLMEval:
    # 256 scoring tokens = 4 KV blocks of 64: batches hold several windows, so packing is exercised
    return FlashLLMEval(pretrained=str(model_dir), dtype="float32", device="cpu", max_length=MAX_LENGTH,
                        batch_size="auto", max_batch_tokens=256)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def _hf_scores(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of log p(continuation | context) and whether each token is the argmax, the input cut to MAX_LENGTH."""
    model, _ = hf
    ids = (context + continuation)[-(MAX_LENGTH + 1):][:-1]
    logits = model(torch.tensor([ids])).logits[0, -len(continuation):].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(continuation)
    picked = logprobs.gather(1, target.unsqueeze(1)).squeeze(1).double()
    return float(picked.sum()), bool((logprobs.argmax(-1) == target).all())


def _encode(hf, text: str) -> list[int]:
    return hf[1].encode(text, add_special_tokens=False)


def _split(hf, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's rule: trailing spaces move to the continuation; an empty context is the EOS token."""
    if not context:
        return [hf[1].eos_token_id], _encode(hf, continuation)
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    whole, head = _encode(hf, stripped + continuation), _encode(hf, stripped)
    return head, whole[len(head):]


def _greedy_pair(hf) -> tuple[str, str]:
    """A context and its greedy continuation whose text re-encodes to exactly the generated tokens."""
    model, tok = hf
    for context in ("The cat", "Hello", "Once upon a time", "It was", "The quick brown fox"):
        ids = _encode(hf, context)
        for num_tokens in (3, 2, 1):
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=num_tokens,
                                 pad_token_id=tok.eos_token_id)[0].tolist()
            continuation = tok.decode(out[len(ids):])
            if _encode(hf, context + continuation) == out:
                return context, continuation
    raise AssertionError("no greedy continuation round-trips through the tokenizer")


def _greedy_text(hf, ids: list[int], num_tokens: int) -> str:
    model, tok = hf
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=num_tokens, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_registered_under_flashllm() -> None:
    from lm_eval.api.registry import get_model

    assert get_model(MODEL_NAME) is FlashLLMEval


def test_loglikelihood_equals_transformers_log_softmax(lm: FlashLLMEval, hf) -> None:
    pairs = [("The quick brown", " fox jumps over"), ("Hello there. ", "General Kenobi"), ("", "hello world"),
             ("word " * 60, " end of it"), _greedy_pair(hf)]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)], disable_tqdm=True)
    expected = [_hf_scores(hf, *_split(hf, *pair)) for pair in pairs]
    for (logprob, is_greedy), (want, want_greedy) in zip(got, expected, strict=True):
        assert logprob == pytest.approx(want, abs=1e-4)
        assert is_greedy == want_greedy
    assert {g for _, g in expected} == {True, False}  # both answers occur, so is_greedy is really checked


@settings(deadline=None, max_examples=8)
@given(data=st.data())
def test_loglikelihood_tokens_match_transformers_in_any_batch(lm: FlashLLMEval, hf, data: st.DataObject) -> None:
    vocab = hf[0].config.vocab_size
    tokens = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=70)
    pairs = data.draw(st.lists(st.tuples(tokens, st.lists(st.integers(0, vocab - 1), min_size=1,
                                                           max_size=MAX_LENGTH)), min_size=1, max_size=4))
    got = lm._loglikelihood_tokens([(("", ""), ctx, cont) for ctx, cont in pairs], disable_tqdm=True)
    for (logprob, is_greedy), (ctx, cont) in zip(got, pairs, strict=True):
        want, want_greedy = _hf_scores(hf, ctx, cont)
        assert logprob == pytest.approx(want, abs=1e-4)
        assert is_greedy == want_greedy


def test_continuation_longer_than_max_length_is_refused(lm: FlashLLMEval) -> None:
    with pytest.raises(ValueError, match="raise max_length"):
        lm._loglikelihood_tokens([(("", ""), [1], [5] * (MAX_LENGTH + 1))], disable_tqdm=True)


@settings(deadline=None)
@given(num_tokens=st.integers(1, 200), max_length=st.integers(1, 48))
def test_rolling_windows_are_lm_evals_own(num_tokens: int, max_length: int) -> None:
    token_ids = list(range(10, 10 + num_tokens))
    items = rolling_items(token_ids, 0, max_length)
    theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(token_ids, 0, max_length, 1)]
    assert len(items) == len(theirs)
    for item, (context, continuation) in zip(items, theirs, strict=True):
        w = item.window
        assert item.token_ids[w.score_from:w.end] == continuation
        assert item.token_ids[w.begin:w.end - 1] == (context + continuation)[-(max_length + 1):][:-1]
    assert [t for item in items for t in item.token_ids[item.window.score_from:item.window.end]] == token_ids


def test_rolling_equals_transformers_total_log_prob(lm: FlashLLMEval, hf) -> None:
    short, long = "The quick brown fox.", " ".join(["the cat sat on the mat and looked around"] * 12)
    eos = hf[1].eos_token_id
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([short, long])],
                                   disable_tqdm=True)
    short_ids = _encode(hf, short)
    assert len(short_ids) < MAX_LENGTH
    assert got[0] == pytest.approx(_hf_scores(hf, [eos], short_ids)[0], abs=1e-4)
    long_ids = _encode(hf, long)
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(long_ids, eos, MAX_LENGTH, 1)]
    assert len(windows) >= 3  # the text crosses several window boundaries
    assert got[1] == pytest.approx(sum(_hf_scores(hf, c, t)[0] for c, t in windows), abs=1e-3)


@settings(deadline=None)
@given(lengths=st.lists(st.integers(1, 200), max_size=30), max_blocks=st.integers(4, 8),
       max_items=st.none() | st.integers(1, 5))
def test_pack_batches_keeps_every_item_once_within_budget(lengths: list[int], max_blocks: int,
                                                          max_items: int | None) -> None:
    items = [ScoreItem(list(range(n + 1)), Window(0, n + 1, 1)) for n in lengths]
    batches = pack_batches(items, 64, max_blocks, max_items)
    assert sorted(i for b in batches for i in b) == list(range(len(items)))
    for batch in batches:
        assert sum(math.ceil(lengths[i] / 64) for i in batch) <= max_blocks
        assert max_items is None or len(batch) <= max_items


def test_generate_until_is_greedy_and_stops_at_until(lm: FlashLLMEval, hf) -> None:
    contexts = ["The quick brown fox", "Once upon a time", "word " * 60]  # the last one is cut from the left
    max_gen = 10
    full = [_greedy_text(hf, _encode(hf, c)[-(MAX_LENGTH - max_gen):], max_gen) for c in contexts]
    plain = lm.generate_until([Instance("generate_until", {}, (c, {"until": [], "max_gen_toks": max_gen}), i)
                               for i, c in enumerate(contexts)], disable_tqdm=True)
    assert plain == full
    stops = [_ascii_stop(text) for text in full]
    cut = lm.generate_until([Instance("generate_until", {}, (c, {"until": [s, "\x00never"], "max_gen_toks": max_gen}),
                                      i) for i, (c, s) in enumerate(zip(contexts, stops, strict=True))],
                            disable_tqdm=True)
    assert cut == [text[:text.find(stop)] for text, stop in zip(full, stops, strict=True)]
    reference = lm.llm.generate([lm.prompt_ids(c, max_gen) for c in contexts],
                                [SamplingParams(temperature=0.0, max_tokens=max_gen, stop=[s]) for s in stops])
    assert cut == [r.outputs[0].text for r in reference]


def _ascii_stop(text: str) -> str:
    """A two-character printable ASCII piece from the middle of the text (it must exist)."""
    starts = [i for i in range(2, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].strip()]
    assert starts, f"no ASCII stop string in {text!r}"
    return text[starts[len(starts) // 2]:starts[len(starts) // 2] + 2]


def test_gen_kwargs_map_to_sampling_params(lm: FlashLLMEval) -> None:
    greedy = lm.sampling_params({"until": "\n\n", "do_sample": False, "temperature": 0.8}, SamplingParams)
    assert greedy.temperature == 0.0 and greedy.stop == ["\n\n"] and greedy.max_tokens == lm.max_gen_toks
    sampled = lm.sampling_params({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5},
                                 SamplingParams)
    assert (sampled.temperature, sampled.top_p, sampled.max_tokens) == (0.7, 0.9, 5)
    with pytest.raises(ValueError, match="no flashllm equivalent"):
        lm.sampling_params({"num_beams": 4}, SamplingParams)


def test_model_args_win_over_harness_defaults(model_dir: Path) -> None:
    lm = FlashLLMEval.create_from_arg_string(f"pretrained={model_dir},dtype=float32,device=cpu,max_length=32,"
                                             "batch_size=3", {"device": "cuda:0", "batch_size": 1})
    assert (str(lm.device), lm.max_length, lm.batch_limit) == ("cpu", 32, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where cuda:0 cannot be selected")
def test_harness_device_that_cannot_run_names_both_flags(model_dir: Path) -> None:
    from flashllm.registry.resolve import DeviceSelectionError

    with pytest.raises(DeviceSelectionError, match="came from lm-eval's --device"):
        FlashLLMEval.create_from_arg_string(f"pretrained={model_dir}", {"device": "cuda:0", "batch_size": 1})


def test_flashllm_imports_without_lm_eval_and_the_adapter_says_what_to_install() -> None:
    code = ("import sys\n"
            "sys.modules['lm_eval'] = None  # any import of it now fails\n"
            "import flashllm, flashllm.eval, flashllm.llm\n"
            "try:\n"
            "    import flashllm.eval.lm_eval_adapter\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pip install 'lm-eval>=" in done.stdout


def _write_tasks(root: Path) -> list[str]:
    docs = [{"question": "The cat sat on the", "choices": [" mat", " moon", " tree"], "answer": 0},
            {"question": "Hello", "choices": [" world", " there", " friend"], "answer": 2},
            {"question": "Once upon a", "choices": [" time", " hill", " day"], "answer": 1}]
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    common = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)},
                                                         "cache_dir": str(root / "hf-cache")},
              "test_split": "test", "doc_to_text": "{{question}}"}
    tasks = {
        "flashllm_tiny_mc": {"output_type": "multiple_choice", "doc_to_choice": "choices",
                             "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]},
        "flashllm_tiny_gen": {"output_type": "generate_until", "doc_to_target": "{{choices[answer]}}",
                              "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
                              "metric_list": [{"metric": "exact_match"}]},
        "flashllm_tiny_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "",
                              "doc_to_target": "{{question}}", "metric_list": [{"metric": "word_perplexity"}]},
    }
    for name, fields in tasks.items():  # JSON is YAML, so no YAML writer is needed
        (root / f"{name}.yaml").write_text(json.dumps({"task": name, **common, **fields}), encoding="utf-8")
    return docs


def test_simple_evaluate_runs_local_tasks_offline(lm: FlashLLMEval, hf, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    attempts: list[object] = []

    def refuse(self: socket.socket, address: object) -> None:
        attempts.append(address)
        raise OSError(f"test: no network ({address})")

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    docs = _write_tasks(tmp_path)
    names = ["flashllm_tiny_mc", "flashllm_tiny_gen", "flashllm_tiny_ppl"]
    results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=TaskManager(include_path=str(tmp_path),
                                                                                       include_defaults=False),
                                      log_samples=False, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0)
    assert attempts == []
    metrics = results["results"]
    chosen = [max(range(3), key=lambda c: _hf_scores(hf, *_split(hf, d["question"], d["choices"][c]))[0])
              for d in docs]
    assert metrics["flashllm_tiny_mc"]["acc,none"] == pytest.approx(
        sum(c == d["answer"] for c, d in zip(chosen, docs, strict=True)) / len(docs))
    assert 0.0 <= metrics["flashllm_tiny_gen"]["exact_match,none"] <= 1.0
    assert math.isfinite(metrics["flashllm_tiny_ppl"]["word_perplexity,none"])
    assert metrics["flashllm_tiny_ppl"]["word_perplexity,none"] > 1.0
