"""Benchmark scripts. Each writes its own section of BENCHMARKS.md (see ``report``)."""
