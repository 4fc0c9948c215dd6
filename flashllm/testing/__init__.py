"""Helpers for tests and demos: a tiny locally trained tokenizer and its training text."""
