"""xgrammar vs llguidance on a 50k byte-level BPE: tokenizer setup, schema compile, per-token mask time.

Run: PYTHONPATH=. python benchmarks/cpu/grammar_libraries.py [out_dir]  (needs both packages; trains the
tokenizer on this machine's Python sources first, ~35 s). Numbers from it are in docs/structured_output.md.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
import time

from flashllm.testing.tokenizer import train_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 5},
    "address": {"type": "object", "additionalProperties": False, "required": ["street", "zip"],
                "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    "kind": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
    "required": ["name", "age", "email", "tags", "address", "kind"]}
DOC = {"name": "Alice Smith", "age": 42, "email": "alice@example.com", "tags": ["red", "blue"],
       "address": {"street": "1 Main Street", "zip": "12345"}, "kind": 3.5}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tok50k"
    corpus = [open(f, encoding="utf-8", errors="replace").read()
              for f in sorted(glob.glob(f"{sys.base_prefix}/lib/python3*/**/*.py", recursive=True))[:3000]]
    tok = train_tokenizer(out, vocab_size=50000, corpus=corpus)
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False) + [tok.eos_token_id]
    for name, run in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
        setup, compile_s, per = run(tok, ids)
        per.sort()
        print(f"{name}: tokenizer setup {setup * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, mask+advance per "
              f"token median {statistics.median(per) * 1e6:.0f} us, p90 {per[int(0.9 * len(per))] * 1e6:.0f} us, "
              f"max {per[-1] * 1e6:.0f} us")


def _xgrammar(tok, ids):  # noqa: ANN001, ANN202
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t
    mask, per = xgr.allocate_token_bitmask(1, len(tok)), []
    for _ in range(3):
        matcher = xgr.GrammarMatcher(grammar)
        for i in ids:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            assert matcher.accept_token(i)
            per.append(time.perf_counter() - t)
    return setup, compile_s, per


def _llguidance(tok, ids):  # noqa: ANN001, ANN202
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    assert not llguidance.LLMatcher(lltok, grammar).is_error()
    compile_s = time.perf_counter() - t
    mask, per = lnp.allocate_token_bitmask(1, len(tok)), []
    for _ in range(3):
        matcher = llguidance.LLMatcher(lltok, grammar)
        for i in ids:
            t = time.perf_counter()
            lnp.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(i)
            per.append(time.perf_counter() - t)
    return setup, compile_s, per


if __name__ == "__main__":
    main()
