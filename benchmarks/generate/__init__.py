"""Whole-model `generate()`: prefill and decode speed, peak memory, decode-step anatomy and launches, and the GPU checks
of a patched model (Triton against PyTorch, decode graphs, fused ops). `python -m benchmarks.generate.NAME --help`."""
