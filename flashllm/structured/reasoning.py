"""A constraint that applies after a thinking model's think block: the block stays free text.

vLLM and SGLang hold a reasoning model's structured output to the answer, not to the thinking before it;
flashllm does the same by putting the think block in front of the constraint's grammar, so masks, draft
checks and completion detection need nothing new. The block follows the reasoning parser's rule
(sampling_params.REASONING_PARSERS): `deepseek_r1` always opens with it (a leading `<think>` optional, as the
template usually wrote it), `qwen3` only when the reply starts with `<think>`. After `</think>` the model may
write up to two newlines (Qwen3 and DeepSeek-R1 write two) before the constrained text.

A tag the tokenizer holds as an added token (Qwen3's and DeepSeek-R1's `<think>` and `</think>`) is matched as
that token: llguidance reads added tokens as special tokens, never as their text. Otherwise the tag is text,
and the block's text runs to the first `</think>`, as the reply parser reads it.
"""

from __future__ import annotations

import json
from typing import Any

from flashllm.sampling_params import THINK_END, THINK_START
from flashllm.structured.tags import tag_grammar

_CONSTRAINT = "constraint"  # the wrapped constraint's grammar name, referenced from the outer grammar
_NEWLINES = r"/\n{0,2}/"


def think_block_grammar(parser: str, start: str, end: str) -> str:
    """Lark rules whose `start` is the think block (per `parser`) followed by the rule `@constraint`.

    start, end: tag_grammar's items for THINK_START and THINK_END."""
    if end.startswith("<["):  # a token ends the block: any text before it (the text cannot hold the token)
        reasoning = f"reasoning: REASONING {end}\nREASONING: /(?s:.*)/\n"
    else:  # text ends it: llguidance's lazy `stop` ends the free text at the first tag
        reasoning = f"reasoning: thought\nthought[stop={end}]: /(?s:.*)/\n"
    if parser == "deepseek_r1":
        head = f"start: {start}? reasoning {_NEWLINES} @{_CONSTRAINT}\n"
    else:
        head = f"start: think? @{_CONSTRAINT}\nthink: {start} reasoning {_NEWLINES}\n"
    return head + reasoning


def after_think_block(grammar: str, parser: str, tokenizer: Any) -> str:
    """llguidance's grammar definition of `grammar` (a TopLevelGrammar as JSON text, or Lark text) applied
    after a think block read by `parser`'s rule."""
    if grammar.lstrip().startswith("{"):
        top = json.loads(grammar)
    else:
        top = {"grammars": [{"lark_grammar": grammar}]}
    inner = [dict(g) for g in top["grammars"]]
    inner[0]["name"] = _CONSTRAINT
    rules = think_block_grammar(parser, tag_grammar(tokenizer, THINK_START), tag_grammar(tokenizer, THINK_END))
    outer = {"name": "think_block", "lark_grammar": rules}
    return json.dumps({"grammars": [outer, *inner], "max_tokens": top.get("max_tokens")})
