"""Benchmark scripts, run from the repository root as modules (``python -m benchmarks.e2e``);
they write JSON under benchmarks/results/. Never imported by the product."""
