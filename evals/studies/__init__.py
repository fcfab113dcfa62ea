"""Quality and design studies of one method (CPU unless `--device cuda`): `python -m evals.studies.NAME --help`."""
