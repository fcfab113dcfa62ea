"""Kernel and op speed: each op against its PyTorch reference and the exact baselines (cuDNN, flash) in the same run,
and the GPU checks of the kernels (racecheck, 64-bit offsets). `python -m benchmarks.ops.NAME --help`."""
