"""Checks that need a CUDA GPU (`python -m evals.device.NAME`) and the device machine's shell recipes (*.sh)."""
