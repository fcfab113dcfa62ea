"""Figures drawn from result files, no GPU needed: `python -m evals.plots.NAME --help`."""
