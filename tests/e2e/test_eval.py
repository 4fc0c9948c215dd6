"""`flashllm eval ppl|kl|rouge` on a tiny model, checked against transformers and direct torch computations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.cli.eval import main
from flashllm.eval.windows import sliding_windows
from flashllm.testing.corpus import CORPUS
from flashllm.testing.tiny_models import build_tiny_model

TEXT = "\n".join(CORPUS)[:900]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _eval(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text(encoding="utf-8"))


@torch.no_grad()
def _hf_sliding_window_ppl(hf_model, text: str, max_length: int, stride: int) -> tuple[float, int]:
    """The loop of the transformers guide "perplexity of fixed-length models", counting labels exactly."""
    model, tokenizer = hf_model
    ids = torch.tensor([tokenizer.encode(text)])
    seq_len = ids.shape[1]
    nll_sum, count, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        loss = model(input_ids, labels=labels).loss
        scored = int((labels[:, 1:] != -100).sum())  # the model shifts labels left by one
        nll_sum += float(loss) * scored
        count += scored
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll_sum / count), count


@settings(deadline=None)  # the machine is shared; timing says nothing here
@given(num_tokens=st.integers(2, 300), max_length=st.integers(2, 64), data=st.data())
def test_sliding_windows_score_every_token_with_context_once(num_tokens: int, max_length: int,
                                                             data: st.DataObject) -> None:
    stride = data.draw(st.integers(1, max_length))
    scored: list[int] = []
    for w in sliding_windows(num_tokens, max_length, stride):
        assert 0 <= w.begin < w.score_from <= w.end <= num_tokens and w.end - w.begin <= max_length
        rows = list(w.logit_rows())
        assert [w.begin + r + 1 for r in rows] == list(range(w.score_from, w.end))
        scored.extend(range(w.score_from, w.end))
    if stride < max_length:
        assert scored == list(range(1, num_tokens))
    else:  # disjoint chunks: a chunk's first token has no context in its window
        assert scored == [p for p in range(num_tokens) if p % max_length != 0]


@pytest.mark.parametrize(("num_tokens", "max_length", "stride"), [(1, 8, 4), (10, 1, 1), (10, 8, 9), (10, 8, 0)])
def test_sliding_windows_reject_what_cannot_be_scored(num_tokens: int, max_length: int, stride: int) -> None:
    with pytest.raises(ValueError, match="must be|needs at least 2"):
        sliding_windows(num_tokens, max_length, stride)


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-length", "513"], "exceeds the model's max_position_embeddings 512"),
    (["--max-length", "64", "--stride", "65"], "--stride must be in"),
])
def test_ppl_rejects_bad_windows_naming_the_flag(model_dir: Path, text_file: Path, flags: list[str], message: str,
                                                 capsys: pytest.CaptureFixture) -> None:
    assert main(["ppl", "--model", str(model_dir), "--text", str(text_file), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("max_length", "stride"), [(32, 20), (48, 48), (512, 256)])
def test_ppl_equals_transformers_sliding_window_loss(model_dir: Path, text_file: Path, hf_model, tmp_path: Path,
                                                     max_length: int, stride: int) -> None:
    result = _eval(tmp_path, "ppl", "--model", str(model_dir), "--text", str(text_file), "--dtype", "float32",
                   "--device", "cpu", "--max-length", str(max_length), "--stride", str(stride))
    expected, count = _hf_sliding_window_ppl(hf_model, TEXT, max_length, stride)
    assert result["num_tokens"] == count
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(result["nll_sum"] / result["num_tokens"]), rel=1e-12)


def test_ppl_window_of_the_whole_context_is_refused(model_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    # the engine samples one token after each window's prompt, so a window must leave one position free
    text = tmp_path / "long.txt"
    text.write_text("\n".join(CORPUS * 4), encoding="utf-8")
    assert main(["ppl", "--model", str(model_dir), "--text", str(text), "--max-length", "512", "--device", "cpu",
                 "--no-progress"]) == 2
    assert "pass --max-length 511 or less" in capsys.readouterr().err


def test_ppl_in_chunked_prefill_steps_equals_transformers(model_dir: Path, text_file: Path, hf_model,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runner's prompt logprobs score the windows, chunk by chunk: eval's own forward is not used."""
    import flashllm.core.model_runner as model_runner
    import flashllm.eval.forward as forward

    chunks: list[int] = []
    record = model_runner.record_prompt_logprobs

    def counted(model: object, hidden: torch.Tensor, entries: list) -> None:
        chunks.extend(count for _, _, _, count in entries)
        record(model, hidden, entries)

    def no_forward(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval ppl ran its own forward")

    monkeypatch.setattr(model_runner, "record_prompt_logprobs", counted)
    monkeypatch.setattr(forward, "window_hidden", no_forward)
    # chunks of 7 tokens cross the 16-token KV blocks at every offset; each attends to what the
    # earlier chunks of its window wrote
    result = _eval(tmp_path, "ppl", "--model", str(model_dir), "--text", str(text_file), "--dtype", "float32",
                   "--device", "cpu", "--max-length", "48", "--stride", "30", "--chunk-tokens", "7")
    expected, count = _hf_sliding_window_ppl(hf_model, TEXT, 48, 30)
    assert result["num_tokens"] == count
    assert result["perplexity"] == pytest.approx(expected, rel=1e-4)
    # every window's prompt ran in steps of at most 7 tokens, each recording its rows' logprobs
    assert chunks and max(chunks) <= 7 and len(chunks) > result["num_windows"]


@pytest.mark.parametrize("chunk_tokens", [None, 8])
def test_kl_chunk_tokens_reach_the_decode_kernels(model_dir: Path, text_file: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, chunk_tokens: int | None) -> None:
    # int4 weights on the cpu backend: a 64-token window in one prefill takes the dequantize + GEMM
    # path; in 8-token steps every product goes through the native decode kernels (where the
    # int4 one rounds activations to int8), and their distributions are what get compared
    from flashllm.backends.cpu import native

    if native.library() is None:
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    calls = []
    real = native.int_linear
    monkeypatch.setattr(native, "int_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    chunk = [] if chunk_tokens is None else ["--chunk-tokens", str(chunk_tokens)]
    result = _eval(tmp_path, "kl", "--model", str(model_dir), "--text", str(text_file), "--max-length", "64",
                   "--backend", "cpu", "--baseline-backend", "cpu", "--dtype", "float32", "--baseline-dtype",
                   "float32", "--quant-type", "w4a16", "--weightonly-group-size", "64", *chunk)
    assert result["chunk_tokens"] == chunk_tokens
    assert 0 < result["mean_kl"] < 1.0 and result["num_positions"] > 64
    if chunk_tokens is None:
        assert calls == []
    else:
        assert calls and set(calls) <= set(range(1, chunk_tokens + 1))


def test_kl_of_a_configuration_against_itself_is_zero(model_dir: Path, text_file: Path, tmp_path: Path) -> None:
    result = _eval(tmp_path, "kl", "--model", str(model_dir), "--text", str(text_file), "--max-length", "40",
                   "--stride", "24", "--backend", "cpu", "--baseline-backend", "cpu",
                   "--dtype", "float32", "--baseline-dtype", "float32")
    assert result["num_windows"] > 1
    assert result["mean_kl"] == 0.0 and result["max_kl"] == 0.0
    assert result["relative_logit_error"] == 0.0
    assert result["top1_agreement"] == 1.0
    assert result["baseline_perplexity"] == result["candidate_perplexity"]


def test_kl_equals_direct_torch_computation(model_dir: Path, text_file: Path, hf_model, tmp_path: Path) -> None:
    from flashllm.eval.forward import ScoringConfig, load_scoring_parts, window_hidden

    result = _eval(tmp_path, "kl", "--model", str(model_dir), "--text", str(text_file), "--max-length", "512",
                   "--baseline-backend", "reference", "--baseline-dtype", "float32",
                   "--backend", "cpu", "--dtype", "bfloat16")
    logits = []
    for backend, dtype in (("reference", "float32"), ("cpu", "bfloat16")):
        parts = load_scoring_parts(ScoringConfig(str(model_dir), dtype, "cpu", backend), 512)
        ids = parts.tokenizer.encode(TEXT)
        with torch.inference_mode():
            logits.append(parts.model.compute_logits(window_hidden(parts, ids)).float()[:-1])
    base, cand = (torch.log_softmax(x, dim=-1) for x in logits)
    kl = torch.nn.functional.kl_div(cand, base, log_target=True, reduction="none").sum(-1)
    assert result["num_positions"] == len(ids) - 1 == kl.numel()
    assert result["mean_kl"] > 0
    assert result["mean_kl"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert result["max_kl"] == pytest.approx(float(kl.max()), rel=1e-4)
    agreement = float((base.argmax(-1) == cand.argmax(-1)).float().mean())
    assert result["top1_agreement"] == pytest.approx(agreement)
    # logits centred per row (softmax ignores a per-row shift), then one Frobenius-norm ratio
    base_l, cand_l = (x - x.mean(-1, keepdim=True) for x in logits)
    rel = float((cand_l - base_l).norm() / base_l.norm())
    assert rel > 0
    assert result["relative_logit_error"] == pytest.approx(rel, rel=1e-3)
    expected_ppl, _ = _hf_sliding_window_ppl(hf_model, TEXT, 512, 256)
    assert result["baseline_perplexity"] == pytest.approx(expected_ppl, rel=1e-4)


def _needs_rouge_score() -> None:
    pytest.importorskip("rouge_score", reason="ROUGE needs rouge-score (the bench extra)")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


EXAMPLES = [
    {"src": "The morning train left the station", "tgt": "the train left late"},
    {"src": "你好，世界", "tgt": "世界你好"},
    {"src": "A small cat slept on the warm hood", "tgt": "a cat slept"},
]


def test_rouge_with_transformers_reference_writes_both_scores(model_dir: Path, tmp_path: Path) -> None:
    _needs_rouge_score()
    data = _write_jsonl(tmp_path / "data.jsonl", EXAMPLES)
    saved = tmp_path / "pred.jsonl"
    result = _eval(tmp_path, "rouge", "--model", str(model_dir), "--data", str(data), "--reference", "transformers",
                   "--max-tokens", "8", "--dtype", "float32", "--device", "cpu", "--save-predictions", str(saved))
    assert result["num_examples"] == 3 and len(result["examples"]) == 3
    ours, theirs = result["scores"]["flashllm"], result["scores"]["transformers"]
    assert set(ours) == set(theirs) == {"rouge1", "rouge2", "rougeL", "rougeLsum"}
    assert all(0.0 <= v <= 100.0 for v in [*ours.values(), *theirs.values()])
    assert result["difference"] == {k: pytest.approx(ours[k] - theirs[k]) for k in ours}
    for example, row in zip(EXAMPLES, result["examples"], strict=True):
        assert row["src"] == example["src"] and row["tgt"] == example["tgt"]
        # greedy on the same fp32 weights and prompt tokens: the two engines must agree
        assert row["flashllm"] == row["transformers"]
    # the saved predictions, scored without a model, give the same numbers
    rescored = _eval(tmp_path, "rouge", "--predictions", str(saved), "--data", str(data))
    assert rescored["scores"]["predictions"] == pytest.approx(ours)


def test_rouge_of_predictions_equal_to_references_is_100(tmp_path: Path) -> None:
    _needs_rouge_score()
    data = _write_jsonl(tmp_path / "data.jsonl", EXAMPLES)
    predictions = _write_jsonl(tmp_path / "pred.jsonl", [{"output": e["tgt"]} for e in EXAMPLES])
    result = _eval(tmp_path, "rouge", "--predictions", str(predictions), "--data", str(data))
    assert result["scores"]["predictions"] == pytest.approx(dict.fromkeys(result["scores"]["predictions"], 100.0))


def test_rouge_bad_data_line_is_reported_with_its_number(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _needs_rouge_score()
    data = tmp_path / "data.jsonl"
    data.write_text('{"src": "a", "tgt": "b"}\n{"src": "a"}\n', encoding="utf-8")
    predictions = _write_jsonl(tmp_path / "pred.jsonl", [{"prediction": "b"}, {"prediction": "c"}])
    assert main(["rouge", "--predictions", str(predictions), "--data", str(data)]) == 2
    assert "line 2" in capsys.readouterr().err
