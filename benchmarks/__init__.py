"""Benchmarks of longctx-patch and their results, grouped by what they measure.

Run every script from the repository root as a module, e.g. `python -m benchmarks.ops.bench_lola`; see
benchmarks/README.md for what each one measures and how to run it on a CPU and on a GPU.

    ops/       kernel and op speed against the exact baselines, and the kernels' GPU checks
    generate/  whole-model generate(): prefill and decode speed, memory, and the patched model's GPU checks
    train/     the fine-tune trainer's throughput and the device recipes of training runs
    quality/   attention error on real Q/K/V, the synthetic tasks, and their figures
    shared.py  helpers used by several scripts
    index.py   writes results/INDEX.md from every result JSON (`python -m benchmarks.index`)
    results/   one folder per task; results/INDEX.md lists every file
"""
