"""Benchmarks: model shapes, workloads, the transformers baseline and the machine's limits."""
