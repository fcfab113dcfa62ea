"""Evaluation tasks behind `longctx eval`: niah (retrieval), ppl (long-text perplexity), approx (attention
fidelity against exact softmax attention), speed (model-level and op-level timing and memory).

Each `run_*` function takes a model name (or a loaded `(model, tokenizer)` pair) and a list of
`MethodRun`s (see `parse_methods`), compares the methods on the same inputs, prints a table and writes
`<name>.json` (+ a PNG plot) into `TASK/` of the results folder: `$LONGCTX_RESULTS` when set, else `longctx-results/`
in the working directory (`common.default_results_dir`), or into the `out_dir` given.
"""

from .common import MethodRun, parse_methods, parse_sizes, write_result

__all__ = ["MethodRun", "parse_methods", "parse_sizes", "write_result"]
