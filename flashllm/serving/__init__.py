"""Serving: the OpenAI-compatible HTTP server, its async engine wrapper and the web UI."""
