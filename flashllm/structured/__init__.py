"""Structured output: grammars compiled once per constraint, a matcher per sequence, a token mask per step."""

from __future__ import annotations

from flashllm.structured.compiler import CompiledGrammar, GrammarCompiler, StructuredOutputError
from flashllm.structured.mask import GrammarState, apply_grammar_masks

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarState", "StructuredOutputError", "apply_grammar_masks"]
