"""Evaluation tasks behind `longctx eval`: niah (retrieval), ppl (long-text perplexity), approx (attention
fidelity against exact softmax attention), speed (model-level and op-level timing and memory).

Each `run_*` function takes a model name (or a loaded `(model, tokenizer)` pair) and a list of
`MethodRun`s (see `parse_methods`), compares the methods on the same inputs, prints a table and writes
`benchmarks/results/<name>.json` (+ a PNG plot).
"""

from .common import MethodRun, parse_methods, parse_sizes, write_result

__all__ = ["MethodRun", "parse_methods", "parse_sizes", "write_result"]
