"""Accuracy studies still in use: attention error on a real model's Q/K/V, the synthetic ICR / ICL tasks, and the
figures drawn from their results. `python -m benchmarks.quality.NAME --help`."""
