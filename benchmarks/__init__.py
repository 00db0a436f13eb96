"""Benchmarks of onebitlamb, run from the repository root (``python -m benchmarks.kernels``); not installed."""
