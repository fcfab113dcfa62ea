"""Benchmarks, studies and device checks of longctx-patch, and their results.

Run every script from the repository root as a module, e.g. `python -m evals.bench.bench_lola`; see
evals/README.md for what each one measures.

    bench/     speed: kernels against their references and cuDNN/flash, model prefill/decode, training steps
               (bench_*.py, *_profile.py, lola_train_step, muse_model_prefill), and the synthetic-task sweep
    studies/   quality and design studies of one method on real Q/K/V or a real model (muse_*, lola_*)
    device/    checks that need a CUDA GPU (integration, racecheck, determinism) and the shell recipes of the
               device machine (*.sh)
    plots/     figures drawn from result files (no GPU)
    shared.py  helpers used by several scripts
    index.py   writes results/INDEX.md from every result JSON (`python -m evals.index`)
    results/   one folder per task; results/INDEX.md lists every file
"""
