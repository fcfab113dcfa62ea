"""Speed benchmarks (CUDA unless a script says otherwise): `python -m evals.bench.NAME --help`."""
